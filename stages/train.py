"""Stage two: train the DFlash drafter from a stage-one store.

`run(config, resume)` wires the library together: open the store (refusing one that does
not match the drafter), build the drafter, its optimizer and the per-epoch schedule of
mixed-length micro-batches, then loop `train_step` with metrics, held-out evaluation and
checkpoints. Only logging steps move numbers to the host, in one transfer.
"""

import dataclasses
import functools
import math
import os
import signal
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as torch_dist
from tqdm import tqdm

from dflash import codecs
from dflash.batch import StoreDataset, build_loader, collate_packed
from dflash.checkpoint import (capture_rng_states, latest_checkpoint, load_checkpoint, restore_rng_states,
                               save_checkpoint)
from dflash.config import Config, ConfigError
from dflash.dist import DistState, init_distributed, shutdown
from dflash.drafter import (AUTO_SIZE, DFlashDrafter, DrafterArgs, auto_drafter_args, block_embeddings,
                            block_positions, compile_layers, drafter_args)
from dflash.errors import DflashError
from dflash.export import export_drafter, load_exported, require_finite
from dflash.loss import block_labels, block_metrics, default_gamma, dflash_loss, gamma_weights
from dflash.masks import build_masks, default_backend
from dflash.metrics import MetricsLogger
from dflash.sampler import DataCursor, build_epoch_schedule, pack_bucket, split_holdout
from dflash.store import CorruptShardError, StoreReader
from dflash.tokenizer import MASK_TOKEN_ID, TOKENIZER_NAME


class StoreMismatch(DflashError, ValueError):
    """The store's attributes disagree with the drafter config; the message names the keys."""


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


@dataclass
class TrainResult:
    run_dir: str
    steps: int = 0
    losses: list[float] = field(default_factory=list)  # every optimizer step's loss
    last_metrics: dict = field(default_factory=dict)
    eval_metrics: dict = field(default_factory=dict)
    checkpoint: str | None = None
    tokens_seen: int = 0  # context tokens trained on, rank 0's count times the ranks (as tokens_per_s)
    skipped_samples: int = 0  # unreadable samples skipped on this rank (train.skip_corrupt_shards)


def run(config: Config, resume: str | None = None) -> TrainResult:
    # Varying micro-batch shapes fragment the default CUDA allocator; set before CUDA starts.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    dist = init_distributed("auto")
    try:
        return train(config, dist, resume)
    finally:
        shutdown(dist)


def train(config: Config, dist: DistState, resume: str | None) -> TrainResult:
    torch.manual_seed(config.train.seed)
    reader = StoreReader(config.store.path, on_corrupt="skip" if config.train.skip_corrupt_shards else "raise")
    check_labels(config, reader.attrs)
    args = build_drafter_args(config, reader.attrs)
    train_indices, eval_indices = split_holdout(len(reader), config.train.holdout_fraction, config.train.seed)
    # Every epoch's schedule is index arithmetic (no data read); built once, it also fixes the LR horizon.
    schedules = [schedule_for(config, reader, train_indices, dist, epoch) for epoch in range(config.train.epochs)]
    steps_per_epoch = [schedule.num_steps for schedule in schedules]
    total_steps = sum(steps_per_epoch) if config.train.max_steps <= 0 else min(config.train.max_steps, sum(steps_per_epoch))
    model = build_model(config, args, dist)
    optimizer = build_optimizer(model, config)
    ctx = build_context(config, args, reader, dist)
    cursor, step = DataCursor(), 0
    result = TrainResult(run_dir=config.train.out_dir)
    checkpoint_path = resolve_resume(config, resume)
    if checkpoint_path is not None:
        cursor, step, result.tokens_seen = restore(checkpoint_path, model, optimizer, dist)
    wrapped = apply_parallelism(model, config, dist)
    logger = MetricsLogger(config.train.out_dir, use_wandb=config.train.wandb != "disabled",
                           wandb_mode=config.train.wandb, project=config.train.wandb_project,
                           config=config.to_dict(), is_writer=dist.is_main)
    if dist.is_main:
        print_plan(config, model, reader, train_indices, eval_indices, steps_per_epoch, total_steps, step)
        print(logger.where)
    stop = StopFlag()
    try:
        loop(config, dist, wrapped, model, optimizer, ctx, reader, eval_indices,
             schedules, total_steps, cursor, step, logger, result, stop)
    finally:
        stop.restore()
        logger.close()
    return result


