"""Batched answer generation with the target (transformers `generate`): the engine of
`dflash generate` (stages/generate.py) and of tools/bench_generate.py.

Prompts run in length-sorted batches, longest first (memory peaks in the first batch, not
after an hour), left-padded so that every answer starts at the same column. On CUDA the
static KV cache lets transformers compile the decoding step; prompt widths then round up to
`PAD_WIDTH` so that a few shapes serve every batch.

The output format lives here too: prompts read from a chat source, `part-NNNNN.jsonl` shards
of `{"messages": [..., answer], "source_row", "cut"}` rows, and the manifest that refuses to
mix answers generated with other settings into one directory.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from dflash import data
from dflash.errors import DflashError
from dflash.outputs import write_text_atomic

PAD_WIDTH = 64
MANIFEST = "generate-manifest.txt"
BAD_PROMPT_TOO_LONG = "prompt_too_long"  # the prompt alone reaches data.max_length: no answer could be trained on


class GenerateMismatchError(DflashError, ValueError):
    """The output directory holds answers generated with other settings."""


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


def read_prompts(source: str, split: str, tokenizer, max_length: int, strict: bool, limit: int,
                 bad_rows: dict[str, list[int]]) -> tuple[list[Prompt], int]:
    """Every usable row's prompt rendered with the chat template, in source order (the first
    `limit` if positive), and the number of rows read; unusable rows go into `bad_rows` per
    reason (with `strict`, the first one in file order stops the run)."""
    prompts, num_rows = [], 0
    for row_id, row in data.read_rows(source, split):
        num_rows += 1
        try:
            messages = data.prompt_messages(row)
            input_ids = data.prompt_token_ids(messages, tokenizer)
            if len(input_ids) >= max_length:
                raise data.RowProblem(BAD_PROMPT_TOO_LONG, f"prompt of {len(input_ids)} tokens, data.max_length "
                                                           f"is {max_length}")
        except data.RowProblem as problem:
            if strict:
                raise data.BadRowError(row_id, problem.reason, str(problem)) from None
            bad_rows.setdefault(problem.reason, []).append(row_id)
            continue
        prompts.append(Prompt(row_id, messages, input_ids))
        if len(prompts) == limit:
            break
    return prompts, num_rows


def shard_path(out: Path, k: int) -> Path:
    return out / f"part-{k:05d}.jsonl"


def prepare_output(out: Path, manifest: dict, overwrite: bool) -> None:
    """Create the output directory or continue it; other content is refused (or, with
    `overwrite`, its shards removed)."""
    path = out / MANIFEST
    for partial in out.glob("*.tmp-*"):  # a shard that a killed run was writing
        partial.unlink()
    if path.exists():
        old = json.loads(path.read_text())
        differing = [key for key in sorted(set(old["content"]) | set(manifest["content"]))
                     if old["content"].get(key) != manifest["content"].get(key)]
        if not differing:
            return
        if not overwrite:
            details = "; ".join(f"{key}: output has {old['content'].get(key)!r}, now {manifest['content'].get(key)!r}"
                                for key in differing)
            raise GenerateMismatchError(f"{out} holds answers generated with other settings ({details}); "
                                        f"pass --overwrite to replace them, or choose another --out")
        for part in out.glob("part-*.jsonl"):
            part.unlink()
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(manifest, indent=1) + "\n")


def output_rows(prompts: list[Prompt], answers: list[Answer]) -> list[dict]:
    """The JSONL rows of answered prompts: the conversation with its new last turn, the 1-based
    source row, and whether the answer was cut."""
    return [{"messages": prompt.messages + [{"role": "assistant", "content": answer.text}],
             "source_row": prompt.row_id + 1, "cut": answer.cut} for prompt, answer in zip(prompts, answers)]
