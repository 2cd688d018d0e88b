"""Continuous-batching decoding of full-attention targets: the fast engine of `dflash generate`.

transformers' `generate` runs a batch to its longest answer and pays Python and a kernel
launch per operation for every token; a 135M target at batch 1024 then makes under 9K
tokens/s on an H200 whose arithmetic allows over ten times that. This engine keeps the GPU
busy instead:

- `slots` rows decode together; each slot holds one answer in the making and its own
  position. A slot whose answer ends is refilled with the next request at once (continuous
  batching), so no row waits for the longest answer of its batch.
- The KV cache is allocated once per run, `(slots, kv_heads, max_context, head_dim)` per
  layer; a request's prompt is prefilled into its slot (several new requests in one
  right-padded forward), each decode step writes one key and value per slot at that slot's
  position and attends to the positions up to it.
- Decode attention (`attention`): "sdpa" reads the cache up to the longest row in flight
  (rounded to `ATTEND_MULTIPLE`), with a mask per slot; "flex" (compiled flex attention, CUDA)
  reads each slot's own key blocks only, through a block mask built from the slots' positions.
  Both fold a key head's query heads into query rows, so the cache is never repeated.
- On CUDA one decode step of every slot is captured as a CUDA graph per attended length, and
  `check_every` steps run back to back before the host looks at which slots ended (one small
  transfer).
- The next token is chosen on the device: greedy (argmax, ties to the lowest id as
  `torch.argmax`), or sampled at the slot's temperature with top-k / top-p by inverse
  transform of one uniform number per slot and step. That number comes from a counter hash of
  the request's stream id and the answer position, so a request draws the same answer in
  whatever slot, batch or run it is decoded.

The forward is written here over the model's own modules (embedding, norms, projections,
rotary embedding, MLP, LM head), so it serves the decoder families whose layers are plain
full attention (Llama, Mistral, Qwen2, Qwen3); `unsupported_reason` says why another model
cannot be served, and `dflash.serve.generation` then falls back to transformers' `generate`.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from dflash.extract.target import text_config_summary
from dflash.padding import round_up

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
ATTEND_MULTIPLE = 128  # the attended cache length rounds up to this: one CUDA graph per multiple
KV_BLOCK = 128  # keys per block of the "flex" decode attention's block mask
ATTENTIONS = ("auto", "flex", "sdpa")  # auto: flex on CUDA (1.6x sdpa on an H200, BENCHMARKS.md), sdpa elsewhere
PREFILL_TOKENS = 32768  # padded prompt tokens per prefill forward at most
MASK64 = (1 << 64) - 1


def resolve_attention(attention: str, device: torch.device) -> str:
    """`auto` is flex attention's decoding kernel on CUDA (it reads each slot's own keys; SDPA reads
    the cache up to the longest row in flight) and SDPA elsewhere (flex runs its reference path there)."""
    if attention != "auto":
        return attention
    return "flex" if torch.device(device).type == "cuda" else "sdpa"


@dataclass
class Request:
    key: int  # the caller's index of this request
    prompt_ids: list[int]
    temperature: float = 0.0  # 0: greedy
    stream: int = 0  # sampling stream id (`stream_id`): the request's own random numbers


@dataclass
class Finished:
    key: int
    token_ids: list[int]  # up to the first end token (dropped)
    cut: bool  # reached max_new_tokens without an end token


def splitmix64(value: int) -> int:
    """The splitmix64 finalizer on a Python int (mod 2**64)."""
    z = (value + 0x9E3779B97F4A7C15) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def stream_id(seed: int, row_id: int, sample: int) -> int:
    """The random stream of one answer: a function of the run's seed, the source row and the
    sample index alone, as a signed 64-bit value (what an int64 tensor holds)."""
    z = splitmix64(splitmix64(splitmix64(seed) ^ row_id) ^ sample)
    return z - (1 << 64) if z >= 1 << 63 else z


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def _shift_right(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's `>>` keeps the sign)."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def uniform_from(stream_S: torch.Tensor, step_S: torch.Tensor) -> torch.Tensor:
    """One float32 in (0, 1) per row from (stream, step): splitmix64 in wrapping int64 arithmetic."""
    z = stream_S + (step_S + 1) * _signed(0x9E3779B97F4A7C15)
    z = (z ^ _shift_right(z, 30)) * _signed(0xBF58476D1CE4E5B9)
    z = (z ^ _shift_right(z, 27)) * _signed(0x94D049BB133111EB)
    z = z ^ _shift_right(z, 31)
    return (_shift_right(z, 40).float() + 0.5) / float(1 << 24)


def choose_tokens(logits_SV: torch.Tensor, temperature_S: torch.Tensor, uniform_S: torch.Tensor,
                  top_k: int = 0, top_p: float = 1.0, sampling: bool = True) -> torch.Tensor:
    """Each row's next token: argmax where its temperature is 0, else a draw from
    softmax(logits / temperature) restricted to the top-k tokens and then to the smallest set
    of most likely tokens whose mass reaches top_p, by inverse transform of `uniform_S`.
    `sampling` False: every row is greedy (the sampling work is skipped)."""
    greedy_S = logits_SV.argmax(-1)
    if not sampling:
        return greedy_S
    scaled = logits_SV / temperature_S.clamp_min(1e-6)[:, None]
    if top_k > 0:
        values, ids = scaled.topk(min(top_k, scaled.shape[-1]), dim=-1)
    elif top_p < 1.0:
        values, ids = scaled.sort(dim=-1, descending=True)
    else:
        values, ids = scaled, None
    probs = torch.softmax(values, dim=-1)
    if top_p < 1.0:  # `values` are sorted: keep a token while the mass before it is below top_p
        probs = torch.where(probs.cumsum(-1) - probs < top_p, probs, torch.zeros_like(probs))
    cdf = probs.cumsum(-1)
    target = (uniform_S * cdf[:, -1]).unsqueeze(-1)
    picked = torch.searchsorted(cdf, target).clamp_max(cdf.shape[-1] - 1).squeeze(-1)
    sampled_S = picked if ids is None else ids.gather(-1, picked[:, None]).squeeze(-1)
    return torch.where(temperature_S > 0, sampled_S, greedy_S)


def unsupported_reason(model: nn.Module) -> str | None:
    """Why the engine cannot decode `model`, or None when it can."""
    config = model.config
    model_type = getattr(config, "model_type", "?")
    if model_type not in SUPPORTED_MODEL_TYPES:
        return f"model type {model_type!r} (the engine serves {', '.join(SUPPORTED_MODEL_TYPES)})"
    layer_types = getattr(config, "layer_types", None) or []
    if any(kind != "full_attention" for kind in layer_types):
        return f"layer types {sorted(set(layer_types))} (the engine serves full attention only)"
    if getattr(config, "use_sliding_window", model_type == "mistral") and getattr(config, "sliding_window", None):
        return f"sliding-window attention (window {config.sliding_window})"
    base = getattr(model, "model", None)
    if base is None or not hasattr(base, "rotary_emb") or not hasattr(model, "lm_head"):
        return "no model.model.rotary_emb / lm_head"
    return None


class SlotDecoder:
    """Decodes `Request`s with continuous batching over a fixed number of slots."""

    def __init__(self, model: nn.Module, stop_ids: list[int], *, slots: int, max_new_tokens: int,
                 max_context: int, top_k: int = 0, top_p: float = 1.0, check_every: int = 8,
                 use_graphs: bool | None = None, attention: str = "auto"):
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"the decoding engine cannot serve this target: {reason}")
        self.model, self.base, self.layers = model, model.model, model.model.layers
        self.device = model.lm_head.weight.device
        self.dtype = model.lm_head.weight.dtype
        sizes = text_config_summary(model.config)
        self.num_heads, self.num_kv_heads = sizes["num_attention_heads"], sizes["num_key_value_heads"]
        self.head_dim = sizes["head_dim"]
        self.slots, self.max_new_tokens, self.top_k, self.top_p = slots, max_new_tokens, top_k, top_p
        self.check_every = max(1, check_every)
        self.max_context = round_up(max_context, ATTEND_MULTIPLE)
        self.use_graphs = self.device.type == "cuda" if use_graphs is None else use_graphs
        self.stop_set = set(stop_ids)
        self.stops = torch.tensor(sorted(self.stop_set), dtype=torch.long, device=self.device)
        if attention not in ATTENTIONS:
            raise ValueError(f"attention must be one of {ATTENTIONS}, got {attention!r}")
        self.attention = resolve_attention(attention, self.device)
        # flex attention is compiled on CUDA (its decoding kernel); the CPU runs its reference path
        self.flex = torch.compile(flex_attention, dynamic=False) if self.device.type == "cuda" else flex_attention
        self._allocate()
        self.graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}  # by (attended length, sampling)
        self.graph_pool = None
        self.sampling = False

    @staticmethod
    def cache_bytes_per_slot(model: nn.Module, max_context: int) -> int:
        sizes = text_config_summary(model.config)
        context = round_up(max_context, ATTEND_MULTIPLE)
        return (2 * sizes["num_hidden_layers"] * sizes["num_key_value_heads"] * sizes["head_dim"] * context
                * model.lm_head.weight.element_size())

    def _allocate(self) -> None:
        S, device = self.slots, self.device
        shape = (S, self.num_kv_heads, self.max_context, self.head_dim)
        self.keys = [torch.zeros(shape, dtype=self.dtype, device=device) for _ in self.layers]
        self.values = [torch.zeros(shape, dtype=self.dtype, device=device) for _ in self.layers]
        self.rows_S = torch.arange(S, device=device)
        self.key_positions = torch.arange(self.max_context, device=device)
        num_blocks = self.max_context // KV_BLOCK
        self.block_range = torch.arange(num_blocks, dtype=torch.int32, device=device)
        self.full_block_indices = self.block_range.expand(S, 1, 1, num_blocks).contiguous()
        self.token_S = torch.zeros(S, dtype=torch.long, device=device)  # the token fed at the next step
        self.pos_S = torch.zeros(S, dtype=torch.long, device=device)  # its position
        self.generated_S = torch.zeros(S, dtype=torch.long, device=device)  # answer tokens so far
        self.done_S = torch.ones(S, dtype=torch.bool, device=device)
        self.temperature_S = torch.zeros(S, dtype=torch.float32, device=device)
        self.stream_S = torch.zeros(S, dtype=torch.long, device=device)
        # one spare column: the write target of slots that are done
        self.out_SN = torch.zeros(S, self.max_new_tokens + 1, dtype=torch.long, device=device)

    # ------------------------------------------------------------------ the forward

    def _attention_inputs(self, layer, hidden_BTH: torch.Tensor, cos, sin):
        return attention_inputs(layer, hidden_BTH, cos, sin, self.num_heads, self.num_kv_heads, self.head_dim)

    def _decode_mask(self, group: int) -> BlockMask:
        """The "flex" mask: each slot sees the keys at positions up to its own, the blocks before
        its position's block whole, that block through the mask function, no block after it."""
        S, num_blocks = self.slots, self.block_range.numel()
        length = self.pos_S + 1
        full_S = (length // KV_BLOCK).to(torch.int32)
        partial_S = (length % KV_BLOCK > 0).to(torch.int32)
        partial_index = (full_S[:, None] + self.block_range[None]).clamp_max(num_blocks - 1)
        positions = self.pos_S

        def visible(batch, head, query, key):
            return key <= positions[batch]

        return BlockMask.from_kv_blocks(partial_S.view(S, 1, 1), partial_index.view(S, 1, 1, num_blocks),
                                        full_S.view(S, 1, 1), self.full_block_indices, BLOCK_SIZE=KV_BLOCK,
                                        mask_mod=visible, seq_lengths=(group, self.max_context),
                                        compute_q_blocks=False)

    def _decode_logits(self, attend: int) -> torch.Tensor:
        """One step of every slot: its token at its position; the keys and values go into the cache."""
        S, group = self.slots, self.num_heads // self.num_kv_heads
        hidden = self.base.embed_tokens(self.token_S[:, None])
        cos, sin = self.base.rotary_emb(hidden, self.pos_S[:, None])
        if self.attention == "flex":
            mask = self._decode_mask(group)
        else:
            visible = (self.key_positions[None, :attend] <= self.pos_S[:, None])[:, None, None, :]
        for index, layer in enumerate(self.layers):
            q, k, v, scale = self._attention_inputs(layer, layer.input_layernorm(hidden), cos, sin)
            self.keys[index][self.rows_S, :, self.pos_S] = k[:, :, 0]
            self.values[index][self.rows_S, :, self.pos_S] = v[:, :, 0]
            # grouped-query attention without repeating the cache: a key head's queries are its rows
            q = q.reshape(S, self.num_kv_heads, group, self.head_dim)
            if self.attention == "flex":
                out = self.flex(q, self.keys[index], self.values[index], block_mask=mask, scale=scale)
            else:
                out = F.scaled_dot_product_attention(q, self.keys[index][:, :, :attend],
                                                     self.values[index][:, :, :attend], attn_mask=visible,
                                                     scale=scale)
            hidden = hidden + layer.self_attn.o_proj(out.reshape(S, 1, self.num_heads * self.head_dim))
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        return self.model.lm_head(self.base.norm(hidden[:, 0])).float()

    def _step(self, attend: int) -> None:
        """Decode one token in every live slot; a slot that is done only writes its spare column."""
        logits = self._decode_logits(attend)
        chosen = choose_tokens(logits, self.temperature_S, uniform_from(self.stream_S, self.generated_S),
                               self.top_k, self.top_p, self.sampling)
        live = ~self.done_S
        column = torch.where(live, self.generated_S, self.max_new_tokens)
        self.out_SN[self.rows_S, column] = chosen
        step = live.long()
        self.generated_S += step
        self.pos_S += step
        self.token_S.copy_(torch.where(live, chosen, self.token_S))
        ended = (chosen[:, None] == self.stops[None, :]).any(-1) | (self.generated_S >= self.max_new_tokens)
        self.done_S |= live & ended

    @torch.inference_mode()
    def _prefill(self, requests: list[Request], slots: list[int]) -> None:
        """Prompts into their slots: the cache up to each prompt's end, and the first answer token."""
        device, N = self.device, len(requests)
        lengths = [len(request.prompt_ids) for request in requests]
        width = max(lengths)
        ids = torch.zeros(N, width, dtype=torch.long)
        for row, request in enumerate(requests):  # right padding: causal attention never sees it
            ids[row, :lengths[row]] = torch.tensor(request.prompt_ids)
        ids = ids.to(device)
        slot_N = torch.tensor(slots, dtype=torch.long, device=device)
        hidden = self.base.embed_tokens(ids)
        cos, sin = self.base.rotary_emb(hidden, torch.arange(width, device=device)[None].expand(N, width))
        group = self.num_heads // self.num_kv_heads
        for index, layer in enumerate(self.layers):
            q, k, v, scale = self._attention_inputs(layer, layer.input_layernorm(hidden), cos, sin)
            self.keys[index][slot_N, :, :width] = k
            self.values[index][slot_N, :, :width] = v
            out = F.scaled_dot_product_attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1),
                                                 is_causal=True, scale=scale)
            hidden = hidden + layer.self_attn.o_proj(out.transpose(1, 2).reshape(N, width, -1))
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        last_NH = hidden[torch.arange(N, device=device), torch.tensor(lengths, device=device) - 1]
        logits = self.model.lm_head(self.base.norm(last_NH)).float()
        temperature_N = torch.tensor([r.temperature for r in requests], dtype=torch.float32, device=device)
        stream_N = torch.tensor([r.stream for r in requests], dtype=torch.long, device=device)
        first_N = choose_tokens(logits, temperature_N, uniform_from(stream_N, torch.zeros_like(stream_N)),
                                self.top_k, self.top_p, self.sampling)
        self.out_SN[slot_N, 0] = first_N
        self.token_S[slot_N] = first_N
        self.pos_S[slot_N] = torch.tensor(lengths, device=device)
        self.generated_S[slot_N] = 1
        self.temperature_S[slot_N] = temperature_N
        self.stream_S[slot_N] = stream_N
        ended = (first_N[:, None] == self.stops[None, :]).any(-1) | (self.max_new_tokens <= 1)
        self.done_S[slot_N] = ended

    # ------------------------------------------------------------------ CUDA graphs

    def _state(self) -> list[torch.Tensor]:
        return [self.token_S, self.pos_S, self.generated_S, self.done_S, self.out_SN]

    def _run_steps(self, attend: int, count: int) -> None:
        if not self.use_graphs:
            for _ in range(count):
                self._step(attend)
            return
        graph = self.graphs.get((attend, self.sampling))
        if graph is None:
            graph = self.graphs[attend, self.sampling] = self._capture(attend)
        for _ in range(count):
            graph.replay()

    def _capture(self, attend: int) -> torch.cuda.CUDAGraph:
        """The step at this attended length as a CUDA graph. The warm-up steps run on a copy of
        the state (the keys and values they write are the ones the real step writes again)."""
        saved = [tensor.clone() for tensor in self._state()]
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._step(attend)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        for tensor, copy in zip(self._state(), saved):
            tensor.copy_(copy)
        if self.graph_pool is None:
            self.graph_pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.graph_pool):
            self._step(attend)
        for tensor, copy in zip(self._state(), saved):
            tensor.copy_(copy)
        return graph

    # ------------------------------------------------------------------ the loop

    @torch.inference_mode()
    def run(self, requests: Iterable[Request], on_finished: Callable[[Finished], None],
            on_steps: Callable[[int], None] | None = None) -> None:
        """Decode every request; `on_finished` gets each answer as it ends (not in request order),
        `on_steps` the number of decode steps after each group of them."""
        queue = deque(requests)
        self.sampling = any(request.temperature > 0 for request in queue)
        for request in queue:
            if len(request.prompt_ids) + self.max_new_tokens > self.max_context:
                raise ValueError(f"request {request.key}: prompt of {len(request.prompt_ids)} tokens + "
                                 f"{self.max_new_tokens} new ones exceed the engine's context {self.max_context}")
        self.done_S.fill_(True)
        owner: list[Request | None] = [None] * self.slots
        generated = [0] * self.slots  # the host's copy, as of the last check
        free = list(range(self.slots))
        refill_at = max(1, self.slots // 32)  # fewer, larger prefills; every slot is used again soon
        while queue or len(free) < self.slots:
            if queue and (len(free) >= min(refill_at, len(queue)) or len(free) == self.slots):
                for slot in self._refill(queue, free, owner):
                    generated[slot] = 1
            furthest = max(len(owner[slot].prompt_ids) + generated[slot] for slot in range(self.slots)
                           if owner[slot] is not None)
            attend = min(self.max_context, round_up(furthest + self.check_every, ATTEND_MULTIPLE))
            if self.attention == "flex":  # the block mask bounds each slot: one graph for every length
                attend = self.max_context
            self._run_steps(attend, self.check_every)
            if on_steps is not None:
                on_steps(self.check_every)
            self._collect(owner, free, generated, on_finished)

    def _refill(self, queue: deque, free: list[int], owner: list) -> list[int]:
        """Prefill the next requests into free slots, `PREFILL_TOKENS` padded tokens a forward at
        most; returns the slots filled."""
        taken = sorted((queue.popleft() for _ in range(min(len(free), len(queue)))),
                       key=lambda request: len(request.prompt_ids))
        filled = []
        while taken:
            group = [taken.pop(0)]  # ascending lengths: the newest member is the group's width
            while taken and (len(group) + 1) * len(taken[0].prompt_ids) <= PREFILL_TOKENS:
                group.append(taken.pop(0))
            slots = [free.pop() for _ in group]
            for slot, request in zip(slots, group):
                owner[slot] = request
            self._prefill(group, slots)
            filled += slots
        return filled

    def _collect(self, owner: list, free: list[int], generated: list[int],
                 on_finished: Callable[[Finished], None]) -> None:
        """Hand over the answers of slots that are done and free those slots; refresh `generated`."""
        done, counts = torch.stack([self.done_S.long(), self.generated_S]).tolist()  # sync: once per check
        generated[:] = counts
        ended = [slot for slot in range(self.slots) if done[slot] and owner[slot] is not None]
        if not ended:
            return
        rows = self.out_SN[torch.tensor(ended, device=self.device)].tolist()
        for slot, row in zip(ended, rows):
            tokens = row[:counts[slot]]
            cut = not tokens or tokens[-1] not in self.stop_set
            on_finished(Finished(owner[slot].key, tokens if cut else tokens[:-1], cut))
            owner[slot] = None
            free.append(slot)


def attention_inputs(layer, hidden_BTH: torch.Tensor, cos, sin, num_heads: int, num_kv_heads: int, head_dim: int):
    """A full-attention layer's q `(B, heads, T, D)`, k and v `(B, kv heads, T, D)` (RoPE applied) and its
    scale, from the layer's own modules, for the hidden states `(B, T, H)` after its input norm."""
    attention = layer.self_attn
    B, T, _ = hidden_BTH.shape
    q = attention.q_proj(hidden_BTH).view(B, T, num_heads, head_dim)
    k = attention.k_proj(hidden_BTH).view(B, T, num_kv_heads, head_dim)
    v = attention.v_proj(hidden_BTH).view(B, T, num_kv_heads, head_dim)
    if hasattr(attention, "q_norm"):  # Qwen3: RMSNorm over each head's dims, before RoPE
        q, k = attention.q_norm(q), attention.k_norm(k)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    q = q * cos + _rotate_half(q) * sin
    k = k * cos + _rotate_half(k) * sin
    return q, k, v, attention.scaling


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