def check_labels(config: Config, attrs: dict) -> None:
    """The labels stage two trains against are the store's; a config that asks for others is refused."""
    stored = attrs.get("labels", "data")
    if stored != config.store.labels:
        raise StoreMismatch(f"store.labels: the store at {config.store.path} holds {stored} labels, the config "
                            f"asks for {config.store.labels}; run stage one with store.labels = "
                            f"{config.store.labels} (into another store.path) or set store.labels = {stored}")


def build_drafter_args(config: Config, attrs: dict) -> DrafterArgs:
    """The drafter's sizes (auto from the store's target, a named size, or an export), checked
    against the store (layer ids, hidden, vocab) and with a mask token inside the vocabulary."""
    if config.drafter.init_from:
        args, _ = load_exported(config.drafter.init_from)
    else:
        args = resolve_drafter_args(config, attrs)
    store_vocab = attrs["target"]["vocab_size"]
    expected = {
        "target_layer_ids": (list(args.target_layer_ids), list(attrs["target_layer_ids"])),
        "hidden_size": (args.hidden_size, attrs["hidden_size"]),
        "vocab_size": (args.vocab_size, store_vocab),
    }
    differing = {key: pair for key, pair in expected.items() if pair[0] != pair[1]}
    if differing:
        lines = [f"  {key}: drafter {mine!r} vs store {theirs!r}" for key, (mine, theirs) in differing.items()]
        raise StoreMismatch(f"store {config.store.path} does not match drafter size {config.drafter.size!r}:\n"
                            + "\n".join(lines))
    if not 0 <= args.mask_token_id < store_vocab:
        raise StoreMismatch(f"drafter.mask_token_id {args.mask_token_id} is outside the store vocabulary ({store_vocab})")
    return args


def resolve_drafter_args(config: Config, attrs: dict) -> DrafterArgs:
    drafter = config.drafter
    overrides = {key: value for key, value in {
        "num_layers": drafter.num_layers, "layer_types": drafter.layer_types,
        "sliding_window": drafter.sliding_window, "intermediate_size": drafter.intermediate_size}.items() if value}
    overrides.update(block_size=drafter.block_size, mask_token_id=store_mask_token(config, attrs),
                     num_target_layers=attrs["target"].get("num_hidden_layers", 0))
    try:
        if drafter.size == AUTO_SIZE:
            return auto_drafter_args(target_text_config(attrs), attrs["target_layer_ids"], **overrides)
        return drafter_args(drafter.size, **overrides)
    except ValueError as err:
        raise ConfigError(f"drafter.size = {drafter.size!r}: {err}") from None


def store_mask_token(config: Config, attrs: dict) -> int:
    """drafter.mask_token_id, or (-1) the unused special token stage one chose for this store."""
    if config.drafter.mask_token_id >= 0:
        return config.drafter.mask_token_id
    # Stores from before stage one chose one: the Qwen3.5/3.6 tokenizer's DFlash mask token.
    qwen = attrs.get("tokenizer", {}).get("name_or_path") == TOKENIZER_NAME
    chosen = attrs.get("mask_token_id", MASK_TOKEN_ID if qwen else None)
    if chosen is None:
        raise ConfigError(f"store {config.store.path}: the target's tokenizer has no special token unused by the "
                          f"data and its chat template; set drafter.mask_token_id to a token id the data never holds")
    return int(chosen)


def target_text_config(attrs: dict) -> dict:
    """The target's sizes from the store, or (stores older than `target_text_config`) its checkpoint."""
    if "target_text_config" in attrs:
        return attrs["target_text_config"]
    from transformers import AutoConfig

    from dflash.target import text_config_summary

    path = attrs["target"]["path"]
    try:
        return text_config_summary(AutoConfig.from_pretrained(path))
    except (OSError, ValueError) as err:
        raise ConfigError(f"drafter.size = 'auto' needs the target's config: the store predates "
                          f"target_text_config and {path} cannot be read ({err}); rerun stage one or set "
                          f"drafter.size") from None


def schedule_for(config: Config, reader, train_indices, dist: DistState, epoch: int):
    return build_epoch_schedule(reader.index["length"], reader.index["bucket"], config.train.token_budget,
                                dist.world_size, config.train.accum_steps, config.train.seed, epoch,
                                sample_indices=train_indices, anchors=anchor_counts(config, reader),
                                anchor_budget=config.train.anchor_budget)


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
    # The final norm returns float32 under autocast; the frozen head is bf16 on CUDA.
    out = dflash_loss(hidden_QH.to(ctx.lm_head_VH.dtype), ctx.lm_head_VH, labels_AB, valid_AB, ctx.weights_B,
                      ctx.loss_chunk)
    return out, valid_AB


