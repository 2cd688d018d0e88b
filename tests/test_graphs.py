"""CUDA-graphed training steps (`train.cuda_graphs`, dflash/train/graphs.py) against plain references.

- The padding a graphed step's collate adds (tokens to the budget, anchors and labelled rows up
  `graph_size`'s ladder) leaves the loss, its metrics and the gradients of the unpadded micro-batch
  (CPU, dense attention, fresh random samples, plain and fused micro-batches).
- On a GPU: steps replayed from CUDA graphs equal the same steps run eagerly, on fresh inputs copied into
  the captured buffers (the trainer's path: flex attention from the collate's tiles, compiled layers),
  and stay within the compiled tolerance of the unpadded eager steps.
"""

import dataclasses

import numpy as np
import pytest
import torch

from dflash.config import Config, ConfigError, replace
from dflash.dist import DistState
from dflash.model.drafter import DFlashDrafter, compile_layers, drafter_args
from dflash.model.loss import gamma_weights
from dflash.model.masks import layer_windows
from dflash.padding import graph_size, round_up
from dflash.train.batch import collate_packed
from dflash.train.graphs import Captured, StepGraphs, forward_backward, graph_tokens, replayed_outputs, train_graphs
from dflash.train.step import TrainContext, to_device, train_step
from support import RANDOM_HIDDEN, VOCAB, random_items

TOKENS = 5120  # the graphed collate's token axis here (a micro-batch holds at most 12 samples of < 400 tokens)


