"""Reading rows, chat parsing, loss masks, bad-row accounting, truncation, parallelism and the cache."""

import copy
import json
import re

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dflash.data import chat, samples
from dflash.data.chat import BadRowError, read_rows
from dflash.data.samples import tokenize_rows
from dflash.data.tokenizer import CHATML_TEMPLATE


def conversation(user: str, answer: str, system: str | None = None) -> dict:
    messages = [{"role": "system", "content": system}] if system else []
    return {"messages": messages + [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]}


LONG_ANSWER = " ".join(f"word{i}" for i in range(300))
GOOD = conversation("What is the capital of France?", "The capital of France is Paris, a city on the Seine.")
# One row per bad-row reason, in the order they appear in BAD_ROWS.
BAD_ROWS = {
    chat.BAD_INVALID_JSON: chat.InvalidLine("rows.jsonl", 2, "Expecting value: line 1 column 1 (char 0)"),
    chat.BAD_MISSING_FIELDS: {"text": "just text, no conversation"},
    chat.BAD_EMPTY: {"messages": []},
    chat.BAD_NO_ASSISTANT_TURN: {"messages": [{"role": "user", "content": "anyone there?"}]},
    chat.BAD_TOO_FEW_SUPERVISED: conversation("Say ok.", "ok"),
    chat.BAD_ROLE: {"messages": [{"role": "tool", "content": "42"}, {"role": "assistant", "content": "It is 42."}]},
}


def tokenize(rows, tokenizer, **kwargs):
    settings = {"max_length": 64, "overlong": "truncate", "min_supervised": 4, "strict": False, "num_workers": 1}
    return tokenize_rows(list(enumerate(rows)) if isinstance(rows, list) else rows, tokenizer, **{**settings, **kwargs})


def test_loss_mask_covers_assistant_tokens_and_their_end(qwen_tokenizer):
    row = conversation("Hi", "Hello there!", system="Be brief.")
    row["messages"] += [{"role": "user", "content": "Bye"}, {"role": "assistant", "content": "Bye."}]
    (sample,) = tokenize([row], qwen_tokenizer).samples
    assert sample.input_ids.dtype == np.int32 and sample.loss_mask.dtype == np.uint8
    supervised = qwen_tokenizer.decode(sample.input_ids[sample.loss_mask == 1])
    assert supervised == "Hello there!<|im_end|>Bye.<|im_end|>"
    unsupervised = qwen_tokenizer.decode(sample.input_ids[sample.loss_mask == 0])
    assert "Be brief." in unsupervised and "Hi" in unsupervised and "Bye<|im_end|>" in unsupervised


def test_rendering_path_matches_generation_mask(qwen_tokenizer):
    """A template without {% generation %} (like a checkpoint's own) gives the same masks."""
    plain = copy.copy(qwen_tokenizer)
    plain.chat_template = re.sub(r"\{%-?\s*(end)?generation\s*-?%\}", "", CHATML_TEMPLATE)
    assert not samples.template_marks_generation(plain)
    reasoning = conversation("2+2?", "  4  ")
    reasoning["messages"][-1]["reasoning_content"] = "two and two"
    rows = [conversation("Hi", "\nHello there!  ", system="Be brief."), reasoning, GOOD]
    rows[0]["messages"] += [{"role": "user", "content": "more"}, {"role": "assistant", "content": "Sure: more."}]
    expected = tokenize(rows, qwen_tokenizer, min_supervised=1).samples
    derived = tokenize(rows, plain, min_supervised=1).samples
    for left, right in zip(expected, derived, strict=True):
        assert np.array_equal(left.input_ids, right.input_ids)
        assert np.array_equal(left.loss_mask, right.loss_mask)


