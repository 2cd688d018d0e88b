"""Stage two's forward and backward as CUDA graphs, one per micro-batch shape (`train.cuda_graphs`).

The SmolLM2-sized drafter's step is bound by the host: on an H200 the host needed 122 of a 131 ms step
to enqueue its kernels (12-03; compiled halves, flex attention, the loss chunks, each a Python call).
A CUDA graph replays a recorded forward and backward with one launch, so the host no longer paces the
GPU. A graph replays fixed shapes at fixed addresses, hence:

- Shapes: the collate pads every micro-batch to a few shapes (`collate_packed(graph_tokens=...)`): the
  token axis to the step's token budget, the anchors and labelled rows up `dflash.padding.graph_size`'s
  ladder (at most 1/8 padding). Padding is what the collate always adds (doc -1: never seen and seeing
  nothing; padded anchors carry no label; padded label rows are row 0, a slot 0, weight 0), so the loss
  and gradients are those of the unpadded micro-batch (tests/test_graphs.py).
- Inputs: each shape has buffers of its own (outside the graphs' memory), copied into before a replay.
- Gradients: allocated once, zeroed and never freed (`optimizer.zero_grad(set_to_none=False)`), so
  every graph and every eager step accumulates into the same tensors; clipping and the fused AdamW step
  stay eager (a few launches).
- When: a shape runs eagerly the first time it is seen (it compiles what it needs and warms the capture
  stream), is captured the second time and replayed from then on; at most `max_graphs` are kept and
  later new shapes stay eager.
- Memory: the graphs share one pool. That is safe because every replay's outputs are read (into the
  step's device sums, the loss cloned) before the next replay; a graph's intermediates may reuse
  another's output memory, never a live input, parameter, gradient or optimizer state.

Single process only: under DDP the backward's all-reduce would have to be captured too, so a
distributed run trains eagerly (the trainer says so). Activation checkpointing (it saves the RNG state
on the host) and gathered context keys (their count changes with every micro-batch) are refused beside
graphs when the config loads.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import torch

from dflash.padding import micro_batch_multiple, round_up

MAX_GRAPHS = 48  # distinct micro-batch shapes captured at most (each keeps its input buffers)


def forward_backward(model, ctx, batch: dict, divisor: int):
    """The eager step's work on one micro-batch: the loss (`dflash.train.step.forward_loss`) and its
    backward, scaled as `train_step` scales it over `divisor` micro-batches."""
    from dflash.train.step import forward_loss

    out, valid_AB = forward_loss(model, ctx, batch)
    (out.objective / divisor).backward()
    return out, valid_AB


def shape_key(batch: dict, divisor: int, soft: bool) -> tuple:
    """What a captured graph depends on: every device tensor's name, shape and dtype, the fused step's
    group count (the loss's host-side number), the divisor and whether the distillation term runs."""
    tensors = tuple(sorted((name, tuple(value.shape), value.dtype) for name, value in batch.items()
                           if isinstance(value, torch.Tensor) and value.is_cuda))
    return tensors, len(batch.get("group_buckets", [None])), divisor, soft


@dataclasses.dataclass
class Captured:
    graph: torch.cuda.CUDAGraph
    inputs: dict[str, torch.Tensor]
    out: object  # dflash.model.loss.LossOutput, in the graphs' pool
    valid_AB: torch.Tensor


class StepGraphs:
    """The captured forward-and-backward graphs of one training process (see the module docstring);
    `tokens` is the token axis its collate pads to."""

    def __init__(self, device: torch.device, tokens: int, max_graphs: int = MAX_GRAPHS):
        self.device = device
        self.tokens = tokens
        self.max_graphs = max_graphs
        self.stream = torch.cuda.Stream(device)
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[tuple, Captured] = {}
        self.seen: Counter = Counter()
        self.counts: Counter = Counter()  # micro-batches run "eager", "captured", "replayed"

    def run(self, model, ctx, batch: dict, divisor: int):
        """`forward_backward` of one micro-batch (already on the device): replayed, captured or eager."""
        soft = ctx.distill_weight > 0 and "topk_ids" in batch
        key = shape_key(batch, divisor, soft)
        captured = self.graphs.get(key)
        if captured is not None:
            for name, buffer in captured.inputs.items():
                buffer.copy_(batch[name], non_blocking=True)
            captured.graph.replay()
            self.counts["replayed"] += 1
            return replayed_outputs(captured)
        self.seen[key] += 1
        allocate_gradients(model)
        current = torch.cuda.current_stream(self.device)
        if self.seen[key] == 1 or len(self.graphs) >= self.max_graphs:
            # Eager, on the stream captures use (the docs' warm-up: lazy handles and workspaces exist there).
            self.stream.wait_stream(current)
            with torch.cuda.stream(self.stream):
                out, valid_AB = forward_backward(model, ctx, batch, divisor)
            current.wait_stream(self.stream)
            self.counts["eager"] += 1
            return out, valid_AB
        inputs = {name: value.clone() for name, value in batch.items()
                  if isinstance(value, torch.Tensor) and value.is_cuda}
        graph = torch.cuda.CUDAGraph()
        # thread_local: the loader's pin-memory thread keeps calling CUDA while this thread captures.
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream, capture_error_mode="thread_local"):
            out, valid_AB = forward_backward(model, ctx, {**batch, **inputs}, divisor)
        captured = self.graphs[key] = Captured(graph, inputs, out, valid_AB)
        graph.replay()  # capture records the kernels without running them
        self.counts["captured"] += 1
        return replayed_outputs(captured)

    def summary(self) -> str:
        """One line for the trainer's summary: graphs kept and how the micro-batches ran."""
        total = sum(self.counts.values())
        graphed = self.counts["captured"] + self.counts["replayed"]
        return (f"CUDA graphs: {len(self.graphs)} shapes captured, {graphed:,} of {total:,} micro-batches graphed "
                f"({self.counts['eager']:,} eager: first sight of a shape)")


def replayed_outputs(captured: Captured):
    """The replay's outputs; the loss is cloned because the step's stats keep it past the next replay."""
    out = captured.out
    return dataclasses.replace(out, objective=out.objective.detach().clone()), captured.valid_AB


def allocate_gradients(model) -> None:
    """Zeroed gradients for every trainable parameter that has none (once: they are never freed)."""
    for parameter in model.parameters():
        if parameter.requires_grad and parameter.grad is None:
            parameter.grad = torch.zeros_like(parameter)


def graph_tokens(config) -> int:
    """The token axis a graphed step's micro-batches are padded to: the budget of the micro-batches one
    forward packs (all accum_steps of a step with train.fuse_accum), rounded to the flex padding."""
    per_batch = round_up(config.train.token_budget, micro_batch_multiple("flex"))
    return per_batch * (config.train.accum_steps if config.train.fuse_accum else 1)


def train_graphs(config, dist) -> tuple[StepGraphs | None, str]:
    """The trainer's `StepGraphs` for `train.cuda_graphs` (None: eager), and a line saying why not when
    asked for and not used (the CPU, several processes)."""
    if not config.train.cuda_graphs:
        return None, ""
    if dist.device.type != "cuda":
        return None, "train.cuda_graphs: ignored on the CPU"
    if dist.is_distributed:
        return None, f"train.cuda_graphs: eager steps across {dist.world_size} processes (graphs are single-process)"
    return StepGraphs(dist.device, graph_tokens(config)), ""
