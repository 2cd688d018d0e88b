"""Stage two's step and what it needs: the drafter and its context (frozen head, loss weights,
attention backend), the optimizer and learning rate, parallelism, `forward_loss` on one packed
micro-batch, `train_step` (forward, backward, clip, step) and `evaluate` on held-out batches.

dflash/train/loop.py runs the loop around them (checkpoints, logging, evaluation); the metric
sums and the non-finite guard they return are dflash/train/metrics.py's `StepStats`;
tools/bench_stage2.py times `train_step` itself. Only logging steps move numbers to the host.
"""

import functools
import math
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as torch_dist

from dflash.config import Config, ConfigError
from dflash.dist import DistState
from dflash.model.drafter import (DFlashDrafter, DrafterArgs, block_embeddings, block_positions, compile_layers,
                                  is_compiled, weights_cast_once)
from dflash.model.block_attention import triton_refusal
from dflash.model.export import load_exported
from dflash.model.loss import block_labels, block_soft_targets, default_gamma, dflash_loss, gamma_weights
from dflash.model.masks import build_masks, training_backend
from dflash.store import codecs
from dflash.train import served
from dflash.train.metrics import StepStats


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
    distill_weight: float = 0.0  # train.distill_weight: the soft-target term beside the cross entropy
    distill: str = "kl"
    fold_clip: bool = True  # clip through the optimizer's grad_scale (clip_into_step); False: in place first
    loss_kernel: str = "compiled"  # train.loss_kernel: the cross entropy's pass on CUDA (dflash.model.loss)
    cast_weights_once: bool = False  # train.cast_weights_once: one bf16 cast of each weight a step (CUDA)

    @property
    def autocast(self):
        if self.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return nullcontext()


def build_model(config: Config, args: DrafterArgs, dist: DistState) -> DFlashDrafter:
    """fp32 master weights on the device; a published drafter can be the starting point."""
    model = DFlashDrafter(args)
    if config.drafter.init_from:
        _, state = load_exported(config.drafter.init_from)
        model.load_state_dict({k: v.float() for k, v in state.items()})
    return model.to(dist.device)


def triton_or(name: str, fallback: str, device: torch.device) -> str:
    """A kernel setting's `"auto"` resolved: "triton" (dflash's kernel) on a CUDA device where Triton runs,
    else `fallback`; any other name as given (train.optimizer, train.loss_kernel)."""
    if name != "auto":
        return name
    return "triton" if device.type == "cuda" and triton_refusal(device) is None else fallback


def build_optimizer(model: torch.nn.Module, config: Config) -> torch.optim.AdamW:
    # Fused on every device (CPU too since torch 2.4): its step honours `found_inf` and `grad_scale` (train_step).
    options = dict(lr=config.train.lr, betas=config.train.betas, weight_decay=config.train.weight_decay)
    device = next(model.parameters()).device
    if triton_or(config.train.optimizer, "torch", device) == "triton":
        if reason := triton_refusal(device):
            raise ConfigError(f"train.optimizer = \"triton\": {reason}; or set train.optimizer = \"torch\"")
        from dflash.train.adamw_kernel import TritonAdamW
        return TritonAdamW(model.parameters(), **options)
    return torch.optim.AdamW(model.parameters(), fused=True, **options)


def describe_kernels(ctx: TrainContext, optimizer) -> str:
    """The line stage two prints of what its `auto` settings chose: attention, AdamW's update, the loss pass."""
    loss = ctx.loss_kernel if ctx.device.type == "cuda" else "eager"
    adamw = "triton" if type(optimizer).__name__ == "TritonAdamW" else "torch's fused"
    return (f"kernels: attention {ctx.backend}, AdamW {adamw}, loss pass {loss} "
            f"(train.attention, train.optimizer, train.loss_kernel)")


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
    backend = training_backend(config.train.attention, dist.device, args.head_dim, config.train.gather_context_keys)
    if backend == "blockwise" and (reason := triton_refusal(dist.device)):
        raise ConfigError(f"train.attention = \"blockwise\": {reason}")
    loss_kernel = triton_or(config.train.loss_kernel, "compiled", dist.device)
    if loss_kernel == "triton" and dist.device.type == "cuda" and (reason := triton_refusal(dist.device)):
        raise ConfigError(f"train.loss_kernel = \"triton\": {reason}")
    gamma = config.train.gamma or default_gamma(args.block_size)
    return TrainContext(args=args, codec=reader.attrs["codec"], embed_VH=embed.to(dist.device, dtype),
                        lm_head_VH=lm_head.to(dist.device, dtype),
                        weights_B=gamma_weights(args.block_size, gamma, device=dist.device),
                        backend=backend, loss_chunk=config.train.loss_chunk, device=dist.device,
                        distill_weight=config.train.distill_weight, distill=config.train.distill,
                        loss_kernel=loss_kernel, cast_weights_once=config.train.cast_weights_once)