def test_every_bad_row_reason_is_counted(qwen_tokenizer):
    rows = [GOOD] + list(BAD_ROWS.values()) + [conversation("Tell me a story.", LONG_ANSWER), GOOD]
    result = tokenize(rows, qwen_tokenizer, overlong="drop")
    assert result.num_rows == len(rows)
    assert [s.row_id for s in result.samples] == [0, len(rows) - 1]
    expected = {reason: 1 for reason in BAD_ROWS} | {chat.BAD_OVERLONG: 1}
    assert result.bad_rows == expected
    assert set(expected) == set(chat.BAD_ROW_REASONS)
    assert result.examples[chat.BAD_ROLE] == [1 + list(BAD_ROWS).index(chat.BAD_ROLE)]
    assert result.examples[chat.BAD_OVERLONG] == [len(rows) - 2]


@pytest.mark.parametrize(
    "row,reason",
    [
        ({"messages": [{"role": "user"}, {"role": "assistant", "content": "x"}]}, chat.BAD_MISSING_FIELDS),
        ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "   "}]}, chat.BAD_EMPTY),
        ({"conversations": [{"from": "bing", "value": "hi"}, {"from": "gpt", "value": "hello"}]}, chat.BAD_ROLE),
        ({"prompt": "only a prompt"}, chat.BAD_MISSING_FIELDS),
    ],
)
def test_more_bad_rows(qwen_tokenizer, row, reason):
    assert tokenize([GOOD, row], qwen_tokenizer).bad_rows == {reason: 1}


def test_strict_mode_names_the_row(qwen_tokenizer):
    rows = [GOOD, GOOD, BAD_ROWS[chat.BAD_NO_ASSISTANT_TURN], BAD_ROWS[chat.BAD_EMPTY]]
    with pytest.raises(BadRowError, match=r"row 3: no_assistant_turn") as caught:  # rows count from 1
        tokenize(rows, qwen_tokenizer, strict=True)
    assert (caught.value.row_id, caught.value.reason) == (2, chat.BAD_NO_ASSISTANT_TURN)


def test_truncate_versus_drop(qwen_tokenizer):
    rows = [conversation("Tell me a story.", LONG_ANSWER)]
    (sample,) = tokenize(rows, qwen_tokenizer, max_length=32).samples
    (full,) = tokenize(rows, qwen_tokenizer, max_length=4096).samples
    assert len(sample) == 32 and len(full) > 32
    assert np.array_equal(sample.input_ids, full.input_ids[:32])
    assert np.array_equal(sample.loss_mask, full.loss_mask[:32])
    dropped = tokenize(rows, qwen_tokenizer, max_length=32, overlong="drop")
    assert dropped.samples == [] and dropped.bad_rows == {chat.BAD_OVERLONG: 1}
    # Truncation that cuts away the supervised tokens makes the row too_few_supervised.
    cut = tokenize(rows, qwen_tokenizer, max_length=12, min_supervised=4)
    assert cut.bad_rows == {chat.BAD_TOO_FEW_SUPERVISED: 1}


def test_row_formats_give_the_same_tokens(qwen_tokenizer):
    system, prompt, answer = "You are helpful.", "Add 2 and 3.", "2 + 3 = 5."
    rows = [
        conversation(prompt, answer, system=system),
        {
            "conversations": [
                {"from": "system", "value": system},
                {"from": "human", "value": prompt},
                {"from": "gpt", "value": answer},
            ]
        },
        {"system": system, "prompt": prompt, "response": answer},
        {"system": system, "instruction": "Add 2 and 3.", "input": "", "output": answer},
    ]
    samples = tokenize(rows, qwen_tokenizer, min_supervised=1).samples
    assert len(samples) == 4
    for sample in samples[1:]:
        assert np.array_equal(sample.input_ids, samples[0].input_ids)
        assert np.array_equal(sample.loss_mask, samples[0].loss_mask)
    instruction_row = {"instruction": "Add:", "input": "2 and 3", "output": answer}
    with_input = tokenize([instruction_row], qwen_tokenizer, min_supervised=1)
    assert "Add:\n\n2 and 3" in qwen_tokenizer.decode(with_input.samples[0].input_ids)


