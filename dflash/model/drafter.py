"""The DFlash drafter: a small stack of Qwen3 decoder layers conditioned on target features.

Design (z-lab DFlash): the target's context feature (outputs of `target_layer_ids`
concatenated, `(T, n*H)`) is projected once, `hidden_norm(fc(feature))`, to one vector per
context token. The block tokens (slot 0 = anchor token, slots 1.. = mask token, embedded with
the target's frozen embedding) are the only queries; in every layer keys and values are
`[proj(context) ; proj(block)]`, with k_norm on all keys and plain RoPE on queries (block
positions `anchor + j`) and keys (context positions, then block positions). Which key each
query may see is decided by the per-layer-type masks from `dflash.model.masks`.

Parameter names equal the inference export keys (`layers.{i}.self_attn.q_proj.weight`, ...,
`norm.weight`, `fc.weight`, `hidden_norm.weight`); embedding and LM head are not part of
the module. No I/O, no distributed code: wrappers are applied from outside.

Shape suffixes (a tensor named `x_QH` is `(Q, H)`):
  T  context tokens of the packed micro-batch       A  anchors (blocks)
  B  block size (slots per block)                   Q  block rows, A * B (the queries)
  K  keys, T + Q                                    L  rows of one RoPE application (T or Q)
  N  attention heads (query or KV)                  D  head dim
  H  hidden size                                    F  feature width, n * H (n target layers)
  V  vocabulary                                     R  rows of one LM-head chunk
"""

from contextlib import contextmanager
from dataclasses import dataclass, fields, replace

import torch
import torch.nn.functional as F
from torch import nn

from dflash.model.masks import LAYER_TYPES, attend
# The served drafter's own norm and RoPE tables: training and serving share them.
from dflash.model.modeling_dflash import RMSNorm, rms_norm, rope_tables
from dflash.recipe import BLOCK_SIZE, MASK_TOKEN_ID, VOCAB_SIZE

INIT_STD = 0.02  # Qwen3 `initializer_range`


@dataclass(frozen=True)
class DrafterArgs:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    layer_types: tuple[str, ...]
    sliding_window: int
    rope_theta: float
    target_layer_ids: tuple[int, ...]
    block_size: int = BLOCK_SIZE
    mask_token_id: int = MASK_TOKEN_ID
    vocab_size: int = VOCAB_SIZE
    rms_norm_eps: float = 1e-6
    # The target's decoder layer count (0: unknown). Only the export uses it: loaders read
    # `num_target_layers` as the target's depth (SGLang range-checks target_layer_ids with it).
    num_target_layers: int = 0

    def __post_init__(self):
        if len(self.layer_types) != self.num_layers:
            raise ValueError(
                f"drafter: layer_types has {len(self.layer_types)} entries, num_layers is {self.num_layers}"
            )
        for index, layer_type in enumerate(self.layer_types):
            if layer_type not in LAYER_TYPES:
                raise ValueError(f"drafter: layer_types[{index}] = {layer_type!r}, expected one of {LAYER_TYPES}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"drafter: num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"drafter: head_dim {self.head_dim} must be even for RoPE")
        if "sliding_attention" in self.layer_types and self.sliding_window < self.block_size:
            raise ValueError(
                f"drafter: sliding_window {self.sliding_window} is smaller than block_size {self.block_size}"
            )
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"drafter: mask_token_id {self.mask_token_id} outside vocab_size {self.vocab_size}")
        if self.num_target_layers and max(self.target_layer_ids) >= self.num_target_layers:
            raise ValueError(f"drafter: target_layer_ids {list(self.target_layer_ids)} do not fit a target of "
                             f"{self.num_target_layers} layers")

    @property
    def context_feature_size(self) -> int:
        return len(self.target_layer_ids) * self.hidden_size


DRAFTER_SIZES = {
    # Tests and the embedded default; hidden 64 equals the tiny target's hidden size.
    "tiny": DrafterArgs(
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        layer_types=("sliding_attention", "full_attention"),
        sliding_window=64,
        rope_theta=1e7,
        target_layer_ids=(1, 3, 5),
        num_target_layers=8,
    ),
    # The recipe of the public Qwen3.5/3.6-27B drafters (about 1.73B parameters).
    "qwen3.6-27b": DrafterArgs(
        hidden_size=5120,
        intermediate_size=17408,
        num_layers=5,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        layer_types=("sliding_attention",) * 4 + ("full_attention",),
        sliding_window=2048,
        rope_theta=1e7,
        target_layer_ids=(1, 16, 31, 46, 61),
        num_target_layers=64,
    ),
}