def apply_parallelism(model: DFlashDrafter, config: Config, dist: DistState) -> torch.nn.Module:
    """Activation checkpointing, compile and DDP are applied here, never in the model."""
    if config.train.activation_checkpointing:
        for layer in model.layers:
            layer.forward = functools.partial(checkpointed_forward, layer.forward)
    if config.train.compile and dist.device.type == "cuda":
        # Regional compile of the two mask-free halves of a layer (all matmuls and elementwise
        # ops), one graph shared by every layer; flex attention is compiled on its own
        # (dflash.model.masks). Row counts vary per micro-batch: their axes are dynamic from the first
        # call (compile_layers), so each graph compiles once, shape-generic.
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
    soft_targets = None
    if ctx.distill_weight > 0 and "topk_ids" in batch:  # soft targets read from the store (store.topk)
        soft_targets = block_soft_targets(batch["topk_ids"], batch["topk_probs"], batch["loss_mask"], batch["doc_ids"],
                                          batch["anchor_index"], batch["anchor_valid"], args.block_size)
    # The final norm returns float32 under autocast; the loss casts the rows it uses to the head's dtype.
    # A fused step's micro-batch (train.fuse_accum): each anchor's micro-batch, the loss their means' mean.
    out = dflash_loss(hidden_QH, ctx.lm_head_VH, labels_AB, valid_AB, ctx.weights_B, ctx.loss_chunk,
                      rows_L=batch.get("label_rows"), group_A=batch.get("anchor_group"),
                      num_groups=len(batch.get("group_buckets", [None])), soft_targets=soft_targets,
                      distill_weight=ctx.distill_weight, distill=ctx.distill, ce_kernel=ctx.loss_kernel)
    return out, valid_AB


# Token- and anchor-axis tensors go to the device; per-sample bookkeeping (lengths, bucket,
# counts) stays on the host so metrics never force a device sync.
DEVICE_KEYS = ("hidden", "scale", "input_ids", "labels", "topk_ids", "topk_probs", "loss_mask", "position_ids", "doc_ids",
               "anchor_pos", "anchor_doc", "anchor_index", "anchor_valid", "label_rows", "anchor_group")


def to_device(batch: dict, device: torch.device) -> dict:
    """The token- and anchor-axis tensors and the block masks' tile layouts and gathered keys (`tiles_*`,
    `keys_*`) to the device."""
    return {k: v.to(device, non_blocking=True) if k in DEVICE_KEYS or k.startswith(("tiles_", "keys_")) else v
            for k, v in batch.items()}


def folds_grad_scale(optimizer) -> bool:
    """Whether `optimizer.step()` divides each gradient by `optimizer.grad_scale` as it reads it: torch's
    fused Adam, AdamW and SGD do, and dflash's TritonAdamW (a fused AdamW); other optimizers ignore it."""
    fused_kinds = torch.optim.Adam | torch.optim.AdamW | torch.optim.SGD
    return isinstance(optimizer, fused_kinds) and bool(optimizer.defaults.get("fused"))


def clip_into_step(optimizer, grads: list[torch.Tensor], clip: float, fold: bool = True) -> torch.Tensor:
    """Gradient-norm clipping folded into the fused AdamW's step: the norm is computed as
    `clip_grad_norm_` computes it, and the factor that would scale every gradient in place (one more
    read and write of all of them, ~7 GB a step at the 27B drafter's 1.7B parameters) goes to the
    optimizer as its `grad_scale`, which its kernel divides each gradient by as it reads it. The
    gradients themselves stay unclipped. An optimizer that does not read `grad_scale` (`folds_grad_scale`),
    or `fold=False` (`TrainContext.fold_clip`, the benchmarks' baseline), gets its gradients scaled in
    place first, as `clip_grad_norm_` scales them. Returns the norm before clipping, as `clip_grad_norm_` does."""
    norm = torch.nn.utils.get_total_norm(grads)
    # clip_grad_norm_ multiplies by clamp(clip / (norm + 1e-6), max=1); dividing by its inverse is the same.
    scale = torch.clamp((norm + 1e-6) / clip, min=1.0).float()
    if fold and folds_grad_scale(optimizer):
        optimizer.grad_scale = scale
    else:
        if grads:  # the norm came from them: the factor is on their device already
            torch._foreach_div_(grads, scale)
        optimizer.grad_scale = None
    return norm


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
    with step_weights(wrapped, ctx):
        for index, batch in enumerate(micro_batches):
            last = index == len(micro_batches) - 1
            sync_context = wrapped.no_sync() if hasattr(wrapped, "no_sync") and not last else nullcontext()
            with sync_context:
                out, valid_AB = forward_loss(wrapped, ctx, batch)
                (out.objective / len(micro_batches)).backward()
            stats.add(out, valid_AB, batch)
    grad_norm = clip_into_step(optimizer, [p.grad for p in wrapped.parameters() if p.grad is not None], clip,
                               fold=ctx.fold_clip)
    finite = torch.isfinite(grad_norm) & ~stats.loss_flags().any()
    # The fused AdamW skips its whole update on the device when `found_inf` is non-zero (the
    # interface gradient scalers use): a NaN never reaches the weights, and nothing syncs here.
    optimizer.found_inf = (~finite).float()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    stats.grad_norm = grad_norm.detach()
    stats.record_step(torch.cat([stats.loss_flags(), (~finite).reshape(1)]).float(), step)
    return stats