def write_files(directory, rows):
    """rows[0:2] -> a.jsonl, rows[2:4] -> b.json (a list), rows[4:] -> c/d.parquet."""
    (directory / "a.jsonl").write_text("".join(json.dumps(r) + "\n\n" for r in rows[:2]))
    (directory / "b.json").write_text(json.dumps(rows[2:4]))
    (directory / "c").mkdir()
    pq.write_table(pa.Table.from_pylist(rows[4:]), directory / "c" / "d.parquet")


def test_file_formats_and_directory_order(tmp_path):
    rows = [conversation(f"question {i}", f"answer {i}") for i in range(6)]
    write_files(tmp_path, rows)
    assert list(read_rows(str(tmp_path))) == list(enumerate(rows))
    assert [r for _, r in read_rows(str(tmp_path / "c" / "d.parquet"))] == rows[4:]
    lines_json = tmp_path / "lines.json"
    lines_json.write_text("\n".join(json.dumps(r) for r in rows[:3]))
    assert list(read_rows(str(lines_json))) == list(enumerate(rows[:3]))
    broken = tmp_path / "broken.jsonl"
    broken.write_text(json.dumps(rows[0]) + "\n{not json\n")
    (_, first), (row_id, invalid) = read_rows(str(broken))  # a broken line takes a row's place
    assert first == rows[0] and row_id == 1
    assert isinstance(invalid, chat.InvalidLine) and invalid.line_number == 2 and invalid.path == str(broken)
    with pytest.raises(FileNotFoundError):
        list(read_rows(str(tmp_path / "missing.jsonl")))


def test_source_string_and_row_pairs_agree(qwen_tokenizer, tmp_path):
    rows = [conversation(f"question {i}", f"answer number {i}.") for i in range(6)] + [BAD_ROWS[chat.BAD_EMPTY]]
    write_files(tmp_path, rows)
    from_source = tokenize(str(tmp_path), qwen_tokenizer, min_supervised=1)
    from_pairs = tokenize(rows, qwen_tokenizer, min_supervised=1)
    assert [s.row_id for s in from_source.samples] == list(range(6))
    assert from_source.bad_rows == from_pairs.bad_rows == {chat.BAD_EMPTY: 1}
    for left, right in zip(from_source.samples, from_pairs.samples, strict=True):
        assert np.array_equal(left.input_ids, right.input_ids)


def test_parallel_equals_serial(qwen_tokenizer):
    rows = [conversation(f"q{i}", f"answer {i} " * (i % 7 + 1)) for i in range(150)]
    rows[17], rows[90] = BAD_ROWS[chat.BAD_ROLE], BAD_ROWS[chat.BAD_EMPTY]
    serial = tokenize(rows, qwen_tokenizer, min_supervised=1, num_workers=1)
    parallel = tokenize(rows, qwen_tokenizer, min_supervised=1, num_workers=2)
    assert serial.bad_rows == parallel.bad_rows and serial.examples == parallel.examples
    assert serial.num_rows == parallel.num_rows == 150
    assert [s.row_id for s in serial.samples] == [s.row_id for s in parallel.samples]
    for left, right in zip(serial.samples, parallel.samples, strict=True):
        assert np.array_equal(left.input_ids, right.input_ids) and np.array_equal(left.loss_mask, right.loss_mask)
    with pytest.raises(BadRowError, match="row 18: bad_role"):
        tokenize(rows, qwen_tokenizer, min_supervised=1, num_workers=2, strict=True)


def cached(source, tokenizer, cache_dir, **kwargs):
    return tokenize(source, tokenizer, cache_dir=cache_dir, min_supervised=1, **kwargs)


