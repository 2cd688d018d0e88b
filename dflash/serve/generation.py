"""Answer generation with the target: the engine of `dflash generate` (stages/generate.py) and
of tools/bench_generate.py.

Each `Job` is one answer to make: a prompt, its sample index (0 greedy, 1.. sampled) and the
output shard it belongs to. Two paths make them:

- `slots` (`dflash.serve.decoding.SlotDecoder`): continuous batching with a KV cache allocated once
  and CUDA-graph decode steps, for full-attention targets (Llama, Mistral, Qwen2, Qwen3). Every
  sampled answer draws from its own stream (seed, source row, sample index), so it is the same
  in whatever batch or run it is decoded.
- `generate` (transformers' `generate`, the fallback for the other families, such as the
  Qwen3.5/3.6 hybrid whose linear-attention state the engine does not hold): each shard's jobs
  run in length-sorted, left-padded batches, longest first, with one sampling seed per shard.
  On CUDA the static KV cache lets transformers compile the decoding step; prompt widths then
  round up to `PAD_WIDTH` so that a few shapes serve every batch.

The output format lives here too: prompts read from a chat source, `part-NNNNN.jsonl` shards
of `{"messages": [..., answer], "source_row", "sample", "cut"}` rows (with `"asked"`, `"turns": 2` and
the source's `"kind"` where they apply), and the manifest that refuses to mix answers generated with
other settings into one directory. The jobs of `dflash generate --ask-temperature` and `--turns 2`
(the target writes a user turn, then answers it) are made here too (`ask_job`, `follow_up_ask_job`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import torch

from dflash.data import chat, samples
from dflash.data.starts import FOLLOW_UP_STARTS
from dflash.errors import DflashError
from dflash.outputs import write_text_atomic
from dflash.padding import round_up
from dflash.serve.decoding import Request, SlotDecoder, resolve_attention, stream_id, unsupported_reason

PAD_WIDTH = 64
MANIFEST = "generate-manifest.txt"
BAD_PROMPT_TOO_LONG = "prompt_too_long"  # the prompt alone reaches data.max_length: no answer could be trained on
ENGINES = ("auto", "slots", "generate")
SLOTS_MAX = 1024  # the engine's default slot count on CUDA, when the KV cache fits
# The engine takes jobs in windows of this many times its slots, longest prompt first within each:
# a step attends as far as its longest row, so long prompts decode together, not beside short ones.
WINDOW_SLOTS = 8
CACHE_MEMORY_SHARE = 0.5  # of the GPU's free memory, for the engine's KV cache
FREE_MEMORY_MAX = 0.8  # a `cache_share` cache takes at most this much of what is free (room for activations)


class GenerateMismatchError(DflashError, ValueError):
    """The output directory holds answers generated with other settings."""


@dataclass
class Prompt:
    row_id: int  # 0-based row of the source
    messages: list[dict]  # the conversation before the answer
    input_ids: list[int]  # rendered with the chat template, generation prompt added
    asked: bool = False  # the target wrote its last user turn (`asked_prompt`)
    kind: str = ""  # the source row's `kind` of request (embedded:ask-general's), carried to the output


@dataclass
class Job:
    prompt: Prompt
    sample: int  # 0: the greedy answer; 1..N: sampled answers
    shard: int  # output shard it belongs to
    turn: int = 1  # 2: a job of the second user turn or its answer (`dflash generate --turns 2`)

    @property
    def stream_sample(self) -> int:
        """The sample index that names this job's random stream: a second turn's jobs draw apart from the first's."""
        return self.sample + (self.turn - 1) * TURN_STREAMS


@dataclass
class Answer:
    token_ids: list[int]  # up to the first end token (dropped)
    text: str
    cut: bool  # reached max_new_tokens without an end token


def sample_indices(temperature: float, num_samples: int, with_greedy: bool) -> list[int]:
    """The answers made per prompt: greedy alone at temperature 0, else N sampled ones (1..N),
    with the greedy one (0) first when asked."""
    if temperature <= 0:
        return [0]
    return ([0] if with_greedy else []) + list(range(1, num_samples + 1))