def test_graph_size_pads_at_most_an_eighth_onto_a_few_sizes():
    sizes = [graph_size(n, 128) for n in range(1, 70_000)]
    assert all(size % 128 == 0 and size >= n for n, size in zip(range(1, 70_000), sizes))
    assert all(size - n <= max(127, n // 8) for n, size in zip(range(1, 70_000), sizes))
    assert len(set(sizes)) <= 8 * 10  # 8 per doubling
    assert graph_size(0, 128) == 128 and graph_size(4096, 128) == 4096 and graph_size(4097, 128) == 4608
    with pytest.raises(ValueError, match="power of two"):
        graph_size(10, 16, steps_per_octave=3)


def tiny_context(backend: str, device, graphs=None) -> TrainContext:
    generator = torch.Generator().manual_seed(0)
    args = drafter_args("tiny", mask_token_id=VOCAB - 1, vocab_size=VOCAB)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return TrainContext(args=args, codec="bf16",
                        embed_VH=(0.02 * torch.randn(VOCAB, RANDOM_HIDDEN, generator=generator)).to(device, dtype),
                        lm_head_VH=(0.02 * torch.randn(VOCAB, RANDOM_HIDDEN, generator=generator)).to(device, dtype),
                        weights_B=gamma_weights(args.block_size, 7.0, device=device), backend=backend,
                        loss_chunk=256, device=device, graphs=graphs)


def step_items(seed: int, fused: bool) -> list[dict]:
    """One micro-batch's samples: six short ones, or (fused) two micro-batches' six each as groups 0 and 1."""
    lengths = np.random.default_rng(seed).integers(20, 90, 12).tolist()
    if not fused:
        return random_items(seed, lengths=lengths[:6])
    return random_items(seed, group=0, lengths=lengths[:6]) + random_items(seed + 1000, group=1, lengths=lengths[6:])


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("seed", range(2))
def test_the_graphed_collate_padding_keeps_the_loss_and_gradients(seed, fused):
    items = step_items(seed, fused)
    args = drafter_args("tiny", mask_token_id=VOCAB - 1, vocab_size=VOCAB)
    plain = collate_packed(items, pad_multiple=16, block_size=args.block_size)
    tokens = int(plain["num_tokens"]) + 256  # every padding the graphed collate adds, at a size the CPU runs quickly
    padded = collate_packed(items, pad_multiple=16, block_size=args.block_size, graph_tokens=tokens)
    assert int(padded["num_tokens"]) == tokens
    assert len(padded["anchor_pos"]) == graph_size(len(plain["anchor_pos"]), 16)
    assert len(padded["label_rows"]) == graph_size(len(plain["label_rows"]), 16)
    assert len(padded["label_rows"]) > len(plain["label_rows"]) or len(padded["anchor_pos"]) > len(plain["anchor_pos"])
    results = []
    for batch in (plain, padded):
        ctx = tiny_context("dense", torch.device("cpu"))
        torch.manual_seed(0)
        model = DFlashDrafter(ctx.args)
        out, valid_AB = forward_backward(model, ctx, batch, 2)
        real = int(batch["num_real_anchors"])
        results.append((out, valid_AB[:real], out.correct[:real], [p.grad.clone() for p in model.parameters()]))
    (plain_out, plain_valid, plain_correct, plain_grads), (out, valid, correct, grads) = results
    torch.testing.assert_close(out.loss, plain_out.loss, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(out.weight_sum, plain_out.weight_sum)
    assert torch.equal(valid, plain_valid) and torch.equal(correct, plain_correct)
    for grad, plain_grad in zip(grads, plain_grads):
        torch.testing.assert_close(grad, plain_grad, rtol=1e-4, atol=1e-6)


def test_graphs_are_refused_beside_what_they_cannot_capture_and_ignored_on_the_cpu():
    cpu = DistState(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    on = replace(Config(), train={"cuda_graphs": True})
    assert train_graphs(replace(Config(), train={}), cpu) == (None, "")
    assert train_graphs(on, cpu) == (None, "train.cuda_graphs: ignored on the CPU")
    for key in ("activation_checkpointing", "gather_context_keys"):
        with pytest.raises(ConfigError, match=f"train.cuda_graphs cannot be used with train.{key}"):
            replace(Config(), train={"cuda_graphs": True, key: True})
    fused = replace(Config(), train={"cuda_graphs": True, "fuse_accum": True, "accum_steps": 2, "token_budget": 5000})
    assert graph_tokens(fused) == 2 * round_up(5000, 128)


class UpdateByGradient(torch.optim.Optimizer):
    """Plain gradient descent at lr 1, which accepts `found_inf` as train_step sets it (SGD does not)."""

    def __init__(self, params):
        super().__init__(params, {"lr": 1.0})

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    param.sub_(group["lr"] * param.grad)


def gpu_steps(fused: bool, padded: bool, device) -> list[list[dict]]:
    """Four steps of fresh samples: three of two micro-batches (fused: one micro-batch of two groups) of one
    padded shape, then one of a single plain micro-batch (another graph key: eager)."""
    args = drafter_args("tiny", mask_token_id=VOCAB - 1, vocab_size=VOCAB)
    windows = layer_windows(args.layer_types, args.sliding_window)
    lengths = [380, 300, 250, 200, 150, 120]  # every sample has more than 32 eligible anchors: 192 per six

    def batch(seed: int, fused: bool = fused) -> dict:
        items = (random_items(seed, lengths=lengths, supervised=0.9) if not fused else
                 random_items(seed, group=0, lengths=lengths, supervised=0.9)
                 + random_items(seed + 1000, group=1, lengths=lengths, supervised=0.9))
        host = collate_packed(items, pad_multiple=128, block_size=args.block_size, mask_windows=windows,
                              graph_tokens=TOKENS if padded else 0)
        if padded:  # one label-row count for every micro-batch: the same graph key (more padding rows of row 0)
            rows = host["label_rows"][host["label_rows"] > 0]
            host["label_rows"] = torch.zeros(len(host["anchor_pos"]) * (args.block_size - 1), dtype=rows.dtype)
            host["label_rows"][:len(rows)] = rows
        return to_device(host, device)

    if fused:
        return [[batch(10)], [batch(11)], [batch(12)], [batch(16, fused=False)]]
    return [[batch(10), batch(11)], [batch(12), batch(13)], [batch(14), batch(15)], [batch(16)]]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fused", [False, True])
def test_graphed_steps_equal_eager_steps_on_fresh_inputs(fused):
    device = torch.device("cuda")
    runs = {}
    for arm in ("eager", "eager padded", "graphed"):
        graphs = StepGraphs(device, TOKENS) if arm == "graphed" else None
        ctx = tiny_context("flex", device, graphs)
        torch.manual_seed(0)
        model = DFlashDrafter(ctx.args).to(device)
        before = [p.detach().float().clone() for p in model.parameters()]
        compile_layers(model)
        optimizer = UpdateByGradient(model.parameters())
        losses, norms = [], []
        for index, step in enumerate(gpu_steps(fused, arm != "eager", device)):
            stats = train_step(model, ctx, step, optimizer, lr=1.0, clip=1.0, step=index + 1)
            losses.append(float(stats.values[0]) / stats.micro_batches)
            norms.append(float(stats.grad_norm))
        updates = [p.detach().float() - start for p, start in zip(model.parameters(), before)]
        runs[arm] = (np.array(losses), np.array(norms), updates, graphs)
    graphs = runs["graphed"][3]
    # The first shape: eager once, captured the second time, replayed after; the last step's shape: eager.
    assert dict(graphs.counts) == {"eager": 2, "captured": 1, "replayed": 1 if fused else 4}
    np.testing.assert_allclose(runs["graphed"][0], runs["eager padded"][0], rtol=1e-5)
    np.testing.assert_allclose(runs["graphed"][1], runs["eager padded"][1], rtol=1e-4)
    for index, (graphed, eager) in enumerate(zip(runs["graphed"][2], runs["eager padded"][2])):
        torch.testing.assert_close(graphed, eager, rtol=1e-4, atol=1e-6, msg=f"parameter {index}")
    np.testing.assert_allclose(runs["graphed"][0], runs["eager"][0], rtol=5e-3)
    for index, (graphed, eager) in enumerate(zip(runs["graphed"][2], runs["eager"][2])):
        gap = (graphed - eager).norm() / eager.norm().clamp_min(1e-12)
        assert gap < 2e-2, f"parameter {index}: the graphed update differs from the unpadded eager one by {gap:.2e}"


def test_the_replayed_outputs_keep_the_loss_past_the_next_replay():
    """The step's stats keep each micro-batch's loss for the non-finite guard: a replay returns a copy."""
    @dataclasses.dataclass
    class Out:
        objective: torch.Tensor

    captured = Captured(graph=None, inputs={}, out=Out(torch.ones(())), valid_AB=torch.ones(2, 2, dtype=torch.bool))
    out, _ = replayed_outputs(captured)
    captured.out.objective.fill_(5.0)
    assert float(out.objective) == 1.0