# Token- and anchor-axis tensors go to the device; per-sample bookkeeping (lengths, bucket,
# counts) stays on the host so metrics never force a device sync.
DEVICE_KEYS = ("hidden", "scale", "input_ids", "labels", "loss_mask", "position_ids", "doc_ids",
               "anchor_pos", "anchor_doc", "anchor_index", "anchor_valid")


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


class StopFlag:
    """SIGTERM asks for a final checkpoint at the next step boundary."""

    def __init__(self):
        self.requested = False
        self.previous = signal.signal(signal.SIGTERM, self.handle)

    def handle(self, signum, frame) -> None:
        self.requested = True

    def restore(self) -> None:
        signal.signal(signal.SIGTERM, self.previous)


def loop(config, dist, wrapped, model, optimizer, ctx, reader, eval_indices,
         schedules, total_steps, cursor, step, logger, result, stop) -> None:
    dataset = StoreDataset(reader, config.train.max_anchors, config.train.seed, config.train.skip_corrupt_shards)
    loader_options = {"pad_multiple": pad_multiple(ctx)}
    collate = functools.partial(collate_packed, **loader_options)
    eval_micro_batches = held_out_micro_batches(config, dist, reader, eval_indices)
    bar = tqdm(total=total_steps, initial=step, unit="step", disable=not dist.is_main, dynamic_ncols=True,
               desc="train")
    window = StepStats(ctx.args.block_size, ctx.device)
    timer = {"start": time.perf_counter(), "wait": 0.0}
    loss_history = torch.zeros(total_steps, dtype=torch.float64, device=ctx.device)
    first_step = step
    notice = first_step_notice(ctx, dist)
    if notice:
        bar.set_postfix_str(notice)
    while step < total_steps and not stop.requested:
        schedule = schedules[cursor.epoch]
        if schedule.num_steps == 0:
            raise ConfigError(f"epoch {cursor.epoch} has no optimizer step: too few samples for "
                              f"train.accum_steps x world size micro-batches")
        loader = epoch_loader(config, dataset, loader_options, schedule, dist, cursor)
        iterator = iter(loader)
        for step_in_epoch in range(cursor.step, schedule.num_steps):
            if step >= total_steps or stop.requested:
                break
            wait_start = time.perf_counter()
            try:
                micro_batches = [to_device(next(iterator), ctx.device) for _ in range(config.train.accum_steps)]
            except CorruptShardError as error:
                raise corrupt_stop(error, config, dist, model, optimizer, window, cursor, step, first_step,
                                   result) from None
            count_skipped(micro_batches, result, bar)
            timer["wait"] += time.perf_counter() - wait_start
            lr = learning_rate(config, step, total_steps)
            stats = train_step(wrapped, ctx, micro_batches, optimizer, lr, config.train.clip, step + 1)
            window.merge(stats)
            result.tokens_seen += stats.host["real_tokens"] * dist.world_size
            step += 1
            cursor = DataCursor(epoch=cursor.epoch, step=step_in_epoch + 1)
            if cursor.step == schedule.num_steps:
                cursor = DataCursor(epoch=cursor.epoch + 1, step=0)
            loss_history[step - 1] = stats.values[0] / stats.micro_batches
            if notice and step == first_step + 1:
                bar.set_postfix_str("")
            bar.update(1)
            if step % config.train.log_every == 0 or step == total_steps:
                log_window(config, dist, window, lr, timer, logger, step, bar, result)
                window = StepStats(ctx.args.block_size, ctx.device)
            if eval_indices.size and (step % config.train.eval_every == 0 or step == total_steps):
                try:
                    result.eval_metrics = evaluate(dist, wrapped, ctx, dataset, collate, eval_micro_batches)
                except CorruptShardError as error:
                    raise corrupt_stop(error, config, dist, model, optimizer, window, cursor, step, first_step,
                                       result) from None
                logger.log(step, {f"eval/{k}": v for k, v in result.eval_metrics.items()})
            if step % config.train.save_every == 0 and step < total_steps:
                window.check_finite(dist)
                save(config, dist, model, optimizer, cursor, step, result.tokens_seen)
    bar.close()
    window.check_finite(dist)
    result.checkpoint = str(save(config, dist, model, optimizer, cursor, step, result.tokens_seen))
    result.steps = step
    result.losses = loss_history[first_step:step].tolist()  # sync: end of run
    if stop.requested and dist.is_main:
        print(f"SIGTERM: saved checkpoint {result.checkpoint} at step {step}; resume with --resume")
    elif dist.is_main:
        skipped = f", {result.skipped_samples} unreadable samples skipped" if result.skipped_samples else ""
        print(f"done: {step} steps{skipped}; checkpoint {result.checkpoint}\n"
              f"  export it for serving: dflash export {result.checkpoint} EXPORT_DIR")


