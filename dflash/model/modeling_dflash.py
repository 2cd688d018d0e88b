"""A DFlash drafter for inference, and the speculative-decoding loop that serves it.

dflash copies this file into every export beside `config.json` (whose `auto_map` names it),
so that `AutoModel.from_pretrained(export_dir, trust_remote_code=True)` returns a working
`DFlashDraftModel`; it imports only torch and transformers. `dflash eval` runs the same
class and the same loop, so the acceptance it reports is what this file serves.

The drafter (ARCHITECTURE.md): the target's features at `target_layer_ids` are projected
once per committed token, `hidden_norm(fc(feature))`; in every layer the block's queries
see `[k_proj(context) ; k_proj(block)]` (k_norm, then plain RoPE at absolute positions).
A block at anchor position `a` sees the context at positions `< a`. Full-attention layers
see the whole block; sliding-window layers are causal inside the block and see a key at
`p` from query `a + j` only when `a + j - p < sliding_window`.

`DraftCache` keeps the keys and values of committed context tokens only: a block's own
keys are never cached, so after verification nothing has to be cropped from it (the same
state an engine reaches by cropping its draft cache to the committed length).

Shape suffixes (`x_1BH` is `(1, B, H)`): B block size, N new context tokens of this step,
H hidden size, V vocabulary.

Usage, as in the reference inference code:

    draft = AutoModel.from_pretrained(export_dir, trust_remote_code=True, dtype=torch.bfloat16).to("cuda")
    out = draft.spec_generate(target, input_ids, max_new_tokens=256, stop_token_ids=[eos], temperature=0.0)
"""

import copy
import functools
import heapq
import inspect
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel, Qwen3Config


class DraftCache:
    """Per layer, keys (normed, rotated) and values `(1, kv_heads, N, head_dim)` of the N committed
    context tokens, positions `0..N-1`."""

    def __init__(self, num_layers: int):
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.length = 0

    def positions(self, num_new: int, block_size: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """The new context rows' positions `(N,)` and the block's `(B,)`, which follows them."""
        positions = torch.arange(self.length, self.length + num_new + block_size, device=device)
        return positions[:num_new], positions[num_new:]

    def extend(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.keys[layer] is not None:
            keys = torch.cat([self.keys[layer], keys], dim=2)
            values = torch.cat([self.values[layer], values], dim=2)
        self.keys[layer], self.values[layer] = keys, values
        return keys, values

    def visible(self, layer: int, window: int | None, block_size: int, device) -> torch.Tensor | None:
        """`(B, N + B)` boolean mask of the block's queries over layer `layer`'s N context keys (after this
        step's `extend`) and the block's own keys; None: every key (full attention)."""
        if window is None:
            return None
        num_context = self.keys[layer].shape[2]
        slot = torch.arange(block_size, device=device)[:, None]
        context_pos = torch.arange(num_context, device=device)[None, :]
        sees_context = num_context + slot - context_pos < window
        sees_block = torch.arange(block_size, device=device)[None, :] <= slot
        return torch.cat([sees_context, sees_block], dim=1)

    def commit(self, num_new: int) -> None:
        self.length += num_new


class StaticDraftCache:
    """A DraftCache in fixed buffers, so that a block step has the same shapes every time and can be
    replayed as a CUDA graph (`BlockGraph`). Per layer keys and values `(1, kv_heads, capacity, head_dim)`;
    the step's context length before its new rows (`start`) and their number (`num_new`) are device
    tensors, set before each step. A step always writes B context rows at `start..start+B-1` (rows past
    `num_new` are padding: masked, and overwritten by the next step, which starts at `start + num_new`);
    its queries see the keys below `start + num_new` (the sliding window's rule too) and the block."""

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, capacity: int, block_size: int, dtype,
                 device):
        shape = (1, kv_heads, capacity, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.start = torch.zeros(1, dtype=torch.long, device=device)
        self.num_new = torch.zeros(1, dtype=torch.long, device=device)
        self.offsets = torch.arange(block_size, device=device)
        self.key_positions = torch.arange(capacity, device=device)
        self.capacity = capacity
        self.context_pos = self.block_pos = self.offsets

    def positions(self, num_new: int, block_size: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        if num_new != len(self.offsets) or block_size != len(self.offsets):
            raise ValueError(f"a static draft step takes {len(self.offsets)} context rows (padded) and a block of "
                             f"{len(self.offsets)}, got {num_new} and {block_size}")
        self.context_pos = self.start + self.offsets
        self.block_pos = self.start + self.num_new + self.offsets
        return self.context_pos, self.block_pos

    def extend(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.keys[layer].index_copy_(2, self.context_pos, keys)
        self.values[layer].index_copy_(2, self.context_pos, values)
        return self.keys[layer], self.values[layer]

    def visible(self, layer: int, window: int | None, block_size: int, device) -> torch.Tensor:
        committed = self.key_positions[None, :] < self.start + self.num_new  # (1, capacity)
        if window is None:
            sees_context = committed.expand(block_size, -1)
            sees_block = torch.ones(block_size, block_size, dtype=torch.bool, device=device)
        else:
            sees_context = committed & (self.block_pos[:, None] - self.key_positions[None, :] < window)
            sees_block = self.offsets[None, :] <= self.offsets[:, None]
        return torch.cat([sees_context, sees_block], dim=1)

    def commit(self, num_new: int) -> None:
        pass  # the length lives on the device (`start`, `num_new`); BlockGraph keeps the host's copy


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3 RMSNorm: normalise in float32, scale in the input dtype."""
    x_float = x.float()
    x_float = x_float * torch.rsqrt(x_float.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x_float.to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rope_tables(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """cos and sin `(L, head_dim)` of plain RoPE (rotate-half layout), computed in float32."""
    exponent = torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim
    angles = positions.float()[:, None] * (1.0 / theta**exponent)[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on `(1, heads, L, head_dim)` with tables `(L, head_dim)`."""
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-second, first], dim=-1) * sin


def rope_theta(config) -> float:
    parameters = getattr(config, "rope_parameters", None) or {}
    theta = parameters.get("rope_theta", getattr(config, "rope_theta", None))
    if theta is None:
        raise ValueError("DFlash drafter config has neither rope_parameters.rope_theta nor rope_theta")
    return float(theta)


class DFlashAttention(nn.Module):
    def __init__(self, config, layer_index: int):
        super().__init__()
        hidden = config.hidden_size
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=False)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        sliding = config.layer_types[layer_index] == "sliding_attention"
        self.window = config.sliding_window if sliding else None

    def heads(self, x: torch.Tensor, proj: nn.Linear, num_heads: int) -> torch.Tensor:
        return proj(x).view(x.shape[0], x.shape[1], num_heads, self.head_dim).transpose(1, 2)

    def forward(self, x_1BH, context_1NH, rope_block, rope_context, cache: DraftCache, layer_index: int):
        """Attention of the block `x_1BH` (already input-normed) over the cached context, the new
        context tokens `context_1NH` (appended to the cache) and the block itself. A context key depends on
        its own row alone, never on the block or on earlier layers' outputs."""
        q = rotate(self.q_norm(self.heads(x_1BH, self.q_proj, self.num_heads)), *rope_block)
        k_block = rotate(self.k_norm(self.heads(x_1BH, self.k_proj, self.num_kv_heads)), *rope_block)
        v_block = self.heads(x_1BH, self.v_proj, self.num_kv_heads)
        k_context = rotate(self.k_norm(self.heads(context_1NH, self.k_proj, self.num_kv_heads)), *rope_context)
        v_context = self.heads(context_1NH, self.v_proj, self.num_kv_heads)
        k_context, v_context = cache.extend(layer_index, k_context, v_context)
        keys = torch.cat([k_context, k_block], dim=2)
        values = torch.cat([v_context, v_block], dim=2)
        groups = self.num_heads // self.num_kv_heads
        keys, values = keys.repeat_interleave(groups, dim=1), values.repeat_interleave(groups, dim=1)
        mask = cache.visible(layer_index, self.window, x_1BH.shape[1], x_1BH.device)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(x_1BH.shape[0], x_1BH.shape[1], -1))


class DFlashMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config, layer_index: int):
        super().__init__()
        self.layer_index = layer_index
        self.self_attn = DFlashAttention(config, layer_index)
        self.mlp = DFlashMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, block_1BH, context_1NH, rope_block, rope_context, cache: DraftCache) -> torch.Tensor:
        attended = self.self_attn(self.input_layernorm(block_1BH), context_1NH, rope_block, rope_context, cache,
                                  self.layer_index)
        block_1BH = block_1BH + attended
        return block_1BH + self.mlp(self.post_attention_layernorm(block_1BH))


class DFlashDraftModel(PreTrainedModel):
    """The drafter: `forward(target_hidden, noise_embedding, past_key_values)` -> normed block states."""

    config_class = Qwen3Config
    base_model_prefix = "dflash"
    _no_split_modules = ["DFlashDecoderLayer"]

    def __init__(self, config):
        super().__init__(config)
        dflash = config.dflash_config
        self.target_layer_ids = list(dflash["target_layer_ids"])
        self.block_size = int(dflash.get("block_size", getattr(config, "block_size", 16)))
        self.mask_token_id = int(dflash["mask_token_id"])
        self.rope_theta = rope_theta(config)
        self.layers = nn.ModuleList(DFlashDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.fc = nn.Linear(len(self.target_layer_ids) * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_init()

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            module.weight.data.normal_(mean=0.0, std=getattr(self.config, "initializer_range", 0.02))
        elif isinstance(module, RMSNorm):
            module.weight.data.fill_(1.0)

    def new_cache(self) -> DraftCache:
        return DraftCache(len(self.layers))

    def forward(self, target_hidden: torch.Tensor, noise_embedding: torch.Tensor,
                past_key_values: DraftCache | None = None) -> torch.Tensor:
        """Block states `(1, B, H)` after the final norm (feed them to the target's LM head).

        `target_hidden` `(1, N, n*H)`: target features of the N tokens committed since the last
        call (positions `cache.length ..`), which join the cache; `noise_embedding` `(1, B, H)`:
        the embedded block (anchor token, then mask tokens) at the next position.
        """
        cache = past_key_values if past_key_values is not None else self.new_cache()
        dtype = noise_embedding.dtype
        context_1NH = self.hidden_norm(self.fc(target_hidden.to(self.fc.weight.dtype))).to(dtype)
        num_new, block_size = target_hidden.shape[1], noise_embedding.shape[1]
        context_pos, block_pos = cache.positions(num_new, block_size, noise_embedding.device)
        head_dim = self.config.head_dim
        rope_context = rope_tables(context_pos, head_dim, self.rope_theta, dtype)
        rope_block = rope_tables(block_pos, head_dim, self.rope_theta, dtype)
        hidden = noise_embedding
        for layer in self.layers:
            hidden = layer(hidden, context_1NH, rope_block, rope_context, cache)
        cache.commit(num_new)
        return self.norm(hidden)

    def block_logits(self, new_features: torch.Tensor, anchor: torch.Tensor, cache: DraftCache,
                     embed_VH: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        """One block's draft logits `(B-1, V)`, per slot a marginal: the block is the anchor token (the
        last committed one) and B-1 mask tokens; `new_features` `(1, N, n*H)` are the target's
        features of the tokens committed since the last call."""
        mask_ids = torch.full((self.block_size - 1,), self.mask_token_id, dtype=torch.long, device=anchor.device)
        dtype = self.fc.weight.dtype
        # The raw embedding table, as in training: no embedding scale or norm of the target's.
        block_embeds = F.embedding(torch.cat([anchor, mask_ids]), embed_VH)[None].to(dtype)
        hidden = self(new_features.to(dtype), block_embeds, cache)
        return lm_head(hidden[0, 1:].to(lm_head.weight.dtype))

    @torch.inference_mode()
    def spec_generate(self, target, input_ids, max_new_tokens: int, stop_token_ids=None, temperature: float = 0.0,
                      return_stats: bool = False, generator: torch.Generator | None = None, proposal: str = "sample"):
        """Speculative decoding of `input_ids` `(1, T)` with `target` (a transformers causal LM);
        at temperature > 0 the drafts are proposed by `proposal` ("argmax", "sample", "sample:F").

        Returns the prompt plus the generated ids `(1, T + n)`, or with `return_stats` a
        `SpecStats` whose `acceptance_lengths` hold the tokens committed per target forward.
        """
        self.eval()
        stats = speculative_generate(self, target, input_ids, max_new_tokens, stop_token_ids or [], temperature,
                                     generator, parse_proposal(proposal))
        return stats if return_stats else stats.output_ids


class BlockGraph:
    """`block_logits` with a StaticDraftCache, captured once as a CUDA graph and replayed per block: the
    drafter's few hundred kernel launches per block (393 for SmolLM2's 5 layers) become one replay, which
    is most of a drafter's cost at batch 1 on a small target, where the host's launches set the pace.
    Off CUDA (`graph=False`) the same static step runs eagerly: the graph's arithmetic, for tests.

    `capacity` bounds the context (prompt and generated tokens) the cache holds; `reset()` starts a new
    sequence in the same buffers, so one capture serves every prompt that fits. The returned logits live
    in the graph's output buffer: read them before the next block."""

    def __init__(self, draft: "DFlashDraftModel", embed_VH: torch.Tensor, lm_head: nn.Module, capacity: int,
                 graph: bool):
        weight = draft.fc.weight
        config, block_size = draft.config, draft.block_size
        self.draft, self.embed_VH, self.lm_head, self.block_size = draft, embed_VH, lm_head, block_size
        self.cache = StaticDraftCache(len(draft.layers), config.num_key_value_heads, config.head_dim, capacity,
                                      block_size, weight.dtype, weight.device)
        self.features = torch.zeros(1, block_size, weight.shape[1], dtype=weight.dtype, device=weight.device)
        self.anchor = torch.zeros(1, dtype=torch.long, device=weight.device)
        self.length = 0  # committed context tokens (the host's copy of start + num_new)
        self.graph, self.logits = None, None
        if graph:
            self.capture()

    def step(self) -> torch.Tensor:
        return self.draft.block_logits(self.features, self.anchor, self.cache, self.embed_VH, self.lm_head)

    def capture(self) -> None:
        self.graph, self.logits = capture_graph(self.step, warm_ups=2)

    def reset(self) -> None:
        self.length = 0

    def block_logits(self, new_features: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
        """As `DFlashDraftModel.block_logits(new_features, anchor, cache, ...)`. New context of more than B
        tokens (the prompt's) goes in B at a time, each piece's block computed and dropped."""
        for start in range(0, new_features.shape[1], self.block_size):
            rows = new_features[:, start:start + self.block_size]
            if self.length + self.block_size > self.cache.capacity:
                raise ValueError(f"the draft cache holds {self.cache.capacity} positions: context "
                                 f"{self.length + rows.shape[1]} and a block of {self.block_size} do not fit")
            self.features[:, :rows.shape[1]].copy_(rows)
            self.anchor.copy_(anchor)
            self.cache.start.fill_(self.length)
            self.cache.num_new.fill_(rows.shape[1])
            if self.graph is not None:
                self.graph.replay()
            else:
                self.logits = self.step()
            self.length += rows.shape[1]
        return self.logits


def capture_graph(step, warm_ups: int = 1, pool=None):
    """`(graph, output)`: `step()` (static buffers in, a tensor or tuple out) captured as a CUDA graph after
    `warm_ups` runs on a side stream (cuBLAS workspaces, lazy kernels: off the capture); `graph.replay()` rewrites
    `output`. `pool`: a memory pool shared with other graphs replayed one at a time (`torch.cuda.graph_pool_handle`)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warm_ups):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        output = step()
    return graph, output


GRAPH_CAPACITY_MIN = 512  # the draft cache's capacity rounds up to a power of two from here: few captures


def graph_capacity(block_size: int, context: int) -> int:
    """The draft cache's capacity for sequences of up to `context` tokens: a power of two from GRAPH_CAPACITY_MIN
    (one BlockGraph, one capture, per capacity)."""
    return max(GRAPH_CAPACITY_MIN, 1 << (context + 2 * block_size - 1).bit_length())


def block_graph(draft: "DFlashDraftModel", embed_VH: torch.Tensor, lm_head: nn.Module, context: int,
                graph: bool) -> BlockGraph:
    """The drafter's BlockGraph for sequences of up to `context` tokens, captured once per capacity and
    kept on the drafter (`draft.block_graphs`), reset for a new sequence."""
    capacity = graph_capacity(draft.block_size, context)
    graphs = draft.__dict__.setdefault("block_graphs", {})
    key = (capacity, graph, embed_VH.data_ptr(), lm_head.weight.data_ptr())
    if key not in graphs:
        graphs[key] = BlockGraph(draft, embed_VH, lm_head, capacity, graph)
    graphs[key].reset()
    return graphs[key]


# ----------------------------------------------------------------------------- the loop


@dataclass
class SpecStats:
    output_ids: torch.Tensor  # (1, prompt + generated)
    num_prompt_tokens: int
    generated: list[int] = field(default_factory=list)
    acceptance_lengths: list[int] = field(default_factory=list)  # committed tokens per verification
    target_forwards: int = 0  # prefill and replays included


def cache_keyword(model) -> str:
    """transformers 5.24 renamed the forward's `past_key_values` to `cache` (the old name warns)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def returned_cache(output):
    return getattr(output, "cache", None) or output.past_key_values


def layer_croppable(layer) -> bool:
    """Whether `crop(-n)` works on this cache layer as it stands.

    Up to transformers 5.24 a linear-attention layer says `is_croppable = False`. From 5.25 it says
    True but crops only after `activate_past_recording()` (`record_past`), which keeps every
    token's recurrent state; a layer that is not recording is rolled back from a snapshot instead.
    """
    return getattr(layer, "is_croppable", True) and getattr(layer, "record_past", True)


class TargetSession:
    """The target with its KV cache: forwards that return the chosen layers' outputs, and rollback.

    Attention caches are cropped (transformers 5 `Cache.crop(-n)`). A cache that cannot be cropped
    (the recurrent state of linear-attention layers, e.g. Qwen3.5) is copied before each
    verification and replayed with the accepted tokens instead, which costs one more forward.
    """

    def __init__(self, target, layer_ids: list[int]):
        self.target, self.layer_ids = target, layer_ids
        self.cache_keyword = cache_keyword(target)
        self.cache = None
        self.snapshot = None
        self.forwards = 0

    def forward(self, input_ids: torch.Tensor, logits_to_keep: int = 0, **tree):
        """`(features (1, T, n*H), logits (1, K, V))` of new tokens continuing the cache; `tree` holds a
        tree's `attention_mask` and `position_ids` (`verify_tree`)."""
        out = self.target(input_ids=input_ids, use_cache=True, output_hidden_states=True,
                          logits_to_keep=logits_to_keep, **tree, **{self.cache_keyword: self.cache})
        self.cache = returned_cache(out)
        self.forwards += 1
        features = torch.cat([out.hidden_states[i + 1] for i in self.layer_ids], dim=-1)
        return features, out.logits

    def croppable(self) -> bool:
        layers = getattr(self.cache, "layers", None)
        return layers is not None and all(layer_croppable(layer) for layer in layers)

    def before_verify(self) -> None:
        self.snapshot = None if self.croppable() else copy.deepcopy(self.cache)

    def rollback(self, num_rejected: int, accepted_ids: torch.Tensor) -> None:
        """Drop the last `num_rejected` tokens of the last forward (`accepted_ids` are the kept ones)."""
        if num_rejected == 0:
            return
        if self.snapshot is None:
            self.cache.crop(-num_rejected)
            return
        self.cache, self.snapshot = self.snapshot, None
        self.forward(accepted_ids, logits_to_keep=1)


    def cached_length(self) -> int:
        return self.cache.get_seq_length() if hasattr(self.cache, "get_seq_length") else 0

    def tree_refusal(self) -> str | None:
        """Why this target's cache cannot verify a tree (None: it can). A tree needs every layer to be plain
        attention whose keys can be picked by index; a recurrent state (linear attention) or a sliding window
        cannot hold the tree's branches apart."""
        from transformers import cache_utils

        for index, layer in enumerate(getattr(self.cache, "layers", [])):
            if type(layer) is not getattr(cache_utils, "DynamicLayer", None):
                return (f"tree proposals need a target whose every layer is full attention with a dynamic cache; "
                        f"layer {index} keeps a {type(layer).__name__}: serve a chain policy (argmax or sample)")
        return None

    def keep(self, prefix: int, rows: list[int]) -> None:
        """After a tree's verification: keep the cache's first `prefix` tokens and the tree `rows` (the
        anchor and the accepted path, in order), drop the other branches."""
        if rows == list(range(len(rows))):  # the path is the tree's first rows (a chain's shape): a crop
            kept = prefix + len(rows)
            for layer in getattr(self.cache, "layers", []):
                if getattr(layer, "keys", None) is not None and layer.keys.shape[-2] > kept:
                    layer.keys, layer.values = layer.keys[..., :kept, :], layer.values[..., :kept, :]
            return
        index = None  # the kept positions, moved to the device once for every layer
        for layer in getattr(self.cache, "layers", []):
            if getattr(layer, "keys", None) is None or layer.keys.shape[-2] == 0:
                continue
            if index is None:
                index = torch.cat([torch.arange(prefix), torch.tensor(rows, dtype=torch.long) + prefix]).to(
                    layer.keys.device, non_blocking=True)
            layer.keys, layer.values = layer.keys.index_select(-2, index), layer.values.index_select(-2, index)


def choose(logits: torch.Tensor, temperature: float, generator) -> torch.Tensor:
    """Greedy at temperature 0, else a sample from softmax(logits / temperature); `(..., V)` -> `(...)`."""
    if temperature <= 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    flat = torch.multinomial(probs.reshape(-1, probs.shape[-1]), 1, generator=generator)
    return flat.view(probs.shape[:-1])


TREE_WIDTH = 8  # a tree node's children at most, unless the proposal names its own (tree:NxW)


@dataclass(frozen=True)
class Proposal:
    """How a block's drafts come from the drafter's per-slot distributions at temperature T > 0
    (at T = 0 every policy proposes the argmax and the target verifies greedily).

    A DFlash block's slots are marginals, not a joint distribution, so drawing each slot on its
    own makes blocks the target rejects (ARCHITECTURE.md, "Serving at temperature > 0"):
    - `argmax`: the drafter's most likely token per slot. The rule's q is one-hot: a draft x is
      kept with probability p(x), and a rejection draws from p without x.
    - `sample`: per slot an independent draw from q = softmax(logits / T), the standard rule.
    - `sample:F`: a draw from q = softmax(logits / (F T)), sharper for F < 1; the rule uses that q.
    - `tree:N`: N drafts as a tree, best-first from the slots' distributions (`best_first_tree`),
      verified in one target forward with an ancestor-only mask (`verify_tree`); unlike the others
      it differs from the chain at T = 0 as well.
    - `tree:N:F`: the tree built from softmax(logits / F): F > 1 flattens the slots' distributions, so
      the build spends more of its N nodes on second and third choices near the anchor.
    - `stree:N` / `stree:N:F` (a sampled tree): at T > 0 the tree's shape is `tree:N`'s, but a node's
      children are draws without replacement from q = softmax(logits / (F T)), verified by recursive
      rejection sampling (`recursive_verdicts`): a draw the target would rarely pick can still be kept
      with probability min(1, p/q), so a flat target keeps more than the top tokens' mass. At T = 0 it
      serves as `tree:N` (the greedy walk).
    - `tree:NxW`, `stree:NxW` (and with `:F`): a node has at most W children (TREE_WIDTH, 8, without `xW`):
      the best-first build may spend more of its N nodes on a slot's lower candidates, and a sampled
      tree draws up to W children at a node, tried in turn.
    Every policy is lossless: the committed tokens are distributed as the target samples them.
    """
    sample: bool = False  # False: argmax
    sharpen: float = 1.0  # the draws' temperature is sharpen x the serving one (tree:N:F: its build's temperature)
    tree: int = 0  # > 0: the drafts are a tree of this many tokens (sample unused)
    drawn: bool = False  # a tree whose children are drawn from q at T > 0 (stree:N)
    width: int = TREE_WIDTH  # a tree node's children at most (tree:NxW)

    @property
    def name(self) -> str:
        if self.tree:
            kind = "stree" if self.drawn else "tree"
            size = f"{self.tree}" if self.width == TREE_WIDTH else f"{self.tree}x{self.width}"
            return f"{kind}:{size}" if self.sharpen == 1.0 else f"{kind}:{size}:{self.sharpen:g}"
        if not self.sample:
            return "argmax"
        return "sample" if self.sharpen == 1.0 else f"sample:{self.sharpen:g}"

    def greedy_key(self) -> tuple[int, float, int]:
        """Policies with the same key serve the same tokens at T = 0: every chain policy, each tree shape
        (`stree:N:F` serves `tree:N`'s tree there, built at F x 1)."""
        return (self.tree, 1.0 if self.drawn else self.sharpen, self.width) if self.tree else (0, 1.0, TREE_WIDTH)

    def draft(self, logits_KV: torch.Tensor, temperature: float, generator) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The drafts `(K,)` and the distribution q `(K, V)` they were drawn from (None: one-hot at the drafts)."""
        if temperature <= 0 or not self.sample:
            return logits_KV.argmax(dim=-1), None
        q_KV = torch.softmax(logits_KV.float() / (self.sharpen * temperature), dim=-1)
        return torch.multinomial(q_KV, 1, generator=generator).squeeze(-1), q_KV


MAX_TREE = 1024  # drafted tokens of one tree at most: one verification's rows
MAX_TREE_WIDTH = 64  # children of one tree node at most (tree:NxW)


def parse_proposal(text: str) -> Proposal:
    """"argmax", "sample", "sample:F" (F > 0, the draws' temperature as a multiple of the serving one),
    "tree:N" (N drafted tokens, 1 <= N <= MAX_TREE), "tree:N:F" (the tree built from softmax(logits / F)),
    "stree:N" or "stree:N:F" (a sampled tree: children drawn from softmax(logits / (F T)) at T > 0); a tree's
    size may name its width, "NxW" (at most W children a node, 1 <= W <= MAX_TREE_WIDTH; TREE_WIDTH without)."""
    kind, colon, rest = text.strip().partition(":")
    if kind == "argmax" and not colon:
        return Proposal()
    if kind == "sample" and not colon:
        return Proposal(sample=True)
    trees = ("tree", "stree")
    size, _, factor = rest.partition(":") if kind in trees else ("", "", rest)
    size, wide, width = size.strip().partition("x")
    tree = int(size) if size.isdigit() and 1 <= int(size) <= MAX_TREE else 0
    width = int(width) if width.isdigit() and 1 <= int(width) <= MAX_TREE_WIDTH else (0 if wide else TREE_WIDTH)
    if kind in trees and tree and width and not factor:
        return Proposal(tree=tree, drawn=kind == "stree", width=width)
    if (kind == "sample" or (kind in trees and tree and width)) and positive_number(factor):
        return Proposal(sample=not tree, sharpen=float(factor), tree=tree, drawn=kind == "stree", width=width)
    raise ValueError(f"proposal {text!r}: expected argmax, sample or sample:F with a number F > 0 "
                     f"(e.g. sample:0.5 draws at half the serving temperature), or tree:N with 1 <= N <= {MAX_TREE} "
                     f"(tree:N:F: built from softmax(logits / F); stree:N[:F]: children drawn at T > 0; tree:NxW: "
                     f"at most W children a node, 1 <= W <= {MAX_TREE_WIDTH})")


def positive_number(text: str) -> bool:
    try:
        return 0 < float(text) < float("inf")
    except ValueError:
        return False


def accept(draft_tokens: torch.Tensor, q_KV: torch.Tensor | None, target_logits: torch.Tensor, temperature: float,
           generator) -> tuple[int, list[int]]:
    """`(accepted drafts, committed tokens)` of one block: the accepted drafts, then the target's token.

    `target_logits` `(K+1, V)` are the target's at the anchor and the K drafts; `q_KV` is the
    distribution the drafts were drawn from (None: one-hot, argmax proposals). Greedy: drafts are
    accepted while they equal the target's argmax. Sampling: `sampled_verdict`.
    """
    num_drafts = draft_tokens.shape[0]
    if temperature <= 0:
        target_tokens = target_logits.argmax(dim=-1)
        accepted = (draft_tokens == target_tokens[:num_drafts]).int().cumprod(0).sum()
        next_token = target_tokens.gather(0, accepted.view(1))[0]  # a tensor index, not an int: no sync
    else:
        accepted, next_token = sampled_verdict(draft_tokens, q_KV, target_logits, temperature, generator)
    padded = torch.cat([draft_tokens, next_token.view(1)])
    committed = torch.where(torch.arange(num_drafts + 1, device=padded.device) == accepted, next_token, padded)
    verdict = torch.cat([accepted.view(1).to(committed.dtype), committed]).tolist()  # sync: one per block
    return verdict[0], verdict[1:verdict[0] + 2]


def sampled_verdict(draft_tokens: torch.Tensor, q_KV: torch.Tensor | None, target_logits: torch.Tensor,
                    temperature: float, generator) -> tuple[torch.Tensor, torch.Tensor]:
    """The standard lossless rule on every slot at once, as device scalars `(accepted, next token)`.

    Slot k keeps its draft x with probability min(1, p(x) / q(x)) (p: the target's softmax at T);
    the first slot that rejects draws its token from norm(max(0, p - q)) instead, and a block
    accepted whole draws the bonus token from p after its last draft. Every slot's test and
    correction is drawn here, so nothing waits for the host.
    """
    num_drafts = draft_tokens.shape[0]
    p = torch.softmax(target_logits.float() / temperature, dim=-1)  # (K+1, V)
    index = draft_tokens[:, None]
    p_draft = p[:num_drafts].gather(-1, index).squeeze(-1)
    if q_KV is None:  # one-hot q: keep x with p(x); max(0, p - onehot(x)) is p without x
        ratio, residual = p_draft, p[:num_drafts].scatter(-1, index, 0.0)
    else:
        ratio = p_draft / q_KV.gather(-1, index).squeeze(-1).clamp_min(1e-20)
        residual = (p[:num_drafts] - q_KV).clamp_min(0)
    keeps = torch.rand(num_drafts, generator=generator, device=p.device) < ratio
    accepted = keeps.int().cumprod(0).sum()
    rows = torch.cat([residual, p[num_drafts:]])  # the token after k accepted drafts comes from row k
    mass = rows.sum(-1, keepdim=True)
    # no residual mass: p <= q everywhere, so p = q there and that slot never rejects
    rows = torch.where(mass > 0, rows / mass.clamp_min(1e-30), p)
    next_tokens = torch.multinomial(rows, 1, generator=generator).squeeze(-1)
    return accepted, next_tokens.gather(0, accepted.view(1))[0]


@dataclass
class DraftTree:
    """Drafted tokens as a tree under the anchor (node 0); every other node is one slot's candidate
    continuing its parent, at depth = its slot. Nodes are in the order they were added, parents first."""
    tokens: list[int]  # node i's token; node 0 is the anchor
    parents: list[int]  # node i's parent (-1 for the anchor)
    depths: list[int]  # node i's slot (0 for the anchor)
    ranks: list[int] = field(default_factory=list)  # node i's place among its siblings (0: the first child)

    def children(self) -> dict[tuple[int, int], int]:
        """`(parent, token) -> node` for every node but the anchor."""
        return {(parent, token): node for node, (parent, token) in enumerate(zip(self.parents, self.tokens)) if node}

    def child_tokens(self) -> tuple[torch.Tensor, torch.Tensor]:
        """`(tokens (n, width), counts (n,))` on the host: row n holds node n's children's tokens by rank
        (0 past its `counts[n]` children); width is the most children a node has (1 for a lone anchor)."""
        size = len(self.tokens)
        parents, ranks = np.asarray(self.parents[1:], dtype=np.int64), np.asarray(self.ranks[1:], dtype=np.int64)
        children = np.zeros((size, int(ranks.max()) + 1 if size > 1 else 1), dtype=np.int64)
        children[parents, ranks] = self.tokens[1:]  # numpy at once: a 1,024-node tree's loop cost milliseconds
        return torch.from_numpy(children), torch.from_numpy(np.bincount(parents, minlength=size))

    def ancestors(self) -> torch.Tensor:
        """`(n, n)` bool: row i marks node i and its ancestors (what node i's query may see)."""
        size = len(self.tokens)
        seen = np.zeros((size, size), dtype=bool)  # numpy: a row copy costs a microsecond, a tensor's ten
        for node, parent in enumerate(self.parents):
            if parent >= 0:
                seen[node] = seen[parent]
            seen[node, node] = True
        return torch.from_numpy(seen)


def best_first_tree(anchor: int, logits_KV: torch.Tensor, size: int, width: int = TREE_WIDTH) -> DraftTree:
    """The `size` most likely paths' nodes under the anchor, best first, from the drafter's per-slot
    distributions taken as independent: a node's score is the sum of its path's log-probabilities (slot k's
    softmax), and a node enters before any node scored lower. Children of every node at depth k are
    slot k+1's top `width` tokens (the slots are marginals: the drafter does not condition on the branch).
    One transfer of the top tokens to the host."""
    width = min(width, logits_KV.shape[-1], size)
    top_logp, top_ids = torch.log_softmax(logits_KV.float(), dim=-1).topk(width, dim=-1)
    return tree_of(anchor, top_logp.tolist(), top_ids.tolist(), size)  # sync: one per block


def tree_of(anchor: int, top_logp: list[list[float]], top_ids: list[list[int]], size: int) -> DraftTree:
    """`best_first_tree`'s search on the host: slot k's `width` candidates, their log-probabilities
    descending; a node of rank r at depth k + 1 holds `top_ids[k][r]`."""
    num_slots, width = len(top_logp), len(top_logp[0])
    tree = DraftTree([anchor], [-1], [0], [0])
    scores = [0.0]
    # (minus score, slot index, rank, parent): slot index k drafts depth k + 1
    frontier = [(-top_logp[0][0], 0, 0, 0)]
    while frontier and len(tree.tokens) <= size:
        negative, slot, rank, parent = heapq.heappop(frontier)
        node = len(tree.tokens)
        tree.tokens.append(top_ids[slot][rank])
        tree.parents.append(parent)
        tree.depths.append(slot + 1)
        tree.ranks.append(rank)
        scores.append(-negative)
        if rank + 1 < width:  # the next sibling scores lower than this node
            heapq.heappush(frontier, (-(scores[parent] + top_logp[slot][rank + 1]), slot, rank + 1, parent))
        if slot + 1 < num_slots:  # so does the best child
            heapq.heappush(frontier, (-(scores[node] + top_logp[slot + 1][0]), slot + 1, 0, node))
    return tree


def verify_tree(session: TargetSession, tree: DraftTree, device, dtype):
    """One target forward over the tree's tokens (anchor first) after the cached prefix: node i at position
    `prefix + depth`, seeing the prefix, its ancestors and itself. `(prefix, features, logits)`.
    The host's tree reaches the device in non-blocking copies: no wait on the queue (each blocking copy
    drains it, and a loop that waits on the device cannot enqueue ahead of it)."""
    prefix = session.cached_length()
    size = len(tree.tokens)
    ids_and_positions = torch.tensor([tree.tokens, [prefix + depth for depth in tree.depths]], dtype=torch.long)
    ids_and_positions = ids_and_positions.to(device, non_blocking=True)
    seen = tree.ancestors().to(device, non_blocking=True)
    mask = torch.zeros(1, 1, size, prefix + size, dtype=dtype, device=device)
    mask[0, 0, :, prefix:].masked_fill_(~seen, torch.finfo(dtype).min)
    features, logits = session.forward(ids_and_positions[:1], attention_mask=mask, position_ids=ids_and_positions[1:])
    return prefix, features, logits


def drawn_tree(anchor: int, logits_KV: torch.Tensor, size: int, temperature: float, generator,
               width: int = TREE_WIDTH) -> tuple[DraftTree, torch.Tensor]:
    """`stree:N` at T > 0: `(tree, q_KV)`. The shape is `best_first_tree`'s over q = softmax(logits / T)
    (it depends on q alone, never on the draws), and a node of rank r at depth k + 1 holds slot k's r-th draw
    without replacement from q (the Gumbel top-`width` of log q, in draw order). The nodes at one depth
    share the slot's draws: a walk visits one node per depth, so the draws it meets are fresh at each.
    One transfer to the host."""
    width = min(width, logits_KV.shape[-1], size)
    logq_KV = torch.log_softmax(logits_KV.float() / temperature, dim=-1)
    top_logp, _ = logq_KV.topk(width, dim=-1)
    uniform = torch.rand(logq_KV.shape, generator=generator, device=logq_KV.device).clamp_(1e-20, 1.0)
    drawn = (logq_KV - torch.log(-torch.log(uniform))).topk(width, dim=-1).indices
    return tree_of(anchor, top_logp.tolist(), drawn.tolist(), size), logq_KV.exp()  # sync: one per block


def recursive_verdicts(tree: DraftTree, q_KV: torch.Tensor, target_logits: torch.Tensor, temperature: float,
                       generator, graphs: bool | None = None) -> tuple[list[int], list[int]]:
    """Every node's verdict at once, by recursive rejection sampling: `(kept rank, token)` per node.

    Node n's children y_0, y_1, ... (its draws from q, without replacement) are tried in order: y_i is kept
    with probability min(1, p_i(y_i) / q_i(y_i)); after a rejection p_{i+1} = norm(max(0, p_i - q_i)) and
    q_{i+1} is q_i without y_i, renormalised (p_0: the target's softmax at T at node n; q_0: the child slot's
    q). The kept child is distributed as p's draw whenever one is kept, and a node that keeps none (a leaf
    keeps none) draws its token from the last p_i: the walk commits the target's own distribution. Rank
    -1: none kept. One transfer to the host.

    Only the nodes with children run the rule (most of a large tree's nodes are leaves: they draw from p_0
    alone), in `VerdictTries`' closed form: after i rejections p_i is max(0, p - c_i q) over the tokens not
    yet drawn, normalised, so each try needs one sum over the vocabulary. On CUDA the tries are replayed as
    one CUDA graph per shape (eagerly their loop is about 20 small kernels a child rank); `graphs=False`: eagerly."""
    size = len(tree.tokens)
    device = target_logits.device
    children, counts = tree.child_tokens()
    p = torch.softmax(target_logits.float() / temperature, dim=-1)  # (n, V)
    kept = torch.full((size,), -1, dtype=torch.long, device=device)
    tried = torch.rand(size, children.shape[1], generator=generator, device=device)
    inner = torch.nonzero(counts).squeeze(-1)
    if len(inner):
        tries = verdict_tries(len(inner), children.shape[1], q_KV, graphs is not False and device.type == "cuda")
        slots = torch.tensor(tree.depths, dtype=torch.long)[inner].clamp(max=q_KV.shape[0] - 1)
        rows = inner.to(device, non_blocking=True)
        kept_inner, residual = tries(p, q_KV, rows, slots, children[inner], counts[inner], tried)
        kept[rows], p[rows] = kept_inner, residual
    drawn = torch.multinomial(p, 1, generator=generator).squeeze(-1)
    verdicts = torch.stack([kept, drawn]).tolist()  # sync: one per block
    return verdicts[0], verdicts[1]


class VerdictTries:
    """The tries of `recursive_verdicts` for up to `rows` inner nodes of at most `width` children each, in
    static buffers, so that on CUDA they are captured once and replayed (`graph=True`).

    The closed form: with p and q the node's target and child-slot distributions (the slot's q normalised
    over the whole vocabulary), after rejections of y_0 .. y_{i-1} the rule's p_i is max(0, p - c_i q)
    normalised, with c_0 = 0 and c_{i+1} = c_i + Z_i / S_i (Z_i: the sum of max(0, p - c_i q), S_i: q's mass
    not yet drawn, 1 - q(y_0) - .. - q(y_{i-1})), and q_i(y) = q(y) / S_i. A rejected y_i has p(y_i) - c_{i+1}
    q(y_i) < 0, so drawn tokens drop out of the residual by themselves. Try i keeps y_i when
    u_i q_i(y_i) < p_i(y_i), i.e. u_i q(y_i) Z_i < max(0, p(y_i) - c_i q(y_i)) S_i; a row whose every try
    was rejected keeps max(0, p - c q) as the distribution its token is drawn from.

    `kernel` (`VERDICT_KERNEL`, CUDA only) runs the tries as one kernel on these buffers instead of the tensor loop
    (dflash's: a Triton program per row, dflash/model/verdict_kernel.py): the same rule in the same order."""

    def __init__(self, rows: int, width: int, slots: int, vocab: int, device: torch.device, graph: bool,
                 kernel=None):
        self.width = width
        self.p = torch.zeros(rows, vocab, device=device)  # the inner nodes' p; the residual after the tries
        self.q = torch.zeros(slots, vocab, device=device)
        self.index = torch.zeros(rows, 2 + width, dtype=torch.long, device=device)  # slot, count, tokens
        self.tried = torch.zeros(rows, width, device=device)
        self.kernel = kernel
        self.kernel_kept = torch.zeros(rows, dtype=torch.long, device=device)  # the kernel's output
        self.graph, self.kept = None, None
        if graph:
            self.capture()

    def step(self) -> torch.Tensor:
        if self.kernel is not None:
            return self.kernel(self.p, self.q, self.index, self.tried, self.kernel_kept)
        return self.tensor_step()

    def tensor_step(self) -> torch.Tensor:
        """The tries as tensor operations over every row at once, about ten small kernels a child rank."""
        slot, count, tokens = self.index[:, 0], self.index[:, 1], self.index[:, 2:]
        q = self.q.index_select(0, slot)
        p_y, q_y = self.p.gather(-1, tokens), q.gather(-1, tokens)
        left = (1 - (q_y.cumsum(-1) - q_y)).clamp_min(1e-30)  # S_i
        bar = self.tried * q_y  # u_i q(y_i)
        valid = torch.arange(self.width, device=count.device) < count[:, None]
        c = torch.zeros_like(left[:, 0])
        mass = torch.ones_like(c)
        kept = torch.full_like(count, -1)
        for rank in range(self.width):
            trying = (kept < 0) & valid[:, rank]
            keep = trying & (bar[:, rank] * mass < (p_y[:, rank] - c * q_y[:, rank]).clamp_min(0) * left[:, rank])
            kept = torch.where(keep, rank, kept)
            c_next = c + mass / left[:, rank]
            mass_next = torch.addcmul(self.p, c_next[:, None], q, value=-1).clamp_min_(0).sum(-1)
            moved = trying & ~keep & (mass_next > 0)
            c, mass = torch.where(moved, c_next, c), torch.where(moved, mass_next, mass)
        self.p.copy_(torch.addcmul(self.p, c[:, None], q, value=-1).clamp_min_(0))
        return kept

    def capture(self) -> None:
        self.graph, self.kept = capture_graph(self.step)

    def __call__(self, p: torch.Tensor, q_KV: torch.Tensor, inner: torch.Tensor, slots: torch.Tensor,
                 children: torch.Tensor, counts: torch.Tensor, tried: torch.Tensor):
        """`(kept rank, residual p)` of the `inner` rows (indices on p's device) of `p`: `slots` their child slots,
        `children` / `counts` their children's tokens by rank and how many, `tried` (all nodes, width) the
        uniforms of the tries. Padding rows past len(inner) have no children and try nothing."""
        rows, width = len(inner), children.shape[1]
        index = torch.zeros(self.index.shape, dtype=torch.long)
        index[:rows, 0], index[:rows, 1], index[:rows, 2:2 + width] = slots, counts, children
        self.index.copy_(index.to(self.index.device, non_blocking=True))
        self.p[:rows] = p.index_select(0, inner)
        self.q.copy_(q_KV)
        self.tried[:rows, :width] = tried.index_select(0, inner)
        if self.graph is not None:
            self.graph.replay()
        else:
            self.kept = self.step()
        return self.kept[:rows], self.p[:rows]


VERDICT_ROWS_MIN, VERDICT_WIDTH_MIN = 16, 8  # rows and width round up to powers of two from here: few captures


def verdict_tries(rows: int, width: int, q_KV: torch.Tensor, graph: bool) -> VerdictTries:
    """The `VerdictTries` for `rows` inner nodes of up to `width` children, kept per shape (a module-level
    cache keyed by device: the rows and the width rounded up to powers of two, q's slots and vocabulary; a
    padded try of a row tries nothing); on CUDA its tries run as `VERDICT_KERNEL` where one is set."""
    rows = max(VERDICT_ROWS_MIN, 1 << (rows - 1).bit_length())
    width = max(VERDICT_WIDTH_MIN, 1 << (width - 1).bit_length())
    kernel = VERDICT_KERNEL if q_KV.device.type == "cuda" else None
    key = (rows, width, *q_KV.shape, str(q_KV.device), graph, kernel)
    if key not in VERDICT_TRIES:
        VERDICT_TRIES[key] = VerdictTries(rows, width, q_KV.shape[0], q_KV.shape[1], q_KV.device, graph, kernel)
    return VERDICT_TRIES[key]


# The tries as one kernel on CUDA, `fn(p, q, index, tried, kept) -> kept` on `VerdictTries`' buffers, or None (the
# tensor loop). dflash sets its Triton kernel here where Triton is installed (`evaluation.use_verdict_kernel`); an
# export's copy of this file, which imports only torch and transformers, keeps the tensor loop.
VERDICT_KERNEL = None


VERDICT_TRIES: dict[tuple, VerdictTries] = {}


def after_rejection(p: torch.Tensor, q: torch.Tensor, token: torch.Tensor, rejected: torch.Tensor):
    """`(p, q)` for the next child of each row whose child `token` (n, 1) was `rejected` (n, 1): p becomes
    norm(max(0, p - q)) and q loses the token, renormalised; other rows keep theirs."""
    residual = (p - q).clamp_min(0)
    mass = residual.sum(-1, keepdim=True)
    p = torch.where(rejected & (mass > 0), residual / mass.clamp_min(1e-30), p)
    q = q.scatter(-1, token, 0.0)
    return p, torch.where(rejected, q / q.sum(-1, keepdim=True).clamp_min(1e-30), q)


def walk_drawn(tree: DraftTree, kept: list[int], drawn: list[int]) -> tuple[list[int], int]:
    """`(path, next token)` of a sampled tree: from the anchor, follow each node's kept child
    (`recursive_verdicts`); the first node that keeps none gives its drawn token."""
    by_rank = {(parent, rank): node for node, (parent, rank) in enumerate(zip(tree.parents, tree.ranks)) if node}
    path = [0]
    while kept[path[-1]] >= 0:
        path.append(by_rank[(path[-1], kept[path[-1]])])
    return path, drawn[path[-1]]


def walk_tree(tree: DraftTree, target_tokens: list[int]) -> tuple[list[int], int]:
    """`(path, next token)`: from the anchor, follow the child whose token is the target's token at the
    current node (its argmax, or its draw at T > 0) while there is one; the path's nodes start with the
    anchor. Lossless at any temperature: every committed token is the target's own choice at its node."""
    children = tree.children()
    path = [0]
    while (path[-1], target_tokens[path[-1]]) in children:
        path.append(children[(path[-1], target_tokens[path[-1]])])
    return path, target_tokens[path[-1]]


@torch.inference_mode()
def speculative_generate(draft: DFlashDraftModel, target, input_ids: torch.Tensor, max_new_tokens: int,
                         stop_token_ids: list[int], temperature: float, generator=None,
                         proposal: Proposal = Proposal(sample=True), graphs: bool | None = None,
                         observe=None, session=None) -> SpecStats:
    """The serving loop: prefill, then per step draft one block from the anchor (the last committed
    token) by the `proposal` policy, verify it in one target forward, commit the accepted drafts
    plus the target's token.
    Under inference mode, as the baseline `greedy_generate`: with autograd on, the drafter's
    parameters (which require grad) made every draft step record a graph (about a third slower).
    `graphs` (None: on CUDA): the drafter's block replayed as a CUDA graph (`BlockGraph`), and a sampled
    tree's verdicts (`VerdictTries`); True off CUDA runs the graph's static step eagerly; False: the drafter
    eagerly with a growing cache, the verdicts eagerly.
    `observe(draft_logits (K, V), target_logits (K + 1, V))`, if given, sees every chain verification: the drafter's
    slots and the target's logits at the anchor and at each draft (diagnostics: tools/calibration_sampled.py).
    `session`: the target's session in place of a `TargetSession` over transformers' forward, with its interface and
    a `reset()` (dflash's `StaticTargetSession`: a static cache, the forwards as CUDA graphs)."""
    if input_ids.ndim != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"spec_generate serves one sequence: input_ids must be (1, T), got {tuple(input_ids.shape)}")
    device = input_ids.device
    embed_VH = target.get_input_embeddings().weight
    lm_head = target.get_output_embeddings()
    if session is None:
        session = TargetSession(target, draft.target_layer_ids)
    else:
        session.reset()
    stats = SpecStats(output_ids=input_ids, num_prompt_tokens=input_ids.shape[1])
    new_features, logits = session.forward(input_ids, logits_to_keep=1)
    generated = [int(choose(logits[0, -1], temperature, generator))]
    graphs = device.type == "cuda" if graphs is None else graphs
    if graphs and isinstance(draft, DFlashDraftModel):
        blocks = block_graph(draft, embed_VH, lm_head, input_ids.shape[1] + max_new_tokens + draft.block_size,
                             device.type == "cuda")
        draft_block = blocks.block_logits
    else:
        cache = draft.new_cache()
        draft_block = functools.partial(draft.block_logits, cache=cache, embed_VH=embed_VH, lm_head=lm_head)
    stops = set(stop_token_ids)
    stopped = generated[0] in stops
    # As the reference loop counts: verify while the anchor (the last token, not yet verified
    # context) sits inside the budget, so the last verification may run past max_new_tokens.
    if proposal.tree and (refusal := session.tree_refusal()):
        raise ValueError(refusal)
    while len(generated) <= max_new_tokens and not stopped:
        anchor = torch.tensor([generated[-1]], dtype=torch.long, device=device)
        draft_logits = draft_block(new_features, anchor)
        if proposal.tree and proposal.drawn and temperature > 0:
            tree, q_KV = drawn_tree(generated[-1], draft_logits, proposal.tree, proposal.sharpen * temperature,
                                    generator, width=proposal.width)
            prefix, verify_features, target_logits = verify_tree(session, tree, device, embed_VH.dtype)
            path, next_token = walk_drawn(tree, *recursive_verdicts(tree, q_KV, target_logits[0], temperature,
                                                                     generator, graphs=graphs))
        elif proposal.tree:
            build = 1.0 if proposal.drawn else proposal.sharpen
            tree = best_first_tree(generated[-1], draft_logits / build, proposal.tree, width=proposal.width)
            prefix, verify_features, target_logits = verify_tree(session, tree, device, embed_VH.dtype)
            path, next_token = walk_tree(tree, choose(target_logits[0], temperature, generator).tolist())
        if proposal.tree:
            session.keep(prefix, path)
            new_features = verify_features.index_select(1, torch.tensor(path).to(device, non_blocking=True))
            committed = [tree.tokens[node] for node in path[1:]] + [next_token]
            generated += committed
            stopped = not stops.isdisjoint(committed)
            stats.acceptance_lengths.append(len(path))
            continue
        draft_tokens, q_KV = proposal.draft(draft_logits, temperature, generator)
        session.before_verify()
        verify_ids = torch.cat([anchor, draft_tokens])[None]
        verify_features, target_logits = session.forward(verify_ids)
        if observe is not None:
            observe(draft_logits, target_logits[0])
        accepted, committed = accept(draft_tokens, q_KV, target_logits[0], temperature, generator)
        session.rollback(len(draft_tokens) - accepted, verify_ids[:, :accepted + 1])
        new_features = verify_features[:, :accepted + 1]
        generated += committed
        stopped = not stops.isdisjoint(committed)
        stats.acceptance_lengths.append(accepted + 1)
    stats.generated = truncate(generated, max_new_tokens, stops)
    stats.output_ids = torch.cat([input_ids, torch.tensor([stats.generated], dtype=torch.long, device=device)], 1)
    stats.target_forwards = session.forwards
    return stats


def truncate(tokens: list[int], max_new_tokens: int, stops: set[int]) -> list[int]:
    """At most `max_new_tokens`, ending at the first stop token (kept)."""
    tokens = tokens[:max_new_tokens]
    for index, token in enumerate(tokens):
        if token in stops:
            return tokens[:index + 1]
    return tokens


@torch.inference_mode()
def plain_generate(target, input_ids: torch.Tensor, max_new_tokens: int, stop_token_ids=(), temperature: float = 0.0,
                   generator=None, session=None) -> list[int]:
    """Plain decoding, one target forward per token, with the KV cache: greedy at temperature 0, else
    sampled from softmax(logits / temperature) (the baseline of `dflash eval`); through `session` (as
    `speculative_generate`'s) where given."""
    keyword, cache = cache_keyword(target), None
    if session is not None:
        session.reset()

    def logits_of(ids: torch.Tensor) -> torch.Tensor:
        nonlocal cache
        if session is not None:
            return session.forward(ids, logits_to_keep=1)[1]
        out = target(input_ids=ids, use_cache=True, logits_to_keep=1, **{keyword: cache})
        cache = returned_cache(out)
        return out.logits

    logits = logits_of(input_ids)
    generated, stops = [], set(stop_token_ids)
    while True:
        generated.append(int(choose(logits[0, -1], temperature, generator)))  # sync: one per token, as any decoder
        if len(generated) >= max_new_tokens or generated[-1] in stops:
            return generated
        logits = logits_of(torch.tensor([[generated[-1]]], dtype=torch.long, device=input_ids.device))


def greedy_generate(target, input_ids: torch.Tensor, max_new_tokens: int, stop_token_ids=()) -> list[int]:
    """`plain_generate` at temperature 0."""
    return plain_generate(target, input_ids, max_new_tokens, stop_token_ids)
