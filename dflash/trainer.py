"""The training step and what it needs: the drafter's context (frozen head, loss weights,
attention backend), the optimizer and learning rate, parallelism, the per-epoch schedule and
loader, device-side metric sums and the non-finite guard.

dflash/training.py runs the loop around them (checkpoints, logging, evaluation);
tools/bench_stage2.py times `train_step` itself. Only logging steps move numbers to the host.
"""

import functools
import math
from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as torch_dist

from dflash import codecs
from dflash.batch import build_loader
from dflash.config import Config
from dflash.dist import DistState
from dflash.drafter import DFlashDrafter, DrafterArgs, block_embeddings, block_positions, compile_layers
from dflash.errors import DflashError
from dflash.export import load_exported
from dflash.loss import block_labels, block_metrics, default_gamma, dflash_loss, gamma_weights
from dflash.masks import build_masks, default_backend
from dflash.sampler import DataCursor, build_epoch_schedule


class NonFiniteError(DflashError, FloatingPointError):
    """A step's loss or gradient was NaN/Inf; the message names the step and its samples."""


@dataclass
class TrainContext:
    """What every step needs besides the model: frozen head, loss weights, backend."""

    args: DrafterArgs
    codec: str
    embed_VH: torch.Tensor
    lm_head_VH: torch.Tensor
    weights_B: torch.Tensor
    backend: str
    loss_chunk: int
    device: torch.device

    @property
    def autocast(self):
        if self.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return nullcontext()


def schedule_for(config: Config, reader, train_indices, dist: DistState, epoch: int, stream: tuple[int, ...] = ()):
    return build_epoch_schedule(reader.index["length"], reader.index["bucket"], config.train.token_budget,
                                dist.world_size, config.train.accum_steps, config.train.seed, epoch,
                                sample_indices=train_indices, anchors=anchor_counts(config, reader),
                                anchor_budget=config.train.anchor_budget, stream=stream)


def anchor_counts(config: Config, reader) -> np.ndarray:
    """Per-sample anchors, at most max_anchors (an upper bound: one more than the eligible count
    when the first token is supervised); read from the store index, no sample is read."""
    return np.minimum(reader.index["num_supervised"], config.train.max_anchors)


def build_model(config: Config, args: DrafterArgs, dist: DistState) -> DFlashDrafter:
    """fp32 master weights on the device; a published drafter can be the starting point."""
    model = DFlashDrafter(args)
    if config.drafter.init_from:
        _, state = load_exported(config.drafter.init_from)
        model.load_state_dict({k: v.float() for k, v in state.items()})
    return model.to(dist.device)


def build_optimizer(model: torch.nn.Module, config: Config) -> torch.optim.AdamW:
    # Fused on every device (CPU too since torch 2.4): its step honours `found_inf` (train_step).
    return torch.optim.AdamW(model.parameters(), lr=config.train.lr, betas=config.train.betas,
                             weight_decay=config.train.weight_decay, fused=True)


def learning_rate(config: Config, step: int, total_steps: int) -> float:
    """Linear warm-up over warmup_ratio of the run, then cosine or linear decay."""
    warmup = max(1, round(config.train.warmup_ratio * total_steps))
    if step < warmup:
        return config.train.lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    shape = 0.5 * (1 + math.cos(math.pi * progress)) if config.train.decay == "cosine" else 1 - progress
    floor = config.train.min_lr_ratio
    return config.train.lr * (floor + (1 - floor) * shape)


def build_context(config: Config, args: DrafterArgs, reader, dist: DistState) -> TrainContext:
    embed, lm_head = reader.read_frozen_weights()
    dtype = torch.bfloat16 if dist.device.type == "cuda" else torch.float32
    backend = default_backend(dist.device) if config.train.attention == "auto" else config.train.attention
    gamma = config.train.gamma or default_gamma(args.block_size)
    return TrainContext(args=args, codec=reader.attrs["codec"], embed_VH=embed.to(dist.device, dtype),
                        lm_head_VH=lm_head.to(dist.device, dtype),
                        weights_B=gamma_weights(args.block_size, gamma, device=dist.device),
                        backend=backend, loss_chunk=config.train.loss_chunk, device=dist.device)


def apply_parallelism(model: DFlashDrafter, config: Config, dist: DistState) -> torch.nn.Module:
    """Activation checkpointing, compile and DDP are applied here, never in the model."""
    if config.train.activation_checkpointing:
        for layer in model.layers:
            layer.forward = functools.partial(checkpointed_forward, layer.forward)
    if config.train.compile and dist.device.type == "cuda":
        # Regional compile of the two mask-free halves of a layer (all matmuls and elementwise
        # ops), one graph shared by every layer; flex attention is compiled on its own
        # (dflash.masks). Row counts vary per micro-batch: the second distinct shape compiles a
        # shape-generic graph.
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        compile_layers(model)
    if not dist.is_distributed:
        return model
    device_ids = [dist.device.index] if dist.device.type == "cuda" else None
    return torch.nn.parallel.DistributedDataParallel(model, device_ids=device_ids)