def corrupt_stop(error, config, dist, model, optimizer, window, cursor, step, first_step, result):
    """The error to stop with when a sample cannot be read (and skipping is off): the steps trained
    since the start are saved first, so nothing is lost; the message says how to repair."""
    message = str(error).strip().splitlines()[-1]  # from a DataLoader worker: its traceback, then the error
    message = message.split("CorruptShardError: ", 1)[-1]
    if step > first_step:
        window.check_finite(dist)
        saved = save(config, dist, model, optimizer, cursor, step, result.tokens_seen)
        message += f". Training stopped before step {step + 1}; saved {saved} (continue with --resume)"
    return CorruptShardError(message)


def count_skipped(micro_batches: list[dict], result: "TrainResult", bar) -> None:
    """Samples skipped as unreadable (train.skip_corrupt_shards) are counted and named once each."""
    for batch in micro_batches:
        for message in batch.get("skipped", ()):
            result.skipped_samples += 1
            bar.write(f"skipped: {message.split('. Repair:')[0]}")


def first_step_notice(ctx: TrainContext, dist: DistState) -> str:
    """What the progress bar says while the first step compiles (CUDA only): minutes on a cold
    compile cache, during which nothing else moves (under DDP the ranks wait for the slowest)."""
    if ctx.device.type != "cuda":
        return ""
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir  # private; for the notice only
        cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or default_cache_dir()
    except ImportError:
        cache = "the inductor cache"
    ranks = f"; each of the {dist.world_size} ranks compiles for its own GPU" if dist.is_distributed else ""
    return f"first step: compiling kernels, minutes on a cold cache ({cache}){ranks}"


def pad_multiple(ctx: TrainContext) -> int:
    """Flex attention compiles per shape: pad to 128 on CUDA; CPU needs no padding beyond 16."""
    return 128 if ctx.backend == "flex" else 16


def epoch_loader(config, dataset, loader_options: dict, schedule, dist: DistState, cursor: DataCursor):
    """Micro-batches of this rank from the cursor on; skipped steps are never read."""
    batches = [[(schedule.epoch, int(i)) for i in samples]
               for _, _, samples in schedule.rank_batches(dist.rank, cursor.step)]
    return build_loader(dataset, batches, **loader_options, num_workers=config.train.num_workers,
                        pin_memory=dist.device.type == "cuda")


def log_window(config, dist, window: StepStats, lr, timer, logger, step, bar, result) -> None:
    metrics = window.summarize(dist, config.train.log_grad_norm)
    elapsed = time.perf_counter() - timer["start"]
    host = window.host
    metrics.update({
        "lr": lr,
        "tokens_per_s": host["real_tokens"] * dist.world_size / max(elapsed, 1e-9),
        "data_wait": timer["wait"] / max(elapsed, 1e-9),
        "avg_seq_len": host["len_sum"] / max(host["num_seqs"], 1),
        "max_seq_len": host["max_len"],
        "padding_efficiency": host["real_tokens"] / max(host["padded_tokens"], 1),
        "tokens_seen": result.tokens_seen,
        "skipped_samples": result.skipped_samples,
    })
    for bucket, count in sorted(window.buckets.items()):
        metrics[f"bucket{bucket}_micro_batches"] = count
    logger.log(step, metrics)
    bar.set_postfix(loss=f"{metrics['loss']:.3f}", tau=f"{metrics['tau']:.2f}")
    result.last_metrics = metrics
    timer.update(start=time.perf_counter(), wait=0.0)


def held_out_micro_batches(config, dist: DistState, reader, eval_indices) -> list:
    """This rank's share of the first eval_batches held-out micro-batches, fixed for the run."""
    if not eval_indices.size:
        return []
    anchors = anchor_counts(config, reader)
    try:
        # world 1, accum 2: only the packing and order matter here (eval never steps).
        micro_batches = build_epoch_schedule(reader.index["length"], reader.index["bucket"], config.train.token_budget,
                                             1, 2, config.train.seed, 0, sample_indices=eval_indices,
                                             anchors=anchors, anchor_budget=config.train.anchor_budget).micro_batches
    except ValueError:
        # Too few held-out samples for mixed steps (one sample, or all in one bucket but one): pack them plainly.
        buckets = reader.index["bucket"][eval_indices]
        micro_batches = [micro_batch for bucket in np.unique(buckets)
                         for micro_batch in pack_bucket(eval_indices[buckets == bucket], reader.index["length"],
                                                        config.train.token_budget, anchors,
                                                        config.train.anchor_budget)]
    return micro_batches[dist.rank::dist.world_size][:config.train.eval_batches]