class Generator:
    def __init__(self, target, tokenizer, stop_ids: list[int], device: torch.device, *, batch_size: int = 0,
                 cache_share: float = 0.0, engine: str = "auto", static_cache: str = "auto", max_new_tokens: int = 1024,
                 temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int = 0,
                 decode_attention: str = "auto"):
        """`batch_size` 0: the engine's slots fill half the free GPU memory (at most `SLOTS_MAX`), or with
        `cache_share` > 0 that share of the GPU's whole memory (processes side by side: each its own share),
        transformers' batches are 256 prompts; on the CPU 8. `static_cache` auto: on CUDA
        (transformers' path only). `engine` auto: the slots engine where the target allows it;
        `decode_attention` its decode step's attention (`dflash.serve.decoding.ATTENTIONS`)."""
        self.target, self.tokenizer, self.device = target, tokenizer, device
        self.stops = list(stop_ids)
        pad = getattr(tokenizer, "pad_token_id", None)
        self.pad = pad if pad is not None else self.stops[0]
        cuda = device.type == "cuda"
        self.requested_batch, self.cache_share = batch_size, cache_share
        self.batch_size = batch_size or (256 if cuda else 8)
        self.static = static_cache == "on" or (static_cache == "auto" and cuda)
        self.width_multiple = PAD_WIDTH if self.static else 1
        self.max_new_tokens, self.temperature, self.top_p, self.top_k, self.seed = (
            max_new_tokens, temperature, top_p, top_k, seed)
        self.decode_attention = decode_attention
        reason = unsupported_reason(target)
        if engine == "slots" and reason is not None:
            raise ValueError(f"--engine slots cannot serve this target: {reason}")
        self.engine = "slots" if engine != "generate" and reason is None else "generate"
        self.fallback_reason = reason if engine == "auto" else None
        self.decoder: SlotDecoder | None = None  # kept across runs: its KV cache and CUDA graphs

    def describe(self) -> str:
        """One line: which path makes the answers, and why when it is the fallback."""
        if self.engine == "slots":
            attention = resolve_attention(self.decode_attention, self.device)
            return "decoding: continuous batching over a preallocated KV cache" + (
                ", CUDA graphs" if self.device.type == "cuda" else "") + f", {attention} decode attention"
        if self.fallback_reason:
            return (f"decoding: transformers' generate (the fast engine does not serve {self.fallback_reason}); "
                    "expect fewer tokens/s")
        return "decoding: transformers' generate (--engine generate)"

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True) if self.tokenizer is not None else ""

    def run(self, jobs: list[Job], on_answer: Callable[[int, Answer], None],
            on_steps: Callable[[int], None] | None = None, temperature: float | None = None) -> None:
        """Every job's answer, handed to `on_answer(job index, answer)` as it is made (not in job order);
        `temperature` (> 0) samples this run's sampled jobs at another temperature than the generator's."""
        temperature = self.temperature if temperature is None else temperature
        if not jobs:  # e.g. every prompt the target was asked to write was dropped
            return
        if self.engine == "slots":
            self._run_slots(jobs, on_answer, on_steps, temperature)
        else:
            self._run_generate(jobs, on_answer, temperature)

    def answers(self, jobs: list[Job]) -> list[Answer]:
        """Every job's answer, in job order."""
        out: list[Answer | None] = [None] * len(jobs)
        self.run(jobs, lambda index, answer: out.__setitem__(index, answer))
        return out

    # ------------------------------------------------------------------ the slots engine

    def slot_count(self, max_context: int) -> int:
        if self.requested_batch or self.device.type != "cuda":
            return self.batch_size
        per_slot = SlotDecoder.cache_bytes_per_slot(self.target, max_context)
        free, total = torch.cuda.mem_get_info(self.device)
        if self.cache_share > 0:
            room, where = min(total * self.cache_share, free * FREE_MEMORY_MAX), f"{self.cache_share:.0%} of the GPU"
        else:
            room, where = free * CACHE_MEMORY_SHARE, f"{CACHE_MEMORY_SHARE:.0%} of the GPU's free memory"
        fits = int(room // per_slot)
        if fits < 1:
            raise ValueError(f"one slot's KV cache ({per_slot / 2**30:.1f} GiB at context {max_context}) does not fit "
                             f"in {where}; lower --max-new-tokens or data.max_length")
        return min(SLOTS_MAX, fits)

    def _run_slots(self, jobs: list[Job], on_answer, on_steps, temperature: float) -> None:
        max_context = max(len(job.prompt.input_ids) for job in jobs) + self.max_new_tokens
        slots = min(self.slot_count(max_context), len(jobs))
        decoder = self.decoder
        if decoder is None or decoder.slots != slots or decoder.max_context < max_context:
            self.decoder = decoder = None  # free the old cache first
            decoder = self.decoder = SlotDecoder(self.target, self.stops, slots=slots,
                                                 max_new_tokens=self.max_new_tokens, max_context=max_context,
                                                 top_k=self.top_k, top_p=self.top_p, attention=self.decode_attention)
            # the slot count sets the engine's pace: say it (side by side, each process sizes from what is free)
            print(f"decoding: {slots} slots of up to {max_context} tokens"
                  + (f" ({torch.cuda.mem_get_info(self.device)[0] / 2**30:.1f} GiB of the GPU free after their cache)"
                     if self.device.type == "cuda" else ""), flush=True)
        window = WINDOW_SLOTS * slots
        order = [index for first in range(0, len(jobs), window)
                 for index in sorted(range(first, min(first + window, len(jobs))),
                                     key=lambda i: -len(jobs[i].prompt.input_ids))]
        requests = [Request(index, jobs[index].prompt.input_ids, temperature if jobs[index].sample else 0.0,
                            stream_id(self.seed, jobs[index].prompt.row_id, jobs[index].stream_sample))
                    for index in order]
        decoder.run(requests, lambda done: on_answer(done.key, Answer(done.token_ids, self.decode(done.token_ids),
                                                                      done.cut)), on_steps)

    # ------------------------------------------------------------------ transformers' generate

    def _run_generate(self, jobs: list[Job], on_answer, temperature: float) -> None:
        """Shard by shard: one sampling seed per shard, greedy and sampled jobs apart, length-sorted
        batches, longest first (memory peaks in the first batch, not after an hour)."""
        for shard in sorted({job.shard for job in jobs}):
            mine = [index for index, job in enumerate(jobs) if job.shard == shard]
            # A resumed shard draws the same; its second turn apart from its first.
            torch.manual_seed(self.seed * 1_000_003 + shard + (jobs[mine[0]].turn - 1) * TURN_STREAMS)
            for greedy in (True, False):
                picked = sorted((i for i in mine if (jobs[i].sample == 0) == greedy),
                                key=lambda i: -len(jobs[i].prompt.input_ids))
                for first in range(0, len(picked), self.batch_size):
                    batch = picked[first:first + self.batch_size]
                    made = self.batch([jobs[i].prompt.input_ids for i in batch], 0.0 if greedy else temperature)
                    for i, (ids, cut) in zip(batch, made):
                        on_answer(i, Answer(ids, self.decode(ids), cut))

    @torch.inference_mode()
    def batch(self, prompt_ids: list[list[int]], temperature: float = 0.0) -> list[tuple[list[int], bool]]:
        """Each prompt's answer tokens (up to the first end token, which is dropped) and whether it was cut;
        greedy at temperature 0, else sampled at it with the generator's top-p and top-k."""
        width = round_up(max(len(ids) for ids in prompt_ids), self.width_multiple)
        input_ids = torch.full((len(prompt_ids), width), self.pad, dtype=torch.long)
        attention = torch.zeros((len(prompt_ids), width), dtype=torch.long)
        for row, ids in enumerate(prompt_ids):  # left padding: every answer starts at column `width`
            input_ids[row, width - len(ids):] = torch.tensor(ids)
            attention[row, width - len(ids):] = 1
        sampling = ({"do_sample": True, "temperature": temperature, "top_p": self.top_p, "top_k": self.top_k}
                    if temperature > 0 else {"do_sample": False})
        generated = self.target.generate(
            input_ids=input_ids.to(self.device), attention_mask=attention.to(self.device),
            max_new_tokens=self.max_new_tokens, eos_token_id=self.stops, pad_token_id=self.pad,
            cache_implementation="static" if self.static else None, **sampling)
        out = []
        for answer_ids in generated[:, width:].tolist():
            ended = next((i for i, token in enumerate(answer_ids) if token in self.stops), None)
            out.append((answer_ids if ended is None else answer_ids[:ended], ended is None))
        return out


def read_prompts(source: str, split: str, tokenizer, max_length: int, strict: bool, limit: int,
                 bad_rows: dict[str, list[int]]) -> tuple[list[Prompt], int]:
    """Every usable row's prompt rendered with the chat template, in source order (the first
    `limit` if positive), and the number of rows read; unusable rows go into `bad_rows` per
    reason (with `strict`, the first one in file order stops the run). An evaluation-only source
    (`chat.HELDOUT_SOURCES`) is refused."""
    chat.refuse_heldout(source, "dflash generate")
    prompts, num_rows = [], 0
    for row_id, row in chat.read_rows(source, split):
        num_rows += 1
        try:
            messages = chat.prompt_messages(row)
            input_ids = samples.prompt_token_ids(messages, tokenizer)
            if len(input_ids) >= max_length:
                raise chat.RowProblem(BAD_PROMPT_TOO_LONG, f"prompt of {len(input_ids)} tokens, data.max_length "
                                                           f"is {max_length}")
        except chat.RowProblem as problem:
            if strict:
                raise chat.BadRowError(row_id, problem.reason, str(problem)) from None
            bad_rows.setdefault(problem.reason, []).append(row_id)
            continue
        kind = row.get("kind") if isinstance(row, dict) else None
        prompts.append(Prompt(row_id, messages, input_ids, kind=kind if isinstance(kind, str) else ""))
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


def output_row(job: Job, answer: Answer) -> dict:
    """The JSONL row of one answer: the conversation with its new last turn, the 1-based source
    row, the sample index (0 greedy) and whether the answer was cut."""
    row = {"messages": job.prompt.messages + [{"role": "assistant", "content": answer.text}],
           "source_row": job.prompt.row_id + 1, "sample": job.sample, "cut": answer.cut}
    if job.prompt.asked:
        row["asked"] = True
    if job.turn == 2:
        row["turns"] = 2
    if job.prompt.kind:
        row["kind"] = job.prompt.kind
    return row


ASK_SAMPLE = -1  # the sample index of a prompt's asking: its own sampling stream, apart from the answers' 0..N
ASKED_CUT = "asked_cut"  # the target did not end the turn within --max-new-tokens
ASKED_EMPTY = "asked_empty"  # it ended the turn at once
TURN_STREAMS = 1 << 32  # a second turn's jobs draw from the streams of their sample index plus this
FIRST_ANSWER_CUT = "first_answer_cut"  # --turns 2: the first answer was cut, so no follow-up is asked


def ask_job(prompt: Prompt, tokenizer, shard: int) -> Job:
    """The job in which the target writes the rest of `prompt`'s last user turn."""
    return Job(replace(prompt, input_ids=samples.ask_prompt_ids(prompt.messages, tokenizer)), ASK_SAMPLE, shard)


def follow_up_ask_job(job: Job, answer: Answer, tokenizer) -> Job:
    """The job in which the target writes a second user turn after `answer` (the answer of `job`), from one of
    FOLLOW_UP_STARTS, a function of the row and sample; its sample index is `ASK_SAMPLE - 1 - job.sample`,
    so that every answer's follow-up draws from a stream of its own."""
    start = FOLLOW_UP_STARTS[stream_id(0, job.prompt.row_id, job.sample) % len(FOLLOW_UP_STARTS)]
    messages = job.prompt.messages + [{"role": "assistant", "content": answer.text}, {"role": "user", "content": start}]
    prompt = replace(job.prompt, messages=messages, input_ids=samples.ask_prompt_ids(messages, tokenizer))
    return Job(prompt, ASK_SAMPLE - 1 - job.sample, job.shard, turn=2)


def follow_up_answer_job(ask: Job, prompt: Prompt) -> Job:
    """The job that answers the second user turn that `ask` (a `follow_up_ask_job`) wrote into `prompt`,
    at the first answer's sample index."""
    return Job(prompt, ASK_SAMPLE - 1 - ask.sample, ask.shard, turn=2)


def asked_prompt(prompt: Prompt, answer: Answer, tokenizer, max_length: int) -> Prompt | str:
    """The prompt whose last user turn is its start followed by what the target wrote (`answer` of its
    `ask_job`), rendered to be answered; or why it is dropped (ASKED_CUT, ASKED_EMPTY,
    BAD_PROMPT_TOO_LONG)."""
    if answer.cut:
        return ASKED_CUT
    if not answer.text.strip():
        return ASKED_EMPTY
    last = prompt.messages[-1]
    messages = prompt.messages[:-1] + [{**last, "content": last["content"] + answer.text}]
    input_ids = samples.prompt_token_ids(messages, tokenizer)
    if len(input_ids) >= max_length:
        return BAD_PROMPT_TOO_LONG
    return replace(prompt, messages=messages, input_ids=input_ids, asked=True)


@dataclass
class GreedyCheck:
    """One answer held against plain one-at-a-time greedy decoding of the same prompt."""
    equal: bool
    first_difference: int | None = None  # answer token index where they first differ
    gap: float | None = None  # target logit of the plain token minus the answer's there
    tolerance: float | None = None  # the largest gap that is a rounding near-tie (dflash eval's rule)

    @property
    def near_tie(self) -> bool:
        return self.gap is not None and abs(self.gap) <= self.tolerance


def check_greedy(target, prompt_ids: list[list[int]], answers: list[Answer], stops: list[int],
                 max_new_tokens: int) -> list[GreedyCheck]:
    """Each greedy answer against `greedy_generate` (batch 1, the KV cache of transformers); where
    they differ, the target's logit gap of the two tokens at the first difference (an answer
    that ended there stands for its most likely end token), so that a rounding near-tie is told
    apart from a wrong answer by `dflash eval`'s rule (`evaluation.tie_tolerance`)."""
    from dflash.model.modeling_dflash import greedy_generate
    from dflash.serve.evaluation import tie_tolerance

    device = target.get_input_embeddings().weight.device
    checks = []
    for ids, answer in zip(prompt_ids, answers):
        input_ids = torch.tensor([ids], device=device)
        plain = greedy_generate(target, input_ids, max_new_tokens, stops)  # its end token included
        plain_ended = plain[-1] in stops
        mine = answer.token_ids
        if (plain[:-1] if plain_ended else plain) == mine and plain_ended != answer.cut:
            checks.append(GreedyCheck(True))
            continue
        index = next((i for i, (a, b) in enumerate(zip(plain, mine)) if a != b), min(len(plain), len(mine)))
        with torch.inference_mode():
            context = torch.tensor([ids + plain[:index]], device=device)
            logits = target(input_ids=context, logits_to_keep=1).logits[0, -1]
        tolerance = tie_tolerance(logits)
        logits = logits.float()
        mine_token = mine[index] if index < len(mine) else max(stops, key=lambda stop: float(logits[stop]))
        plain_token = plain[index] if index < len(plain) else max(stops, key=lambda stop: float(logits[stop]))
        checks.append(GreedyCheck(False, index, float(logits[plain_token] - logits[mine_token]), tolerance))
    return checks


def describe_checks(checks: list[GreedyCheck]) -> str:
    equal = sum(check.equal for check in checks)
    ties = sum(check.near_tie for check in checks)
    wrong = len(checks) - equal - ties
    return (f"{equal} of {len(checks)} greedy answers equal plain one-at-a-time decoding, {ties} differ at a "
            f"near-tie of the target's top two tokens, {wrong} differ otherwise")