def checkpointed_forward(forward, *inputs):
    return torch.utils.checkpoint.checkpoint(forward, *inputs, use_reentrant=False)


def forward_loss(model, ctx: TrainContext, batch: dict):
    """One packed micro-batch: decode features on the device, run the drafter, chunked loss."""
    args = ctx.args
    feature_TF = codecs.decode(batch["hidden"], batch.get("scale"), ctx.codec, len(args.target_layer_ids),
                               dtype=ctx.embed_VH.dtype)
    embeds_QH = block_embeddings(ctx.embed_VH, batch["input_ids"], batch["anchor_index"], args.block_size,
                                 args.mask_token_id)
    masks = build_masks(batch, args.layer_types, args.sliding_window, block_size=args.block_size,
                        backend=ctx.backend, device=ctx.device)
    with ctx.autocast:
        hidden_QH = model(feature_TF, embeds_QH, batch["position_ids"],
                          block_positions(batch["anchor_pos"], args.block_size), masks)
    # A store of target labels trains every slot against the target's greedy token there.
    labels_AB, valid_AB = block_labels(batch.get("labels", batch["input_ids"]), batch["loss_mask"],
                                       batch["doc_ids"], batch["anchor_index"], batch["anchor_valid"],
                                       args.block_size)
    # The final norm returns float32 under autocast; the loss casts the rows it uses to the head's dtype.
    out = dflash_loss(hidden_QH, ctx.lm_head_VH, labels_AB, valid_AB, ctx.weights_B, ctx.loss_chunk,
                      rows_L=batch.get("label_rows"))
    return out, valid_AB


# Token- and anchor-axis tensors go to the device; per-sample bookkeeping (lengths, bucket,
# counts) stays on the host so metrics never force a device sync.
DEVICE_KEYS = ("hidden", "scale", "input_ids", "labels", "loss_mask", "position_ids", "doc_ids",
               "anchor_pos", "anchor_doc", "anchor_index", "anchor_valid", "label_rows")


def to_device(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device, non_blocking=True) if k in DEVICE_KEYS else v for k, v in batch.items()}


