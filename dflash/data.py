"""Chat data: reading rows, parsing conversations, tokenizing with loss masks, bad-row accounting, caching.

Sources: a local `.jsonl`/`.jsonl.gz`/`.json`/`.parquet` file, a directory of such files
(all of them, recursively, in sorted path order), `embedded:code-chat` (offline rows from
`dflash.embedded`), or a `datasets` hub name (needs network). A row's id is its 0-based
position in the concatenated source.

Row formats: `{"messages": [{"role", "content"}, ...]}` (OpenAI/ChatML style; an assistant
turn may carry `reasoning_content`), ShareGPT `{"conversations": [{"from", "value"}, ...]}`
with from in human/gpt/system, or single-turn `prompt` + `response`, or `instruction`
(+ optional `input`) + `output`; single-turn rows may carry a `system` string.

Loss mask: assistant tokens only, including the end-of-turn token that closes each
assistant turn. With a template that marks assistant turns by `{% generation %}` (ours,
`dflash.tokenizer.CHATML_TEMPLATE`) the mask is the template's generation mask. With a
checkpoint's own template without such marks, the assistant spans are derived by
rendering: a turn starts where `render(messages[:i], add_generation_prompt=True)` ends,
and ends after its (stripped) content plus the special token that follows it; see
`_assistant_spans_by_rendering`.

Rows that cannot be used are counted per reason (the `BAD_*` constants; a JSON-lines line that
does not parse is one, `invalid_json`, with its line number) or, with `strict=True`, the first
one in source order raises `BadRowError` naming the row. Messages number rows from 1; row ids
are 0-based indices internally (and in the store). Trailing turns after the last assistant
turn are dropped: nothing in them is supervised, so they would only cost stage-one compute.
"""

import gzip
import hashlib
import json
import multiprocessing
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from dflash.errors import DflashError
from dflash.outputs import atomic_file

# Bad-row reasons (the keys of TokenizedData.bad_rows).
BAD_MISSING_FIELDS = "missing_fields"  # no recognised row format, or a message without role/content
BAD_EMPTY = "empty"  # no messages, or no assistant turn with any content
BAD_NO_ASSISTANT_TURN = "no_assistant_turn"  # messages, but none from the assistant
BAD_TOO_FEW_SUPERVISED = "too_few_supervised"  # fewer than min_supervised supervised tokens after truncation
BAD_OVERLONG = "overlong"  # longer than max_length, with overlong="drop"
BAD_ROLE = "bad_role"  # a role outside system/user/assistant (after ShareGPT mapping)
BAD_INVALID_JSON = "invalid_json"  # a JSON-lines line that does not parse
BAD_ROW_REASONS = (
    BAD_INVALID_JSON,
    BAD_MISSING_FIELDS,
    BAD_EMPTY,
    BAD_NO_ASSISTANT_TURN,
    BAD_TOO_FEW_SUPERVISED,
    BAD_OVERLONG,
    BAD_ROLE,
)

# Bump whenever tokenization output could change for the same inputs (invalidates caches).
TOKENIZE_VERSION = 2  # 2: truncated samples are counted
EMBEDDED_PREFIX = "embedded:"  # dflash.embedded.EMBEDDED_SOURCES
EMBEDDED_CODE_CHAT = "embedded:code-chat"
DATA_SUFFIXES = (".jsonl", ".jsonl.gz", ".json", ".parquet")
ROLES = ("system", "user", "assistant")
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
OVERLONG_POLICIES = ("truncate", "drop")
# Files up to this size are content-hashed for the cache key; larger ones by size and mtime only.
CONTENT_HASH_LIMIT = 64 << 20
MAX_EXAMPLES = 5
CHUNK_ROWS = 64


def row_label(row_id: int) -> str:
    """How users see a row: its 1-based position in the source (row ids are 0-based indices)."""
    return f"row {row_id + 1}"


class BadRowError(DflashError, ValueError):
    """A row that cannot be used, raised in strict mode; names the row (1-based) and the reason."""

    def __init__(self, row_id: int, reason: str, detail: str = ""):
        self.row_id, self.reason, self.detail = row_id, reason, detail
        super().__init__(f"{row_label(row_id)}: {reason}" + (f" ({detail})" if detail else ""))

    def __reduce__(self):  # pool workers send these back; the default pickling loses the fields
        return BadRowError, (self.row_id, self.reason, self.detail)


class RowProblem(Exception):
    """Raised while parsing one row; carries a bad-row reason. The caller adds the row id."""

    def __init__(self, reason: str, detail: str = ""):
        self.reason, self.detail = reason, detail
        super().__init__(f"{reason}: {detail}")


@dataclass
class Sample:
    row_id: int
    input_ids: np.ndarray  # (T,) int32
    loss_mask: np.ndarray  # (T,) uint8, 1 on supervised (assistant) tokens
    truncated: bool = False  # cut at max_length

    def __len__(self) -> int:
        return len(self.input_ids)


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


