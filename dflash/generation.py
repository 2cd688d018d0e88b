"""Batched answer generation with the target (transformers `generate`): the engine of
`dflash generate` (stages/generate.py) and of tools/bench_generate.py.

Prompts run in length-sorted batches, longest first (memory peaks in the first batch, not
after an hour), left-padded so that every answer starts at the same column. On CUDA the
static KV cache lets transformers compile the decoding step; prompt widths then round up to
`PAD_WIDTH` so that a few shapes serve every batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

PAD_WIDTH = 64


@dataclass
class Prompt:
    row_id: int  # 0-based row of the source
    messages: list[dict]  # the conversation before the answer
    input_ids: list[int]  # rendered with the chat template, generation prompt added


@dataclass
class Answer:
    token_ids: list[int]  # up to the first end token (dropped)
    text: str
    cut: bool  # reached max_new_tokens without an end token


class Generator:
    def __init__(self, target, tokenizer, stop_ids: list[int], device: torch.device, *, batch_size: int = 0,
                 static_cache: str = "auto", max_new_tokens: int = 1024, temperature: float = 0.0,
                 top_p: float = 1.0):
        """`batch_size` 0: 256 on CUDA, 8 on CPU; `static_cache` auto: on CUDA."""
        self.target, self.tokenizer, self.device = target, tokenizer, device
        self.stops = list(stop_ids)
        pad = getattr(tokenizer, "pad_token_id", None)
        self.pad = pad if pad is not None else self.stops[0]
        cuda = device.type == "cuda"
        self.batch_size = batch_size or (256 if cuda else 8)
        self.static = static_cache == "on" or (static_cache == "auto" and cuda)
        self.width_multiple = PAD_WIDTH if self.static else 1
        self.max_new_tokens = max_new_tokens
        self.sampling = ({"do_sample": True, "temperature": temperature, "top_p": top_p} if temperature > 0
                         else {"do_sample": False})

    def answers(self, prompts: list[Prompt], on_batch: Callable[[list[Answer]], None] | None = None) -> list[Answer]:
        """The answers of `prompts`, in their order; `on_batch` sees each batch's answers as it finishes."""
        order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i].input_ids))
        answers: list[Answer | None] = [None] * len(prompts)
        for first in range(0, len(order), self.batch_size):
            picked = order[first:first + self.batch_size]
            finished = [Answer(ids, self.decode(ids), cut)
                        for ids, cut in self.batch([prompts[i].input_ids for i in picked])]
            for i, answer in zip(picked, finished):
                answers[i] = answer
            if on_batch is not None:
                on_batch(finished)
        return answers

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True) if self.tokenizer is not None else ""

    @torch.inference_mode()
    def batch(self, prompt_ids: list[list[int]]) -> list[tuple[list[int], bool]]:
        """Each prompt's answer tokens (up to the first end token, which is dropped) and whether it was cut."""
        width = -(-max(len(ids) for ids in prompt_ids) // self.width_multiple) * self.width_multiple
        input_ids = torch.full((len(prompt_ids), width), self.pad, dtype=torch.long)
        attention = torch.zeros((len(prompt_ids), width), dtype=torch.long)
        for row, ids in enumerate(prompt_ids):  # left padding: every answer starts at column `width`
            input_ids[row, width - len(ids):] = torch.tensor(ids)
            attention[row, width - len(ids):] = 1
        generated = self.target.generate(
            input_ids=input_ids.to(self.device), attention_mask=attention.to(self.device),
            max_new_tokens=self.max_new_tokens, eos_token_id=self.stops, pad_token_id=self.pad,
            cache_implementation="static" if self.static else None, **self.sampling)
        out = []
        for answer_ids in generated[:, width:].tolist():
            ended = next((i for i, token in enumerate(answer_ids) if token in self.stops), None)
            out.append((answer_ids if ended is None else answer_ids[:ended], ended is None))
        return out