def test_cache_reuses_and_invalidates(qwen_tokenizer, tmp_path, monkeypatch):
    source, cache_dir = tmp_path / "data.jsonl", tmp_path / "cache"
    source.write_text(json.dumps(conversation("q", "answer A")) + "\n" + json.dumps(BAD_ROWS[chat.BAD_ROLE]) + "\n")
    first = cached(str(source), qwen_tokenizer, cache_dir)
    assert len(list(cache_dir.glob("*.npz"))) == 1

    real_tokenize_all = samples._tokenize_all
    monkeypatch.setattr(samples, "_tokenize_all", lambda *a, **k: pytest.fail("cache was not reused"))
    again = cached(str(source), qwen_tokenizer, cache_dir)
    assert again.bad_rows == first.bad_rows == {chat.BAD_ROLE: 1} and again.num_rows == 2
    assert np.array_equal(again.samples[0].input_ids, first.samples[0].input_ids)
    assert again.samples[0].loss_mask.dtype == np.uint8 and again.samples[0].input_ids.dtype == np.int32
    with pytest.raises(BadRowError, match="row 2: bad_role"):
        cached(str(source), qwen_tokenizer, cache_dir, strict=True)

    calls = []
    monkeypatch.setattr(samples, "_tokenize_all", lambda *a, **k: calls.append(1) or real_tokenize_all(*a, **k))
    # Same size, new content: must re-tokenize.
    source.write_text(source.read_text().replace("answer A", "answer B"))
    changed = cached(str(source), qwen_tokenizer, cache_dir)
    assert qwen_tokenizer.decode(changed.samples[0].input_ids).count("answer B") == 1
    cached(str(source), qwen_tokenizer, cache_dir, max_length=63)
    other_template = copy.copy(qwen_tokenizer)
    other_template.chat_template = CHATML_TEMPLATE.replace("'<|im_start|>assistant\\n'", "'<|im_start|>model\\n'")
    cached(str(source), other_template, cache_dir)
    cached(str(source), qwen_tokenizer, cache_dir, overlong="drop")
    cached([(0, conversation("q", "answer A"))], qwen_tokenizer, cache_dir)
    cached([(0, conversation("q", "answer C"))], qwen_tokenizer, cache_dir)
    assert len(calls) == 6
    cached([(0, conversation("q", "answer C"))], qwen_tokenizer, cache_dir)
    assert len(calls) == 6


def test_embedded_source_reads(qwen_tokenizer):
    first_id, first_row = next(read_rows(chat.EMBEDDED_CODE_CHAT))
    assert first_id == 0 and first_row["messages"][1]["role"] == "assistant"


def test_a_line_that_is_not_json_is_a_counted_bad_row(qwen_tokenizer, tmp_path):
    source = tmp_path / "rows.jsonl"
    lines = [json.dumps(GOOD), json.dumps(BAD_ROWS[chat.BAD_ROLE]), "{not json", "", json.dumps(GOOD)]
    source.write_text("\n".join(lines) + "\n")
    result = tokenize(str(source), qwen_tokenizer, min_supervised=1)
    assert result.num_rows == 4 and [s.row_id for s in result.samples] == [0, 3]
    assert result.bad_rows == {chat.BAD_ROLE: 1, chat.BAD_INVALID_JSON: 1}
    assert result.examples[chat.BAD_INVALID_JSON] == [2]
    # Strict mode names the first bad row in file order (the bad role), then the broken line.
    with pytest.raises(BadRowError, match=r"^row 2: bad_role"):
        tokenize(str(source), qwen_tokenizer, min_supervised=1, strict=True)
    source.write_text("\n".join([lines[0], lines[2], lines[1]]) + "\n")
    with pytest.raises(BadRowError, match=r"^row 2: invalid_json \(line 2 of .*rows.jsonl: Expecting"):
        tokenize(str(source), qwen_tokenizer, min_supervised=1, strict=True)


def test_cut_samples_are_counted(qwen_tokenizer):
    rows = [conversation("Tell me a story.", LONG_ANSWER), GOOD, conversation("Again.", LONG_ANSWER)]
    result = tokenize(rows, qwen_tokenizer, max_length=64, min_supervised=1)
    assert [s.truncated for s in result.samples] == [True, False, True] and result.num_truncated == 2