# ----------------------------------------------------------------------------- reading


def list_source_files(source: str | Path) -> list[Path]:
    """The data files of a local file or directory source, in sorted path order."""
    path = Path(source)
    if path.is_file():
        return [path]
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.name.endswith(DATA_SUFFIXES))
    if not files:
        raise FileNotFoundError(f"no {'/'.join(DATA_SUFFIXES)} files under {path}")
    return files


@dataclass(frozen=True)
class InvalidLine:
    """A JSON-lines line that does not parse: it takes a row's place and becomes a bad row."""

    path: str
    line_number: int  # 1-based
    error: str


def _read_json_lines(path: Path, text: str) -> Iterator[dict | InvalidLine]:
    for line_number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            yield json.loads(line)
        except json.JSONDecodeError as error:
            yield InvalidLine(str(path), line_number, str(error))


def _read_file(path: Path) -> Iterator[dict]:
    """Rows of one file. A `.json` file holds a list of rows, or JSON lines."""
    if path.name.endswith(".parquet"):
        import pyarrow.parquet as pq

        for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
            yield from batch.to_pylist()
        return
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as handle:
        text = handle.read()
    if path.name.endswith(".json") and text.lstrip().startswith("["):
        rows = json.loads(text)
        yield from rows
        return
    yield from _read_json_lines(path, text)


def read_rows(source: str, split: str = "train") -> Iterator[tuple[int, dict]]:
    """Yield `(row_id, row)` over a source; `split` only applies to hub datasets."""
    if source.startswith(EMBEDDED_PREFIX):
        from dflash.embedded import embedded_rows

        yield from enumerate(embedded_rows(source))
        return
    if os.path.exists(source):
        row_id = 0
        for path in list_source_files(source):
            for row in _read_file(path):
                yield row_id, row
                row_id += 1
        return
    if source.startswith((".", "/", "~")) or source.endswith(DATA_SUFFIXES):
        raise FileNotFoundError(f"data source {source} does not exist")
    import datasets

    yield from enumerate(datasets.load_dataset(source, split=split))


# ----------------------------------------------------------------------------- parsing


def prompt_messages(row) -> list[dict]:
    """The conversation before the last assistant turn; a row with no answer (a `prompt` string,
    `turns` as in MT-Bench, or messages ending with the user) is a prompt as a whole."""
    if isinstance(row, dict) and isinstance(row.get("prompt"), str) and "response" not in row:
        return [{"role": "user", "content": row["prompt"]}]
    if isinstance(row, dict) and isinstance(row.get("turns"), list) and row["turns"]:
        return [{"role": "user", "content": str(row["turns"][0])}]
    try:
        messages = row_to_messages(row)
    except RowProblem as problem:
        if problem.reason != BAD_NO_ASSISTANT_TURN:
            raise
        raw = row.get("messages") or row.get("conversations")
        return [parse_message(message, index) for index, message in enumerate(raw)]
    last = max(i for i, message in enumerate(messages) if message["role"] == "assistant")
    if last == 0:
        raise RowProblem(BAD_EMPTY, "the first turn is the assistant's: no prompt")
    return messages[:last]


def prompt_token_ids(messages: list[dict], tokenizer) -> list[int]:
    """The conversation before the answer, rendered with the chat template and its generation
    prompt: what the target reads before it answers (`dflash eval`'s and `dflash generate`'s prompts)."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _message_text(value, what: str) -> str:
    """Message content as a string; a list of OpenAI-style text parts is joined."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in value):
        return "".join(str(p.get("text", "")) for p in value)
    raise RowProblem(BAD_MISSING_FIELDS, f"{what} has no text content")


def parse_message(message, index: int) -> dict:
    if not isinstance(message, dict):
        raise RowProblem(BAD_MISSING_FIELDS, f"message {index} is not an object")
    if "from" in message and "value" in message:  # ShareGPT
        speaker = message["from"]
        if speaker not in SHAREGPT_ROLES:
            raise RowProblem(BAD_ROLE, f"message {index} from {speaker!r}")
        return {"role": SHAREGPT_ROLES[speaker], "content": _message_text(message["value"], f"message {index}")}
    if message.get("role") is None or message.get("content") is None:
        raise RowProblem(BAD_MISSING_FIELDS, f"message {index} lacks role or content")
    if message["role"] not in ROLES:
        raise RowProblem(BAD_ROLE, f"message {index} has role {message['role']!r}")
    parsed = {"role": message["role"], "content": _message_text(message["content"], f"message {index}")}
    if message["role"] == "assistant" and isinstance(message.get("reasoning_content"), str):
        parsed["reasoning_content"] = message["reasoning_content"]
    return parsed