@torch.no_grad()
def evaluate(dist, wrapped, ctx, dataset, collate, micro_batches) -> dict:
    """Held-out loss, accuracy and tau (epoch 0 anchors, so every evaluation sees the same blocks)."""
    stats = StepStats(ctx.args.block_size, ctx.device)
    wrapped.eval()
    for micro_batch in micro_batches:
        batch = to_device(collate([dataset[(0, int(i))] for i in micro_batch]), ctx.device)
        if batch.get("empty"):
            continue
        out, valid_AB = forward_loss(wrapped, ctx, batch)
        stats.add(out, valid_AB, batch)
    wrapped.train()
    return stats.summarize(dist, with_grad_norm=False)


def save(config, dist, model, optimizer, cursor: DataCursor, step: int, tokens_seen: int) -> Path:
    model_state = {k: v.detach() for k, v in model.state_dict().items()}  # fp32 master weights
    require_finite(model_state, f"checkpoint of step {step}")  # sync: save steps only
    scheduler_state = {"step": step, "tokens_seen": tokens_seen}
    return save_checkpoint(config.train.out_dir, step, model_state, optimizer.state_dict(), scheduler_state,
                           cursor.to_dict(), capture_rng_states(), config.to_dict(), config.train.keep_last,
                           is_writer=dist.is_main, drafter_args=dataclasses.asdict(model.args))


def resolve_resume(config: Config, resume: str | None) -> Path | None:
    if resume is None:
        return None
    if resume == "latest":
        path = latest_checkpoint(config.train.out_dir)
        if path is None:
            raise ConfigError(f"--resume: no complete checkpoint in train.out_dir ({config.train.out_dir})")
        return path
    return Path(resume)


def restore(path: Path, model, optimizer, dist: DistState) -> tuple[DataCursor, int, int]:
    checkpoint = load_checkpoint(path)
    model.load_state_dict(checkpoint.model_state)
    optimizer.load_state_dict(checkpoint.optimizer_state)
    restore_rng_states(checkpoint.rng_states)
    if dist.is_main:
        print(f"resumed from {path} at step {checkpoint.step}")
    return DataCursor.from_dict(checkpoint.data_cursor), checkpoint.step, checkpoint.scheduler_state.get("tokens_seen", 0)


def print_plan(config, model, reader, train_indices, eval_indices, steps_per_epoch, total_steps, step) -> None:
    args = model.args
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    print(f"store {config.store.path}: {len(reader)} samples ({train_indices.size} train, "
          f"{eval_indices.size} held out), codec {reader.attrs['codec']}, "
          f"{'the target' if reader.has_labels else 'data'} labels")
    for name, reason in reader.skipped_shards.items():
        print(f"  skipped corrupt shard {name}: {reason}")
    if reader.skipped_shards or reader.incomplete_shards:
        print(f"  {len(reader.skipped_shards)} corrupt shard(s) skipped, "
              f"{len(reader.incomplete_shards)} incomplete shard(s) not read")
    print(f"drafter {config.drafter.size}: {trainable / 1e6:,.1f}M trainable parameters, "
          f"{args.num_layers} layers {list(args.layer_types)} (window {args.sliding_window}), hidden "
          f"{args.hidden_size}, {args.num_attention_heads} heads x {args.head_dim} ({args.num_key_value_heads} KV), "
          f"MLP {args.intermediate_size}, block {args.block_size}, mask token {args.mask_token_id}, "
          f"target layers {list(args.target_layer_ids)}")
    print(f"schedule: {config.train.epochs} epochs x ~{int(np.mean(steps_per_epoch))} steps, "
          f"{total_steps} steps in all, starting at step {step}")


def export_checkpoint(checkpoint: str, out_dir: str) -> Path:
    """`dflash export`: a training checkpoint directory -> the inference format."""
    loaded = load_checkpoint(checkpoint)
    if loaded.drafter_args is not None:
        fields = dict(loaded.drafter_args)
        fields.update(layer_types=tuple(fields["layer_types"]), target_layer_ids=tuple(fields["target_layer_ids"]))
        return export_drafter(loaded.model_state, DrafterArgs(**fields), out_dir)
    # Checkpoints from before the drafter arguments were saved: a named size or an export.
    config = loaded.config
    if config["drafter"].get("init_from"):
        args, _ = load_exported(config["drafter"]["init_from"])
    else:
        args = drafter_args(config["drafter"]["size"], block_size=config["drafter"]["block_size"],
                            mask_token_id=config["drafter"]["mask_token_id"])
    return export_drafter(loaded.model_state, args, out_dir)
