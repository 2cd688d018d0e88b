"""Tokenized samples: chat rows rendered with the chat template, loss masks, bad-row
accounting, parallel tokenizing and the on-disk cache.

Loss mask: assistant tokens only, including the end-of-turn token that closes each
assistant turn. With a template that marks assistant turns by `{% generation %}` (ours,
`dflash.data.tokenizer.CHATML_TEMPLATE`) the mask is the template's generation mask. With a
checkpoint's own template without such marks, the assistant spans are derived by
rendering: a turn starts where `render(messages[:i], add_generation_prompt=True)` ends,
and ends after its (stripped) content plus the special token that follows it; see
`_assistant_spans_by_rendering`. Trailing turns after the last assistant turn are dropped:
nothing in them is supervised, so they would only cost stage-one compute. Reading and
parsing the rows: `dflash.data.chat`.
"""

import json
import multiprocessing
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from dflash.data.chat import (BAD_OVERLONG, BAD_TOO_FEW_SUPERVISED, BadRowError, RowProblem, hash_json, read_rows,
                              refuse_heldout, row_label, row_to_messages, source_fingerprint)
from dflash.errors import DflashError
from dflash.interrupts import children_ignore_interrupts
from dflash.outputs import atomic_file

# Bump whenever tokenization output could change for the same inputs (invalidates caches).
TOKENIZE_VERSION = 2  # 2: truncated samples are counted


OVERLONG_POLICIES = ("truncate", "drop")


MAX_EXAMPLES = 5


CHUNK_ROWS = 64


@dataclass
class Sample:
    row_id: int
    input_ids: np.ndarray  # (T,) int32
    loss_mask: np.ndarray  # (T,) uint8, 1 on supervised (assistant) tokens
    truncated: bool = False  # cut at max_length

    def __len__(self) -> int:
        return len(self.input_ids)


class NoSamplesError(DflashError, ValueError):
    """No row of a source gave a usable sample; the message names the source and why rows were dropped."""


def require_samples(data: "TokenizedData", source: str) -> None:
    """Refuse a source none of whose rows survived (stage one writes no store without samples)."""
    if data.samples:
        return
    if not data.num_rows:
        raise NoSamplesError(f"data.source {source}: no rows read; point data.source at a file, directory or "
                             f"dataset that holds conversations")
    reasons = "; ".join(f"{count} {reason} (e.g. {row_label(data.examples.get(reason, [0])[0])})"
                        for reason, count in sorted(data.bad_rows.items(), key=lambda item: -item[1]))
    raise NoSamplesError(f"data.source {source}: all {data.num_rows} rows are bad ({reasons}); nothing was "
                         f"written. Fix the rows (data.strict=true stops at the first one and names its file), "
                         f"or the settings that drop them (data.max_length, data.overlong, drafter.block_size)")


@dataclass
class TokenizedData:
    samples: list[Sample]
    bad_rows: dict[str, int] = field(default_factory=dict)  # reason -> count
    examples: dict[str, list[int]] = field(default_factory=dict)  # reason -> first few row ids
    num_rows: int = 0  # rows read, good and bad

    @property
    def num_truncated(self) -> int:
        """Kept samples cut at max_length."""
        return sum(sample.truncated for sample in self.samples)

    @property
    def num_tokens(self) -> int:
        return sum(len(sample) for sample in self.samples)


