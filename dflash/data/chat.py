"""Chat data rows: reading a source, parsing conversations, bad-row reasons, fingerprints.

Sources: a local `.jsonl`/`.jsonl.gz`/`.json`/`.parquet` file, a directory of such files
(all of them, recursively, in sorted path order), `embedded:code-chat` (offline rows from
`dflash.data.embedded`), or a `datasets` hub name (needs network). A row's id is its 0-based
position in the concatenated source.

Row formats: `{"messages": [{"role", "content"}, ...]}` (OpenAI/ChatML style; an assistant
turn may carry `reasoning_content`), ShareGPT `{"conversations": [{"from", "value"}, ...]}`
with from in human/gpt/system, or single-turn `prompt` + `response`, or `instruction`
(+ optional `input`) + `output`; single-turn rows may carry a `system` string.

Rows that cannot be used are counted per reason (the `BAD_*` constants; a JSON-lines line that
does not parse is one, `invalid_json`, with its line number) or, in strict mode, the first one
in source order raises `BadRowError` naming the row. Messages number rows from 1; row ids are
0-based indices internally (and in the store). Tokenizing the rows: `dflash.data.samples`.
"""

import gzip
import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from dflash.errors import DflashError

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


EMBEDDED_PREFIX = "embedded:"  # dflash.data.embedded.EMBEDDED_SOURCES


EMBEDDED_CODE_CHAT = "embedded:code-chat"


# Evaluation-only sources: hand-written prompts that no drafter may be trained on (`refuse_heldout`).
HELDOUT_SOURCES = ("embedded:chat-heldout", "embedded:mt-bench")


DATA_SUFFIXES = (".jsonl", ".jsonl.gz", ".json", ".parquet")


ROLES = ("system", "user", "assistant")


SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}


# Files up to this size are content-hashed for the cache key; larger ones by size and mtime only.
CONTENT_HASH_LIMIT = 64 << 20


def row_label(row_id: int) -> str:
    """How users see a row: its 1-based position in the source (row ids are 0-based indices)."""
    return f"row {row_id + 1}"


class BadRowError(DflashError, ValueError):
    """A row that cannot be used, raised in strict mode; names the row (1-based) and the reason."""

    def __init__(self, row_id: int, reason: str, detail: str = "", where: str = "", advice: str = ""):
        self.row_id, self.reason, self.detail, self.where, self.advice = row_id, reason, detail, where, advice
        super().__init__(f"{where or row_label(row_id)}: {reason}" + (f" ({detail})" if detail else "")
                         + (f"; {advice}" if advice else ""))

    def __reduce__(self):  # pool workers send these back; the default pickling loses the fields
        return BadRowError, (self.row_id, self.reason, self.detail, self.where, self.advice)

    def located(self, source: str, advice: str = "") -> "BadRowError":
        """The same error naming the file (and its row) of `source` that holds the row."""
        return BadRowError(self.row_id, self.reason, self.detail, row_place(source, self.row_id), advice)


class HeldoutSourceError(DflashError, ValueError):
    """A training or generation source that is an evaluation-only held-out set."""


def refuse_heldout(source: str, what: str) -> None:
    """Raise HeldoutSourceError when `source` (or one of several embedded ones joined by "+") is in
    HELDOUT_SOURCES: `what` (stage one's tokenizing, `dflash generate`) would train on the prompts that
    `dflash eval --prompts embedded:chat-heldout` measures on."""
    if not str(source).startswith(EMBEDDED_PREFIX):
        return
    names = {EMBEDDED_PREFIX + name.removeprefix(EMBEDDED_PREFIX) for name in str(source).split("+")}
    held = sorted(names.intersection(HELDOUT_SOURCES))
    if held:
        raise HeldoutSourceError(f"{what}: data source {source!r} includes {', '.join(held)}, the held-out "
                                 f"evaluation prompts; they are never trained on or generated from (read them with "
                                 f"`dflash eval --prompts {held[0]}`)")


class RowProblem(Exception):
    """Raised while parsing one row; carries a bad-row reason. The caller adds the row id."""

    def __init__(self, reason: str, detail: str = ""):
        self.reason, self.detail = reason, detail
        super().__init__(f"{reason}: {detail}")


def row_place(source: str, row_id: int) -> str:
    """Where a row is, as a user finds it: 'FILE row K' (K counted from 1 within that file) for a
    local file or directory source, else 'SOURCE row N'. Reads the files again: only for errors."""
    if os.path.exists(source):
        first = 0
        for path in list_source_files(source):
            count = sum(1 for _ in _read_file(path))
            if row_id < first + count:
                return f"{path} {row_label(row_id - first)}"
            first += count
    return f"{source} {row_label(row_id)}"


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
        from dflash.data.embedded import embedded_rows

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


def source_name(source: str) -> str:
    """A source's default name in a mix (`data.mix`'s `name`): its last path part without the data
    suffix, or the embedded name (`embedded:code-chat` -> `code-chat`, `/data/math.jsonl` -> `math`)."""
    name = source.removeprefix(EMBEDDED_PREFIX).rstrip("/").rsplit("/", 1)[-1]
    for suffix in DATA_SUFFIXES:
        if name.endswith(suffix):
            return name[:-len(suffix)]
    return name


def training_sources(data) -> list[tuple[str, str, float]]:
    """`(name, source, weight)` of every training source of a config's data section: data.mix's
    tables when set (data.source is then not read), else data.source alone with weight 1."""
    if not data.mix:
        return [(source_name(data.source), data.source, 1.0)]
    return [(item.name or source_name(item.source), item.source, item.weight) for item in data.mix]


def prompt_messages(row) -> list[dict]:
    """The conversation before the last assistant turn; a row with no answer (a `prompt` string,
    `turns` as in MT-Bench, or messages ending with the user, after earlier answers or not) is a
    prompt as a whole."""
    if isinstance(row, dict) and isinstance(row.get("prompt"), str) and "response" not in row:
        return [{"role": "user", "content": row["prompt"]}]
    if isinstance(row, dict) and isinstance(row.get("turns"), list) and row["turns"]:
        return [{"role": "user", "content": str(row["turns"][0])}]
    raw = (row.get("messages") or row.get("conversations")) if isinstance(row, dict) else None
    if isinstance(raw, list) and raw:
        messages = [parse_message(message, index) for index, message in enumerate(raw)]
        if messages[-1]["role"] == "user":  # the next turn is the answer to make
            if not messages[-1]["content"].strip():
                raise RowProblem(BAD_EMPTY, "the last user turn is empty")
            return messages
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


def hash_json(value) -> str:
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
        from dflash.data.embedded import embedded_rows

        return hash_json({"embedded": source, "rows": embedded_rows(source)})
    if os.path.exists(source):
        return hash_json({"files": [_file_fingerprint(p) for p in list_source_files(source)]})
    return hash_json({"hub": source, "split": split})


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
    return hash_json({"files": entries})