def train_step(wrapped, ctx: TrainContext, micro_batches: list[dict], optimizer, lr: float, clip: float,
               step: int = -1):
    """Forward, backward over the accumulated micro-batches, clip, step (skipped on the device when
    the loss or gradient is not finite). Returns device stats; `step` labels them."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    stats = StepStats(ctx.args.block_size, ctx.device)
    micro_batches = [batch for batch in micro_batches if not batch.get("empty")]  # all samples skipped
    if not micro_batches:
        stats.record_step(torch.zeros(1, device=ctx.device), step)
        return stats
    for index, batch in enumerate(micro_batches):
        last = index == len(micro_batches) - 1
        sync_context = wrapped.no_sync() if hasattr(wrapped, "no_sync") and not last else nullcontext()
        with sync_context:
            out, valid_AB = forward_loss(wrapped, ctx, batch)
            (out.loss / len(micro_batches)).backward()
        stats.add(out, valid_AB, batch)
    grad_norm = torch.nn.utils.clip_grad_norm_(wrapped.parameters(), clip)
    finite = torch.isfinite(grad_norm) & ~stats.loss_flags().any()
    # The fused AdamW skips its whole update on the device when `found_inf` is non-zero (the
    # interface gradient scalers use): a NaN never reaches the weights, and nothing syncs here.
    optimizer.found_inf = (~finite).float()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    stats.grad_norm = grad_norm.detach()
    stats.record_step(torch.cat([stats.loss_flags(), (~finite).reshape(1)]).float(), step)
    return stats


class StepStats:
    """Metric sums kept on the device between logging steps (no host sync per step)."""

    def __init__(self, block_size: int, device: torch.device):
        self.values = torch.zeros(6 + 2 * (block_size - 1), dtype=torch.float64, device=device)
        self.block_size = block_size
        self.micro_batches = 0
        self.grad_norm = None
        self.host = {"real_tokens": 0, "padded_tokens": 0, "max_len": 0, "num_seqs": 0, "len_sum": 0}
        self.buckets: dict[int, int] = {}
        self.micro_batch_rows: list[np.ndarray] = []  # host: source row ids of each micro-batch
        self.micro_batch_losses: list[torch.Tensor] = []
        # Per optimizer step: (step, rows of its micro-batches, device flags [loss non-finite per
        # micro-batch..., update skipped]); checked on logging steps and before any save.
        self.steps: list[tuple[int, list[np.ndarray], torch.Tensor]] = []

    def loss_flags(self) -> torch.Tensor:
        return ~torch.isfinite(torch.stack(self.micro_batch_losses))

    def record_step(self, flags: torch.Tensor, step: int = -1) -> None:
        self.steps = [(step, self.micro_batch_rows, flags)]

    def add(self, out, valid_AB, batch) -> None:
        metrics = block_metrics(out.correct, valid_AB)
        loss = out.loss.detach().double()
        self.values[:6] += torch.stack([loss, out.loss_sum.detach().double(), out.weight_sum.double(),
                                        metrics["accepted_sum"].double(), metrics["num_blocks"].double(),
                                        torch.ones((), dtype=torch.float64, device=loss.device)])
        self.values[6:6 + self.block_size - 1] += metrics["slot_correct"].double()
        self.values[6 + self.block_size - 1:] += metrics["slot_valid"].double()
        self.micro_batches += 1
        self.micro_batch_rows.append(batch["row_ids"])
        self.micro_batch_losses.append(out.loss.detach())
        lengths = batch["lengths"]
        self.host["real_tokens"] += int(batch["num_real_tokens"])
        self.host["padded_tokens"] += int(batch["num_tokens"])
        self.host["max_len"] = max(self.host["max_len"], int(max(lengths)))
        self.host["num_seqs"] += len(lengths)
        self.host["len_sum"] += int(sum(lengths))
        self.buckets[int(batch["bucket"])] = self.buckets.get(int(batch["bucket"]), 0) + 1

    def merge(self, other: "StepStats") -> None:
        self.values += other.values
        self.micro_batches += other.micro_batches
        for key in ("real_tokens", "padded_tokens", "num_seqs", "len_sum"):
            self.host[key] += other.host[key]
        self.host["max_len"] = max(self.host["max_len"], other.host["max_len"])
        for bucket, count in other.buckets.items():
            self.buckets[bucket] = self.buckets.get(bucket, 0) + count
        if other.grad_norm is not None:
            self.grad_norm = other.grad_norm
        self.steps += other.steps

    def summarize(self, dist: DistState, with_grad_norm: bool) -> dict:
        """sync: logging step only; one transfer (after one all-reduce under DDP). Raises
        NonFiniteError when a step of the window had a non-finite loss or gradient."""
        values = self.values
        if with_grad_norm and self.grad_norm is not None:
            values = torch.cat([values, self.grad_norm.double().reshape(1)])
        flags = [step_flags for _, _, step_flags in self.steps]
        values = torch.cat([values, *(f.double() for f in flags)]) if flags else values
        if dist.is_distributed:
            values = values.clone()
            torch_dist.all_reduce(values)
        host = values.tolist()
        if flags:
            raise_if_nonfinite(self.steps, host[len(host) - sum(len(f) for f in flags):])
            host = host[:len(host) - sum(len(f) for f in flags)]
        k = self.block_size - 1
        loss_mean, _, _, accepted, blocks, count = host[:6]
        slot_correct, slot_valid = host[6:6 + k], host[6 + k:6 + 2 * k]
        metrics = {"loss": loss_mean / max(count, 1), "tau": 1 + accepted / max(blocks, 1),
                   "acc": sum(slot_correct) / max(sum(slot_valid), 1)}
        for slot in range(k):
            metrics[f"acc_slot{slot + 1}"] = slot_correct[slot] / max(slot_valid[slot], 1)
        if with_grad_norm and self.grad_norm is not None:
            metrics["grad_norm"] = host[-1] / dist.world_size
        return metrics

    def check_finite(self, dist: DistState) -> None:
        """Before a checkpoint: raise if an unlogged step of the window was not finite.
        sync: save steps only."""
        if self.steps:
            flags = torch.cat([step_flags for _, _, step_flags in self.steps]).double()
            if dist.is_distributed:
                flags = flags.clone()
                torch_dist.all_reduce(flags)
            raise_if_nonfinite(self.steps, flags.tolist())


def raise_if_nonfinite(steps, host_flags: list[float]) -> None:
    """NonFiniteError naming the first step whose loss or gradient was not finite, and its rows."""
    position = 0
    for step, rows, flags in steps:
        step_flags = host_flags[position:position + len(flags)]
        position += len(flags)
        if not any(step_flags):
            continue
        batches = [f"[rows {', '.join(str(int(r) + 1) for r in batch_rows)}]"
                   + (" (loss not finite)" if bad else "") for batch_rows, bad in zip(rows, step_flags)]
        raise NonFiniteError(
            f"step {step}: the loss or gradient is not finite, so its update was skipped and training stops "
            f"(no checkpoint is written from here). Its micro-batches on this rank: {'; '.join(batches)}. "
            f"Check the store's features (dflash inspect-cache STORE --verify) and the learning rate")


def pad_multiple(ctx: TrainContext) -> int:
    """Flex attention compiles per shape: pad to 128 on CUDA; CPU needs no padding beyond 16."""
    return 128 if ctx.backend == "flex" else 16


def epoch_loader(config, dataset, loader_options: dict, schedule, dist: DistState, cursor: DataCursor):
    """Micro-batches of this rank from the cursor on; skipped steps are never read."""
    batches = [[(schedule.epoch, int(i)) for i in samples]
               for _, _, samples in schedule.rank_batches(dist.rank, cursor.step)]
    return build_loader(dataset, batches, **loader_options, num_workers=config.train.num_workers,
                        pin_memory=dist.device.type == "cuda")