AUTO_SIZE = "auto"
AUTO_NUM_LAYERS = 5  # the public drafters' depth
AUTO_SLIDING_WINDOW = 2048


def default_layer_types(num_layers: int) -> tuple[str, ...]:
    """Sliding-window layers, then one full-attention layer last (the public drafters' pattern)."""
    return ("sliding_attention",) * (num_layers - 1) + ("full_attention",)


def drafter_args(size: str, **overrides) -> DrafterArgs:
    """The named size with `overrides` applied (lists become tuples); errors name the bad key.

    Overriding `num_layers` alone gives the default layer pattern for that depth.
    """
    if size not in DRAFTER_SIZES:
        raise ValueError(f"drafter: unknown size {size!r}, known: {sorted([AUTO_SIZE, *DRAFTER_SIZES])}")
    return replace_args(DRAFTER_SIZES[size], overrides)


def replace_args(base: DrafterArgs, overrides: dict) -> DrafterArgs:
    known = {f.name for f in fields(DrafterArgs)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(f"drafter: unknown override key(s) {unknown}, known: {sorted(known)}")
    overrides = dict(overrides)
    if "num_layers" in overrides and "layer_types" not in overrides:
        overrides["layer_types"] = default_layer_types(overrides["num_layers"])
    for key in ("layer_types", "target_layer_ids"):
        if key in overrides:
            overrides[key] = tuple(overrides[key])
    return replace(base, **overrides)


def auto_drafter_args(target: dict, target_layer_ids, **overrides) -> DrafterArgs:
    """A drafter sized from the target's text config (`target_text_config` of the store).

    Hidden size, heads, KV heads, head dim, intermediate size, vocabulary and norm epsilon are
    the target's; RoPE is plain RoPE with the target's base (scaling, partial rotary and
    multimodal sections are not carried over: the drafter only sees positions up to the
    training length). 5 layers, sliding except the last, window 2048, unless overridden.
    """
    missing = [key for key in ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size")
               if not target.get(key)]
    if missing:
        raise ValueError(f"drafter: cannot size 'auto' from the target config, it lacks {missing}")
    heads = target["num_attention_heads"]
    base = DrafterArgs(
        hidden_size=target["hidden_size"],
        intermediate_size=target["intermediate_size"],
        num_layers=AUTO_NUM_LAYERS,
        num_attention_heads=heads,
        num_key_value_heads=target.get("num_key_value_heads") or heads,
        head_dim=target.get("head_dim") or target["hidden_size"] // heads,
        layer_types=default_layer_types(AUTO_NUM_LAYERS),
        sliding_window=AUTO_SLIDING_WINDOW,
        rope_theta=float(target.get("rope_theta") or 10_000.0),
        target_layer_ids=tuple(target_layer_ids),
        vocab_size=target["vocab_size"],
        rms_norm_eps=float(target.get("rms_norm_eps") or 1e-6),
        num_target_layers=int(target.get("num_hidden_layers") or 0),
        mask_token_id=overrides.get("mask_token_id", 0),
    )
    return replace_args(base, overrides)


def count_parameters(args: DrafterArgs) -> int:
    """Trainable parameters of `DFlashDrafter(args)`, computed without building it."""
    hidden, q_width = args.hidden_size, args.num_attention_heads * args.head_dim
    kv_width = args.num_key_value_heads * args.head_dim
    attention = hidden * q_width * 2 + hidden * kv_width * 2 + 2 * args.head_dim
    mlp = 3 * hidden * args.intermediate_size
    per_layer = attention + mlp + 2 * hidden
    return args.num_layers * per_layer + hidden + args.context_feature_size * hidden + hidden


def apply_rope(x_LND: torch.Tensor, cos_LD: torch.Tensor, sin_LD: torch.Tensor) -> torch.Tensor:
    """Rotate `(L, heads, head_dim)` by the half-split (rotate_half) convention of Qwen3."""
    first, second = x_LND.chunk(2, dim=-1)
    rotated = torch.cat([-second, first], dim=-1)
    return x_LND * cos_LD[:, None, :] + rotated * sin_LD[:, None, :]


class DrafterAttention(nn.Module):
    """The attention weights of a layer (the computation is `attention_inputs` / `layer_output`)."""

    def __init__(self, args: DrafterArgs):
        super().__init__()
        self.num_heads, self.num_kv_heads = args.num_attention_heads, args.num_key_value_heads
        self.head_dim = args.head_dim
        hidden = args.hidden_size
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=False)
        self.q_norm = RMSNorm(self.head_dim, args.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, args.rms_norm_eps)