def _single_turn_messages(row: dict) -> list[dict] | None:
    """prompt/response or instruction(+input)/output rows as messages; None if neither form."""
    if isinstance(row.get("prompt"), str) and isinstance(row.get("response"), str):
        prompt, answer = row["prompt"], row["response"]
    elif isinstance(row.get("instruction"), str) and isinstance(row.get("output"), str):
        extra = row.get("input")
        prompt = row["instruction"] + (f"\n\n{extra}" if isinstance(extra, str) and extra.strip() else "")
        answer = row["output"]
    else:
        return None
    system = [{"role": "system", "content": row["system"]}] if isinstance(row.get("system"), str) else []
    return system + [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]


def row_to_messages(row) -> list[dict]:
    """The conversation of one row, validated; raises RowProblem with a bad-row reason."""
    if isinstance(row, InvalidLine):
        raise RowProblem(BAD_INVALID_JSON, f"line {row.line_number} of {row.path}: {row.error}")
    if not isinstance(row, dict):
        raise RowProblem(BAD_MISSING_FIELDS, "row is not an object")
    raw = row.get("messages") if row.get("messages") is not None else row.get("conversations")
    if raw is not None:
        if not isinstance(raw, list):
            raise RowProblem(BAD_MISSING_FIELDS, "messages is not a list")
        messages = [parse_message(message, index) for index, message in enumerate(raw)]
    else:
        messages = _single_turn_messages(row)
        if messages is None:
            raise RowProblem(BAD_MISSING_FIELDS, f"no messages/conversations/prompt+response in keys {sorted(row)}")
    if not any(m["content"].strip() for m in messages):
        raise RowProblem(BAD_EMPTY, "no message has content")
    assistant_ids = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not assistant_ids:
        raise RowProblem(BAD_NO_ASSISTANT_TURN)
    if not any(messages[i]["content"].strip() or messages[i].get("reasoning_content") for i in assistant_ids):
        raise RowProblem(BAD_EMPTY, "every assistant turn is empty")
    return messages[: assistant_ids[-1] + 1]


# ----------------------------------------------------------------------------- tokenizing

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
    with context.Pool(num_workers, initializer=_init_worker, initargs=args) as pool:
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


# ----------------------------------------------------------------------------- cache


def _hash_json(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, ensure_ascii=False, default=str).encode()).hexdigest()


def _file_fingerprint(path: Path) -> dict:
    stat = path.stat()
    entry = {"path": str(path.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    # mtime alone misses rewrites within the clock's resolution; content settles it for small files.
    if stat.st_size <= CONTENT_HASH_LIMIT:
        entry["sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
    return entry


def source_fingerprint(source: str, split: str = "train") -> str:
    """A hash that changes when the source's content changes (as far as can be told offline)."""
    if source.startswith(EMBEDDED_PREFIX):
        from dflash.embedded import embedded_rows

        return _hash_json({"embedded": source, "rows": embedded_rows(source)})
    if os.path.exists(source):
        return _hash_json({"files": [_file_fingerprint(p) for p in list_source_files(source)]})
    return _hash_json({"hub": source, "split": split})


def content_fingerprint(source: str, split: str = "train") -> str:
    """A hash of what a source holds, independent of where it lies: embedded rows, or each
    file's name relative to the source, size and content (files over CONTENT_HASH_LIMIT: their
    first and last MiB), or a hub name and split. A moved or copied dataset keeps its hash."""
    if source.startswith(EMBEDDED_PREFIX) or not os.path.exists(source):
        return source_fingerprint(source, split)
    root = Path(source) if Path(source).is_dir() else Path(source).parent
    entries = []
    for path in list_source_files(source):
        size = path.stat().st_size
        digest = hashlib.sha256()
        with open(path, "rb") as handle:
            if size <= CONTENT_HASH_LIMIT:
                digest.update(handle.read())
            else:
                digest.update(handle.read(1 << 20))
                handle.seek(size - (1 << 20))
                digest.update(handle.read())
        entries.append({"name": str(path.relative_to(root)), "size": size, "sha256": digest.hexdigest()})
    return _hash_json({"files": entries})


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
    from dflash.tokenizer import tokenizer_identity

    if isinstance(rows, (str, Path)):
        fingerprint = source_fingerprint(str(rows), split)
    else:
        fingerprint = _hash_json({"rows": rows})
    key = _hash_json(
        {
            "source": fingerprint,
            "tokenizer": tokenizer_identity(tokenizer)["hash"],
            "settings": [settings.max_length, settings.overlong, settings.min_supervised],
            "version": TOKENIZE_VERSION,
        }
    )
    return Path(cache_dir) / f"tokenized-{key[:32]}.npz"


# ----------------------------------------------------------------------------- entry point


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
    min_supervised and TOKENIZE_VERSION; any change re-tokenizes.
    """
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
