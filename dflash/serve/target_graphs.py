"""The target of `dflash eval` over a static KV cache, each forward's shape replayed as a CUDA graph.

`modeling_dflash.TargetSession` calls transformers' forward with its dynamic cache: one Python pass over every
layer per call, a launch per operation. For a small target that pass is the whole cost of a token: on an idle
H100 SmolLM2-135M took 21-31 ms a plain token, and one process alone varied 2.5x between prompts (12-06), so
the speedups `dflash eval` reported carried the host's noise. Serving engines run the target as CUDA graphs
over a static cache; `StaticTargetSession` does the same for the eval, for the plain baseline and the
speculative loop alike:

- the keys and values live in one `(1, kv heads, max_context, head_dim)` tensor per layer, allocated once per
  session; `length` is the committed prefix. A forward writes its T new tokens at `length ...` (a tree's nodes
  side by side, each at its own RoPE position), attends over the cache with a mask (the prefix, then the new
  tokens' own pattern: causal for a chain, ancestors for a tree) and commits them; a rejected draft is dropped by
  moving `length` back, a tree's accepted path by copying its rows down (`keep`);
- the first forward (the prompt) runs eagerly; every later shape (tokens, logits kept) is captured once as a CUDA
  graph on CUDA and replayed (its inputs copied into static buffers first);
- the forward is written over the model's own modules (`decoding.attention_inputs`: embedding, norms,
  projections, RoPE, MLP, LM head), the families `decoding.unsupported_reason` accepts (Llama, Mistral, Qwen2,
  Qwen3); others keep `TargetSession`.

It has `TargetSession`'s interface (forward, before_verify, rollback, keep, cached_length, tree_refusal), so
`speculative_generate(..., session=)` and `plain_generate(..., session=)` take it. The same features and logits
as transformers' forward on the tiny targets of tests/test_target_graphs.py (float32, CPU).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dflash.extract.target import text_config_summary
from dflash.model.modeling_dflash import capture_graph
from dflash.padding import round_up
from dflash.serve.decoding import attention_inputs, unsupported_reason

CONTEXT_MULTIPLE = 256  # the cache's length rounds up to this


class StaticTargetSession:
    """A target with a static KV cache of `max_context` tokens; forwards return the chosen layers' outputs."""

    def __init__(self, target: nn.Module, layer_ids: list[int], max_context: int, graphs: bool | None = None):
        reason = unsupported_reason(target)
        if reason is not None:
            raise ValueError(f"a static target session cannot serve this target: {reason}")
        self.target, self.base, self.layers = target, target.model, target.model.layers
        self.layer_ids = list(layer_ids)
        self.device = target.lm_head.weight.device
        self.dtype = target.lm_head.weight.dtype
        sizes = text_config_summary(target.config)
        self.num_heads, self.num_kv_heads = sizes["num_attention_heads"], sizes["num_key_value_heads"]
        self.head_dim = sizes["head_dim"]
        self.max_context = round_up(max_context, CONTEXT_MULTIPLE)
        self.use_graphs = self.device.type == "cuda" if graphs is None else graphs
        shape = (1, self.num_kv_heads, self.max_context, self.head_dim)
        self.keys = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in self.layers]
        self.values = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in self.layers]
        self.key_slots = torch.arange(self.max_context, device=self.device)
        self.start = torch.zeros((), dtype=torch.long, device=self.device)  # `length` on the device
        self.graphs: dict[tuple[int, int], tuple] = {}  # (tokens, logits kept) -> (graph, inputs, outputs)
        self.graph_pool = None
        self.causal: dict[int, torch.Tensor] = {}  # a chain's mask among its new tokens, by their count
        self.reset()

    @staticmethod
    def supports(target: nn.Module) -> bool:
        return unsupported_reason(target) is None

    def reset(self) -> None:
        """A new sequence: an empty cache (the graphs stay)."""
        self.length, self.forwards = 0, 0

    # ------------------------------------------------------------------ TargetSession's interface

    def forward(self, input_ids: torch.Tensor, logits_to_keep: int = 0, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None):
        """`(features (1, T, n*H), logits (1, K, V))` of `input_ids` `(1, T)` after the cached prefix. Without a mask
        the new tokens are a chain (causal, positions `length ...`); `attention_mask` is a tree's additive
        `(1, 1, T, length + T)` mask (0 where visible) and `position_ids` `(1, T)` its nodes' positions
        (`modeling_dflash.verify_tree`)."""
        num_new = input_ids.shape[1]
        if self.length + num_new > self.max_context:
            raise ValueError(f"static target session: {self.length} cached + {num_new} new tokens exceed its "
                             f"{self.max_context} (max_context)")
        if attention_mask is None:
            if num_new not in self.causal:
                self.causal[num_new] = torch.ones(num_new, num_new, dtype=torch.bool, device=self.device).tril_()
            new_mask = self.causal[num_new]
        else:
            new_mask = attention_mask[0, 0, :, self.length:self.length + num_new] == 0
        if position_ids is None:
            positions = torch.arange(self.length, self.length + num_new, device=self.device)
        else:
            positions = position_ids[0]
        self.start.fill_(self.length)
        if self.length == 0 or not self.use_graphs:  # the prompt (its own length) runs eagerly
            features, logits = self._forward(input_ids, positions, new_mask, logits_to_keep)
        else:
            graph, inputs, outputs = self._graph(num_new, logits_to_keep)
            for buffer, value in zip(inputs, (input_ids, positions, new_mask)):
                buffer.copy_(value)
            graph.replay()
            features, logits = outputs
        self.length += num_new
        self.forwards += 1
        return features, logits

    def croppable(self) -> bool:
        return True

    def before_verify(self) -> None:
        pass

    def rollback(self, num_rejected: int, accepted_ids: torch.Tensor) -> None:
        """Drop the last `num_rejected` tokens of the last forward."""
        self.length -= num_rejected

    def cached_length(self) -> int:
        return self.length

    def tree_refusal(self) -> str | None:
        return None

    def keep(self, prefix: int, rows: list[int]) -> None:
        """After a tree's verification: keep the first `prefix` tokens and the tree `rows` (anchor and accepted
        path, in order), copied down to `prefix ...`."""
        kept = prefix + len(rows)
        if rows != list(range(len(rows))):
            index = (torch.tensor(rows, dtype=torch.long) + prefix).to(self.device, non_blocking=True)
            for cache in (*self.keys, *self.values):
                cache[:, :, prefix:kept] = cache.index_select(2, index)
        self.length = kept

    # ------------------------------------------------------------------ the forward

    def _forward(self, ids_1T: torch.Tensor, positions_T: torch.Tensor, new_mask_TT: torch.Tensor,
                 logits_to_keep: int):
        """The new tokens through every layer, their keys and values into the cache at `start ...`."""
        num_new, group = ids_1T.shape[1], self.num_heads // self.num_kv_heads
        slots_T = self.start + torch.arange(num_new, device=self.device)
        offset_C = self.key_slots - self.start  # each cache slot's place among the new tokens
        among_new = (offset_C >= 0) & (offset_C < num_new)
        pattern = new_mask_TT.gather(1, offset_C.clamp(0, num_new - 1).expand(num_new, -1))
        visible_TC = (offset_C < 0)[None, :] | (among_new[None, :] & pattern)
        # a key head's query heads folded into rows (group x T): the cache is read once, never repeated
        visible = visible_TC.repeat(group, 1)[None, None]
        hidden = self.base.embed_tokens(ids_1T)
        cos, sin = self.base.rotary_emb(hidden, positions_T[None])
        features = []
        for index, layer in enumerate(self.layers):
            q, k, v, scale = attention_inputs(layer, layer.input_layernorm(hidden), cos, sin, self.num_heads,
                                              self.num_kv_heads, self.head_dim)
            self.keys[index].index_copy_(2, slots_T, k)
            self.values[index].index_copy_(2, slots_T, v)
            q = q.reshape(1, self.num_kv_heads, group * num_new, self.head_dim)
            out = F.scaled_dot_product_attention(q, self.keys[index], self.values[index], attn_mask=visible,
                                                 scale=scale)
            out = out.reshape(1, self.num_heads, num_new, self.head_dim).transpose(1, 2).reshape(1, num_new, -1)
            hidden = hidden + layer.self_attn.o_proj(out)
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
            features.append(hidden)
        normed = self.base.norm(hidden)
        # transformers' hidden_states: the embeddings, then each layer's output; the last one after the final norm
        features[-1] = normed
        chosen = torch.cat([features[i] for i in self.layer_ids], dim=-1) if self.layer_ids else normed[..., :0]
        logits = self.target.lm_head(normed[:, -logits_to_keep:] if logits_to_keep else normed)
        return chosen, logits

    def _graph(self, num_new: int, logits_to_keep: int):
        key = (num_new, logits_to_keep)
        if key not in self.graphs:
            self.graphs[key] = self._capture(num_new, logits_to_keep)
        return self.graphs[key]

    def _capture(self, num_new: int, logits_to_keep: int):
        """The forward of `num_new` tokens as a CUDA graph over static inputs (ids, positions, the new tokens'
        mask; `start` is the session's). Its warm-up runs write the keys and values the real forward writes
        again, past the committed prefix."""
        device = self.device
        inputs = (torch.zeros(1, num_new, dtype=torch.long, device=device),
                  self.start + torch.arange(num_new, device=device),
                  torch.ones(num_new, num_new, dtype=torch.bool, device=device).tril_())
        if self.graph_pool is None:
            self.graph_pool = torch.cuda.graph_pool_handle()
        graph, outputs = capture_graph(lambda: self._forward(*inputs, logits_to_keep), warm_ups=2,
                                       pool=self.graph_pool)
        return graph, inputs, outputs