class DrafterMLP(nn.Module):
    """The SwiGLU weights of a layer."""

    def __init__(self, args: DrafterArgs):
        super().__init__()
        self.gate_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.up_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=False)


# A layer is `attention_inputs` -> attention kernel -> `layer_output`. The two halves hold every
# matmul and elementwise op and no mask, and take the weights as arguments: one function (and,
# under torch.compile, one graph) serves every layer. dflash/train/step.py compiles them apart from
# flex attention.


def attention_inputs(block_QH, context_TH, cos_q, sin_q, cos_k, sin_k, input_norm_w, q_w, k_w, v_w,
                     q_norm_w, k_norm_w, eps: float, num_heads: int, num_kv_heads: int, head_dim: int):
    """Queries of the block, keys and values of `[context ; block]`, as `(1, heads, length, head_dim)`."""
    x_QH = rms_norm(block_QH, input_norm_w, eps)
    num_queries = x_QH.shape[0]
    q_QND = rms_norm(F.linear(x_QH, q_w).view(num_queries, num_heads, head_dim), q_norm_w, eps)
    k_KND = torch.cat([F.linear(context_TH, k_w), F.linear(x_QH, k_w)]).view(-1, num_kv_heads, head_dim)
    k_KND = rms_norm(k_KND, k_norm_w, eps)
    v_KND = torch.cat([F.linear(context_TH, v_w), F.linear(x_QH, v_w)]).view(-1, num_kv_heads, head_dim)
    q_QND = apply_rope(q_QND, cos_q, sin_q)
    k_KND = apply_rope(k_KND, cos_k, sin_k)
    # (1, heads, length, head_dim): the layout both flex_attention and SDPA take.
    return tuple(t.transpose(0, 1).unsqueeze(0) for t in (q_QND, k_KND, v_KND))


def layer_output(block_QH, attention_1NQD, o_w, post_norm_w, gate_w, up_w, down_w, eps: float):
    """Residual + output projection, then residual + SwiGLU MLP."""
    num_queries = attention_1NQD.shape[2]
    block_QH = block_QH + F.linear(attention_1NQD[0].transpose(0, 1).reshape(num_queries, -1), o_w)
    x_QH = rms_norm(block_QH, post_norm_w, eps)
    return block_QH + F.linear(F.silu(F.linear(x_QH, gate_w)) * F.linear(x_QH, up_w), down_w)


class DrafterLayer(nn.Module):
    def __init__(self, args: DrafterArgs, layer_type: str):
        super().__init__()
        self.layer_type = layer_type
        self.self_attn = DrafterAttention(args)
        self.mlp = DrafterMLP(args)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        # Replaced by compiled versions (shared by all layers) in dflash/train_step.apply_parallelism.
        self.halves = (attention_inputs, layer_output)
        self.weight_cast: WeightCast | None = None  # set inside `weights_cast_once`

    def forward(self, block_QH, context_TH, rope_q, rope_k, mask) -> torch.Tensor:
        attn, mlp, eps = self.self_attn, self.mlp, self.input_layernorm.eps
        w = self.weight_cast or (lambda weight: weight)
        q, k, v = self.halves[0](block_QH, context_TH, *rope_q, *rope_k, self.input_layernorm.weight,
                                 w(attn.q_proj.weight), w(attn.k_proj.weight), w(attn.v_proj.weight),
                                 attn.q_norm.weight, attn.k_norm.weight, eps, attn.num_heads, attn.num_kv_heads,
                                 attn.head_dim)
        return self.halves[1](block_QH, attend(q, k, v, mask), w(attn.o_proj.weight),
                              self.post_attention_layernorm.weight, w(mlp.gate_proj.weight), w(mlp.up_proj.weight),
                              w(mlp.down_proj.weight), eps)


class WeightCast:
    """fp32 master weights cast to the compute dtype once and the cast reused (`weights_cast_once`); with
    `accumulate`, each gradient reaching a cast is added into its weight's fp32 `.grad` by the cast itself."""

    def __init__(self, dtype: torch.dtype, accumulate: bool = False):
        self.dtype, self.accumulate = dtype, accumulate
        self.casts: dict[int, tuple[torch.Tensor, torch.Tensor, bool]] = {}

    def __call__(self, weight: torch.Tensor) -> torch.Tensor:
        kept = self.casts.get(id(weight))
        grad = torch.is_grad_enabled()
        if kept is not None and kept[0] is weight and kept[2] == grad:
            return kept[1]
        if self.accumulate and grad and weight.requires_grad:
            cast = _CastAccumulating.apply(weight, self.dtype)
        else:
            cast = weight.to(self.dtype)
        self.casts[id(weight)] = (weight, cast, grad)
        return cast