def step_weights(wrapped, ctx: TrainContext):
    """The span of one step's (or one evaluation's) forward passes: with `ctx.cast_weights_once` on CUDA each
    weight's bf16 cast made once for all of them (`drafter.weights_cast_once`; autocast's dtype there), else
    nothing."""
    if ctx.cast_weights_once and ctx.device.type == "cuda":
        return weights_cast_once(wrapped, torch.bfloat16)
    return nullcontext()


def evaluation_mode(wrapped):
    """The module held-out batches run through, and the grad mode they run in.

    Compiled layers run with gradients on, as in training: compiled graphs are guarded on the grad mode,
    so a held-out pass without it compiled the halves and flex attention once more (4 graphs, 24 s of the
    recipe's first evaluation on the H200, 12-03). Nothing calls backward; each batch's graph is freed
    with its outputs. DDP's wrapper is left out either way (no backward follows: nothing to reduce)."""
    model = getattr(wrapped, "module", wrapped)
    return model, torch.enable_grad() if is_compiled(model) else torch.no_grad()


def evaluate_served(dist: DistState, wrapped, ctx: TrainContext, dataset, collate, micro_batches,
                    tokens: int, walks: list | None = None) -> dict:
    """The held-out tau as serving measures it (dflash.train.served): `dataset` gives every anchor of
    each answer's first `tokens` tokens, and each answer is walked as the temperature-0 serving loop
    would; `walks` (a list) gets `(sample index, acceptance lengths)` of each answer (this rank's).
    sync: one transfer per micro-batch (evaluations only)."""
    totals = torch.zeros(3, dtype=torch.float64)  # acceptance lengths' sum, verifications, answers
    model, grad_mode = evaluation_mode(wrapped)
    model.eval()
    with step_weights(model, ctx):  # the training graphs' inputs (bf16 weights when cast once), cast once for all
        for micro_batch in micro_batches:
            items = [item for item in (dataset[(0, int(i))] for i in micro_batch) if "corrupt" not in item]
            if not items:
                continue
            host = collate(items)
            with grad_mode:
                out, valid_AB = forward_loss(model, ctx, to_device(host, ctx.device))
            lengths_A = served.accepted_lengths(out.correct, valid_AB).cpu().numpy()
            del out  # its graph (compiled layers) before the next batch's
            real = int(host["num_real_anchors"])
            docs, positions = host["anchor_doc"].numpy()[:real], host["anchor_pos"].numpy()[:real]
            for doc, item in enumerate(items):
                here = docs == doc
                walk = served.serve_walk(dict(zip(positions[here].tolist(), lengths_A[:real][here].tolist())),
                                         served.answer_start(item["loss_mask"]),
                                         served.answer_end(item["loss_mask"]), tokens)
                totals += torch.tensor([sum(walk), len(walk), 1], dtype=torch.float64)
                if walks is not None:
                    walks.append((item["sample_index"], walk))
    model.train()
    if dist.is_distributed:
        totals = totals.to(ctx.device)
        torch_dist.all_reduce(totals)
    lengths_sum, verifications, answers = totals.tolist()
    return {"served_tau": lengths_sum / verifications, "served_answers": answers} if verifications else {}


def evaluate(dist: DistState, wrapped, ctx: TrainContext, dataset, collate, micro_batches) -> dict:
    """Held-out loss, accuracy and tau (epoch 0 anchors, so every evaluation sees the same blocks)."""
    stats = StepStats(ctx.args.block_size, ctx.device)
    model, grad_mode = evaluation_mode(wrapped)
    model.eval()
    with step_weights(model, ctx):  # the training graphs' inputs (bf16 weights when cast once), cast once for all
        for micro_batch in micro_batches:
            batch = to_device(collate([dataset[(0, int(i))] for i in micro_batch]), ctx.device)
            if batch.get("empty"):
                continue
            with grad_mode:
                out, valid_AB = forward_loss(model, ctx, batch)
            stats.add(out, valid_AB, batch)  # detached
            del out
    model.train()
    return stats.summarize(dist, with_grad_norm=False)