def prompt_token_ids(messages: list[dict], tokenizer) -> list[int]:
    """The conversation before the answer, rendered with the chat template and its generation
    prompt: what the target reads before it answers (`dflash eval`'s and `dflash generate`'s prompts)."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


_ASK_MARK = "\u2063dflash-ask\u2063"  # invisible separators: no prompt holds it


def ask_prompt_ids(messages: list[dict], tokenizer) -> list[int]:
    """A conversation ending with a user turn, rendered with the chat template up to the end of
    that turn's text, without its end-of-turn: what the target continues to write the rest of
    the turn (`dflash generate --ask-temperature`; the turn's text is the start it was given)."""
    if not messages or messages[-1]["role"] != "user":
        raise ValueError("a prompt to continue must end with a user turn")
    marked = messages[:-1] + [{**messages[-1], "content": messages[-1]["content"] + _ASK_MARK}]
    text = tokenizer.apply_chat_template(marked, tokenize=False)
    if _ASK_MARK not in text:
        raise ValueError("the chat template does not render the user turn's text as given")
    return tokenizer(text[:text.index(_ASK_MARK)], add_special_tokens=False)["input_ids"]


_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


def template_marks_generation(tokenizer) -> bool:
    """Whether the tokenizer's chat template wraps assistant turns in {% generation %}."""
    if not tokenizer.chat_template:
        raise ValueError(f"tokenizer {tokenizer.name_or_path} has no chat template")
    return bool(_GENERATION_TAG.search(tokenizer.chat_template))


def _assistant_spans_by_rendering(messages: list[dict], tokenizer, full_text: str) -> list[tuple[int, int]]:
    """Character spans of assistant turns in `full_text`, for templates without {% generation %}.

    A turn starts where the prefix rendering with a generation prompt ends (so whatever the
    template emits for the model, e.g. an empty <think> block, is supervised), and ends after
    the turn's stripped content plus the special token that directly follows it (the
    end-of-turn token). Templates that render earlier turns differently once later turns
    exist (Qwen3 drops old <think> blocks) still work, because only the prefix must be stable.
    """
    specials = sorted((t for t in tokenizer.all_special_tokens if t), key=len, reverse=True)
    end_token = re.compile(r"\s*(?:" + "|".join(map(re.escape, specials)) + ")") if specials else None
    spans = []
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = tokenizer.apply_chat_template(messages[:index], tokenize=False, add_generation_prompt=True)
        if not full_text.startswith(before):
            raise ValueError("chat template renders a conversation prefix differently from the whole conversation")
        body = message["content"].strip()
        body_start = full_text.find(body, len(before))
        if body_start < 0:
            raise ValueError(f"assistant content of message {index} not found in the rendered conversation")
        end = body_start + len(body)
        closing = end_token.match(full_text, end) if end_token else None
        spans.append((len(before), closing.end() if closing else end))
    return spans


def _mask_by_rendering(messages: list[dict], tokenizer) -> tuple[list[int], list[int]]:
    full_text = tokenizer.apply_chat_template(messages, tokenize=False)
    spans = _assistant_spans_by_rendering(messages, tokenizer, full_text)
    encoded = tokenizer(full_text, add_special_tokens=False, return_offsets_mapping=True)
    mask = [
        int(any(start < span_end and end > span_start for span_start, span_end in spans))
        for start, end in encoded["offset_mapping"]
    ]
    return encoded["input_ids"], mask


def tokenize_messages(messages: list[dict], tokenizer, marks_generation: bool) -> tuple[np.ndarray, np.ndarray]:
    """`(input_ids int32, loss_mask uint8)` of one conversation; see the module docstring for the mask."""
    if marks_generation:
        encoded = tokenizer.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        input_ids, mask = encoded["input_ids"], encoded["assistant_masks"]
    else:
        input_ids, mask = _mask_by_rendering(messages, tokenizer)
    return np.asarray(input_ids, dtype=np.int32), np.asarray(mask, dtype=np.uint8)


@dataclass(frozen=True)
class TokenizeSettings:
    max_length: int
    overlong: str
    min_supervised: int


def tokenize_row(row_id: int, row, tokenizer, settings: TokenizeSettings, marks_generation: bool) -> Sample:
    """One row as a Sample; raises BadRowError for unusable rows."""
    try:
        messages = row_to_messages(row)
    except RowProblem as problem:
        raise BadRowError(row_id, problem.reason, problem.detail) from None
    try:
        input_ids, loss_mask = tokenize_messages(messages, tokenizer, marks_generation)
    except Exception as error:
        raise RuntimeError(f"{row_label(row_id)}: tokenization failed: {error}") from error
    truncated = len(input_ids) > settings.max_length
    if truncated:
        if settings.overlong == "drop":
            raise BadRowError(row_id, BAD_OVERLONG, f"{len(input_ids)} > {settings.max_length} tokens")
        input_ids, loss_mask = input_ids[: settings.max_length], loss_mask[: settings.max_length]
    supervised = int(loss_mask.sum())
    if supervised < settings.min_supervised:
        raise BadRowError(row_id, BAD_TOO_FEW_SUPERVISED, f"{supervised} < {settings.min_supervised}")
    return Sample(row_id, input_ids, loss_mask, truncated)


# Per-process state of pool workers, set once by _init_worker (fork start: nothing is pickled).
_WORKER: dict = {}


def _init_worker(tokenizer, settings: TokenizeSettings, marks_generation: bool) -> None:
    _WORKER.update(tokenizer=tokenizer, settings=settings, marks_generation=marks_generation)


def _tokenize_chunk(chunk: list[tuple[int, dict]]) -> list[Sample | BadRowError]:
    results = []
    for row_id, row in chunk:
        try:
            sample = tokenize_row(row_id, row, _WORKER["tokenizer"], _WORKER["settings"], _WORKER["marks_generation"])
            results.append(sample)
        except BadRowError as bad:
            results.append(bad)
    return results


def _chunks(rows: Iterable[tuple[int, dict]], size: int) -> Iterator[list[tuple[int, dict]]]:
    chunk = []
    for item in rows:
        chunk.append(item)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _tokenize_all(rows, tokenizer, settings: TokenizeSettings, num_workers: int) -> Iterator[Sample | BadRowError]:
    """Results in row order, in-process or over a pool of `num_workers` processes."""
    args = (tokenizer, settings, template_marks_generation(tokenizer))
    if num_workers <= 1:
        _init_worker(*args)
        for chunk in _chunks(rows, CHUNK_ROWS):
            yield from _tokenize_chunk(chunk)
        return
    # The parent may have used the tokenizer's thread pool; after fork the Rust library would
    # warn and disable it per worker. Workers are single rows at a time anyway.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    methods = multiprocessing.get_all_start_methods()
    context = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
    with children_ignore_interrupts():  # Ctrl-C: leaving the `with` terminates the pool, without tracebacks
        pool = context.Pool(num_workers, initializer=_init_worker, initargs=args)
    with pool:
        for results in pool.imap(_tokenize_chunk, _chunks(rows, CHUNK_ROWS)):
            yield from results


def _collect(results: Iterable[Sample | BadRowError], strict: bool) -> TokenizedData:
    data = TokenizedData(samples=[])
    for result in results:
        data.num_rows += 1
        if isinstance(result, Sample):
            data.samples.append(result)
            continue
        if strict:
            raise result
        data.bad_rows[result.reason] = data.bad_rows.get(result.reason, 0) + 1
        examples = data.examples.setdefault(result.reason, [])
        if len(examples) < MAX_EXAMPLES:
            examples.append(result.row_id)
    return data


def _save_cache(path: Path, data: TokenizedData) -> None:
    """Write the tokenized data as one .npz (no pickles), atomically."""
    lengths = np.array([len(s) for s in data.samples], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    meta = {"bad_rows": data.bad_rows, "examples": data.examples, "num_rows": data.num_rows}
    with atomic_file(path) as partial, open(partial, "wb") as handle:
        np.savez(
            handle,
            input_ids=np.concatenate([s.input_ids for s in data.samples] or [np.zeros(0, np.int32)]),
            loss_mask=np.concatenate([s.loss_mask for s in data.samples] or [np.zeros(0, np.uint8)]),
            offsets=offsets,
            row_ids=np.array([s.row_id for s in data.samples], dtype=np.int64),
            truncated=np.array([s.truncated for s in data.samples], dtype=bool),
            meta=np.array(json.dumps(meta)),
        )


def _load_cache(path: Path) -> TokenizedData:
    with np.load(path, allow_pickle=False) as arrays:
        input_ids, loss_mask, offsets = arrays["input_ids"], arrays["loss_mask"], arrays["offsets"]
        row_ids, meta, truncated = arrays["row_ids"], json.loads(str(arrays["meta"])), arrays["truncated"]
    samples = [
        Sample(int(row_id), input_ids[start:end], loss_mask[start:end], bool(cut))
        for row_id, start, end, cut in zip(row_ids, offsets[:-1], offsets[1:], truncated)
    ]
    return TokenizedData(samples, meta["bad_rows"], meta["examples"], meta["num_rows"])


def _raise_first_bad_row(data: TokenizedData) -> None:
    """Strict mode on a cached result: raise for the earliest recorded bad row."""
    if data.examples:
        reason, row_ids = min(data.examples.items(), key=lambda item: item[1][0])
        raise BadRowError(row_ids[0], reason, "recorded in the tokenization cache")


def _cache_path(cache_dir, rows: str | Path | list, split: str, tokenizer, settings: TokenizeSettings) -> Path:
    """The cache file for these inputs: source fingerprint, tokenizer identity, settings, code version."""
    from dflash.data.tokenizer import tokenizer_identity

    if isinstance(rows, (str, Path)):
        fingerprint = source_fingerprint(str(rows), split)
    else:
        fingerprint = hash_json({"rows": rows})
    key = hash_json(
        {
            "source": fingerprint,
            "tokenizer": tokenizer_identity(tokenizer)["hash"],
            "settings": [settings.max_length, settings.overlong, settings.min_supervised],
            "version": TOKENIZE_VERSION,
        }
    )
    return Path(cache_dir) / f"tokenized-{key[:32]}.npz"


def tokenize_rows(
    rows: str | Iterable[tuple[int, dict]],
    tokenizer,
    max_length: int,
    overlong: str = "truncate",
    min_supervised: int = 1,
    strict: bool = False,
    num_workers: int = 1,
    cache_dir: str | Path | None = None,
    split: str = "train",
) -> TokenizedData:
    """Tokenize a source (a string, read with `read_rows(rows, split)`) or `(row_id, row)` pairs.

    Rows longer than `max_length` are truncated or, with overlong="drop", counted as bad.
    With `cache_dir`, the result is stored under a key that covers the source's content
    fingerprint (for a source string: file paths, sizes, mtimes and content hashes; for
    row pairs: a hash of the rows themselves), the tokenizer identity, max_length, overlong,
    min_supervised and TOKENIZE_VERSION; any change re-tokenizes. An evaluation-only source
    (`chat.HELDOUT_SOURCES`) is refused.
    """
    if isinstance(rows, (str, Path)):
        refuse_heldout(str(rows), "tokenizing for training")
    if overlong not in OVERLONG_POLICIES:
        raise ValueError(f"overlong must be one of {OVERLONG_POLICIES}, got {overlong!r}")
    if max_length < 1:
        raise ValueError(f"max_length must be positive, got {max_length}")
    settings = TokenizeSettings(max_length, overlong, min_supervised)
    cache_path = None
    if cache_dir is not None:
        if not isinstance(rows, (str, Path)):
            rows = list(rows)  # hashed for the key, then tokenized
        cache_path = _cache_path(cache_dir, rows, split, tokenizer, settings)
        if cache_path.exists():
            data = _load_cache(cache_path)
            if strict:
                _raise_first_bad_row(data)
            return data
    pairs = read_rows(str(rows), split) if isinstance(rows, (str, Path)) else rows
    results = _tokenize_all(pairs, tokenizer, settings, num_workers)
    try:
        data = _collect(results, strict)
    finally:
        results.close()  # a strict-mode raise stops the worker pool now, not at garbage collection
    if cache_path is not None:
        _save_cache(cache_path, data)
    return data