class _CastAccumulating(torch.autograd.Function):
    """`weight.to(dtype)` whose backward adds the gradient into `weight.grad` (fp32) itself, in one pass (a
    mixed-dtype add: the bf16 gradient read, the fp32 sum read and written), and passes nothing on: autograd's
    own path casts the gradient to fp32 (a write) and then adds it (a second read of it). Every backward through
    the one cast (one per micro-batch) adds its part; the sums are autograd's, bit for bit. Not under DDP, whose
    reducer waits for the weights' own gradient accumulation."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        ctx.weight = weight
        return weight.to(dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        weight = ctx.weight
        if weight.grad is None:  # laid out as the weight, as autograd's accumulation lays it (the optimizer's kernel)
            weight.grad = torch.empty_like(weight).copy_(grad)
        else:
            weight.grad.add_(grad)
        return None, None


@contextmanager
def weights_cast_once(model: nn.Module, dtype: torch.dtype, accumulate: bool | None = None):
    """Inside it, each layer's matmul weights and the feature projection's (fp32 masters) are cast to `dtype` at
    their first use and that cast serves every later micro-batch: an optimizer step's micro-batches read each
    weight's fp32 copy once instead of once each, the compiled halves take bf16 weights (no cast in their forward
    or backward), and the context features, already in `dtype`, enter the projection as they are (not through a
    float32 copy that autocast casts back). Every micro-batch's weight gradient comes back through the one cast
    to the same fp32 `.grad` as before, with the same values. Only for a span in which the weights do not change
    (one step's forward and backward passes, not its optimizer update: the casts are dropped on leaving) and
    under autocast to `dtype` (the matmuls cast to it anyway). `model` may be wrapped (DDP).

    `accumulate` (default: unless `model` is DDP-wrapped) has each cast add the gradients reaching it into its
    weight's `.grad` itself (`_CastAccumulating`): one pass a micro-batch where autograd makes two."""
    wrapped_by_ddp = isinstance(model, nn.parallel.DistributedDataParallel)
    drafter = getattr(model, "module", model)
    cast = WeightCast(dtype, accumulate=not wrapped_by_ddp if accumulate is None else accumulate)
    for module in (drafter, *drafter.layers):
        module.weight_cast = cast
    try:
        yield cast
    finally:
        for module in (drafter, *drafter.layers):
            module.weight_cast = None


# The row axes of the halves' inputs (argument index, dimension): block rows Q, context rows T, keys
# T + Q. They change with every micro-batch; the weights' shapes never do.
ROW_AXES = {attention_inputs: ((0, 0), (1, 0), (2, 0), (3, 0), (4, 0), (5, 0)), layer_output: ((0, 0), (1, 2))}


# The two norms outside the layers (the context's after the feature projection, the final one) compiled too, as one
# graph (tools/bench_stage2.py --compile-norms; not yet timed, so off): eager, each is six passes over its rows.
COMPILE_NORMS = False


def compile_layers(model: "DFlashDrafter", **compile_options) -> None:
    """torch.compile the two halves once and give the compiled pair to every layer (and, with `COMPILE_NORMS`,
    the model's two norms one compiled `rms_norm`).

    Their row axes are marked dynamic at every call, so the first micro-batch already compiles the
    shape-generic graph; unmarked, the first shape compiles a static graph and the second a generic one
    (twice the cold start)."""
    # Inductor fuses the RMSNorm backward's row and column reductions only above a size it checks on the
    # dynamic row count, and that check becomes a guard: a micro-batch on the other side of it compiled both
    # halves again (H200, 12-03: `192*block_QH.size()[0] + 192*context_TH.size()[0] >= 5242880`). Non-strict,
    # it fuses whenever it can, as it already did at the training sizes, and guards on nothing.
    import torch._inductor.config as inductor_config

    if hasattr(inductor_config.triton, "mix_order_reduction_non_strict_mode"):
        inductor_config.triton.mix_order_reduction_non_strict_mode = True
    halves = tuple(rows_dynamic(torch.compile(fn, **compile_options), ROW_AXES[fn])
                   for fn in (attention_inputs, layer_output))
    for layer in model.layers:
        layer.halves = halves
    if COMPILE_NORMS:
        model.norm_fn = compiled_norm(**compile_options)


def compiled_norm(**compile_options):
    """`rms_norm` through torch.compile, its rows dynamic from the first call (`COMPILE_NORMS`)."""
    return rows_dynamic(torch.compile(rms_norm, **compile_options), ((0, 0),))


def is_compiled(model: "DFlashDrafter") -> bool:
    """Whether `compile_layers` gave the model's layers their compiled halves."""
    return bool(model.layers) and model.layers[0].halves[0] is not attention_inputs


def rows_dynamic(compiled, axes):
    """`compiled` with `axes` ((argument, dimension) pairs) of its tensor arguments marked dynamic."""
    def call(*args):
        for index, dim in axes:
            torch._dynamo.maybe_mark_dynamic(args[index], dim)
        return compiled(*args)
    return call


class DFlashDrafter(nn.Module):
    def __init__(self, args: DrafterArgs):
        super().__init__()
        self.args = args
        self.layers = nn.ModuleList(DrafterLayer(args, layer_type) for layer_type in args.layer_types)
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.fc = nn.Linear(args.context_feature_size, args.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.weight_cast: WeightCast | None = None  # set inside `weights_cast_once`, as the layers' is
        self.norm_fn = rms_norm  # compiled by `compile_layers` under COMPILE_NORMS
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """Qwen3 init: linear weights normal(0, 0.02), norm weights ones (also after `to_empty`)."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                module.weight.normal_(mean=0.0, std=INIT_STD)
            elif isinstance(module, RMSNorm):
                module.weight.fill_(1.0)

    def forward(
        self,
        context_feature_TF: torch.Tensor,
        block_embeds_QH: torch.Tensor,
        context_positions_T: torch.Tensor,
        block_positions_Q: torch.Tensor,
        masks: dict,
    ) -> torch.Tensor:
        """Block hidden states `(Q, H)` after the final norm (feed them to the target's LM head).

        `masks` maps each layer type to its mask from `dflash.model.masks.build_masks`, for keys laid
        out as `[context (T) ; block (Q)]`.
        """
        args = self.args
        dtype = block_embeds_QH.dtype
        if self.weight_cast is not None:  # the features (bf16) meet the fc's bf16 cast: no fp32 copy of them
            projected_TH = F.linear(context_feature_TF, self.weight_cast(self.fc.weight))
        else:
            projected_TH = self.fc(context_feature_TF.to(self.fc.weight.dtype))
        context_TH = self.norm_fn(projected_TH, self.hidden_norm.weight, self.hidden_norm.eps)
        rope_q = rope_tables(block_positions_Q, args.head_dim, args.rope_theta, dtype)
        key_positions = torch.cat([context_positions_T, block_positions_Q])
        rope_k = rope_tables(key_positions, args.head_dim, args.rope_theta, dtype)
        hidden_QH = block_embeds_QH
        if torch.is_grad_enabled() and not hidden_QH.requires_grad and is_compiled(self):
            # Compiled halves are guarded on their inputs' requires_grad: the frozen embeddings (no gradient) made
            # layer 0 compile both halves once more than the other layers (2 of a cold start's 6 graphs). As a leaf
            # that asks for a gradient, layer 0 runs the others' graphs; the cost is layer 0's input gradient,
            # computed and dropped (about 1.1 MFLOP per block row, under 1% of the small drafter's step).
            hidden_QH = hidden_QH.detach().requires_grad_()
        for layer in self.layers:
            hidden_QH = layer(hidden_QH, context_TH, rope_q, rope_k, masks[layer.layer_type])
        return self.norm_fn(hidden_QH, self.norm.weight, self.norm.eps)


def block_positions(anchor_pos_A: torch.Tensor, block_size: int) -> torch.Tensor:
    """RoPE positions of the block queries, `(A*B,)`: slot j of anchor a sits at `anchor_pos[a] + j`."""
    slots = torch.arange(block_size, device=anchor_pos_A.device, dtype=anchor_pos_A.dtype)
    return (anchor_pos_A[:, None] + slots[None, :]).reshape(-1)


def block_embeddings(
    embed_weight_VH: torch.Tensor,
    input_ids_T: torch.Tensor,
    anchor_index_A: torch.Tensor,
    block_size: int,
    mask_token_id: int,
) -> torch.Tensor:
    """Noise embeddings `(A*B, H)`: slot 0 = embed(anchor token), slots 1.. = embed(mask token)."""
    num_anchors = anchor_index_A.shape[0]
    tokens_AB = torch.full((num_anchors, block_size), mask_token_id, dtype=torch.long, device=input_ids_T.device)
    tokens_AB[:, 0] = input_ids_T[anchor_index_A].long()
    return F.embedding(tokens_AB.reshape(-1), embed_weight_VH)
