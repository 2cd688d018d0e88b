"""The embedded default: offline code-chat rows and the tiny Qwen3.5 target checkpoint."""

import itertools
import os

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from dflash.data import chat, embedded, samples
from dflash.data.embedded import (STDLIB_MODULES, _human_eval_rows, code_chat_rows, code_complete_rows, code_docs_rows,
                                  embedded_rows)
from dflash.data.tokenizer import CHATML_TEMPLATE, tokenizer_identity
from dflash.extract.tiny_target import CHECKPOINT_FILES, build_tiny_target, tiny_target_config


def test_code_chat_rows_are_real_and_deterministic():
    rows = code_chat_rows()
    assert rows == code_chat_rows()
    assert len(rows) >= 164 + 55 and len(rows) <= 164 + len(STDLIB_MODULES)
    assert "def has_close_elements" in rows[0]["messages"][0]["content"]
    assert rows[0]["messages"][1]["content"].startswith("```python\nfrom typing import List")
    modules = [row["messages"][0]["content"] for row in rows[164:]]
    assert "Write the Python standard library module `json/decoder.py`." in modules
    decoder = next(r for r in rows[164:] if "`json/decoder.py`" in r["messages"][0]["content"])
    assert "class JSONDecoder" in decoder["messages"][1]["content"]


def test_code_complete_is_worded_as_humaneval_and_shares_no_module_with_code_docs():
    """The test suites' functions as HumanEval words its problems; none of code-docs' modules, so the
    two sources joined never put one function on both sides of a held-out split."""
    docs, complete = code_docs_rows(), code_complete_rows()
    assert len(docs) > 1000 and len(complete) > 1000
    wording = _human_eval_rows()[0]["messages"][0]["content"].split("```python\n")[0]
    docs_modules = {row["messages"][0]["content"].split("Python module `")[1].split("`")[0] for row in docs}
    complete_modules = set()
    for row in complete:
        request, answer = (message["content"] for message in row["messages"])
        assert request.startswith(wording + "```python\n# ") and answer.startswith("```python\n")
        stub = request.split("```python\n", 1)[1].split("\n", 1)[1]
        header = stub.split('"""')[0].rstrip().removesuffix("```").rstrip()  # the stub up to its docstring
        assert answer.removeprefix("```python\n").startswith(header)
        complete_modules.add(request.split("# ", 1)[1].split("\n", 1)[0])
    assert not docs_modules & complete_modules
    assert any("test" in module.split(".")[0] for module in complete_modules)
    assert len(complete) == embedded.CODE_COMPLETE_ROWS  # the test suites, then numpy's functions
    assert embedded_rows("embedded:code-docs+code-complete") == list(docs) + list(complete)
    with pytest.raises(ValueError, match="'embedded:nope' in 'embedded:code-docs\\+nope'"):
        embedded_rows("embedded:code-docs+nope")


def test_code_complete_fills_up_from_installed_packages_where_the_test_suites_are_stripped(monkeypatch):
    """A system Python without its test suites (Debian's, Ubuntu's: a few hundred functions on the H200
    image) still gives CODE_COMPLETE_ROWS prompts: the installed packages' functions follow the tests'."""
    suites = list(itertools.islice(embedded._stdlib_functions(True), 40))
    monkeypatch.setattr(embedded, "_stdlib_functions", lambda tests: iter(suites))
    monkeypatch.setattr(embedded, "CODE_COMPLETE_ROWS", 300)
    embedded.code_complete_rows.cache_clear()
    try:
        rows = embedded.code_complete_rows()
    finally:
        embedded.code_complete_rows.cache_clear()
    modules = [row["messages"][0]["content"].split("# ", 1)[1].split("\n", 1)[0] for row in rows]
    assert len(rows) == 300
    first_package = next(i for i, module in enumerate(modules) if module.startswith("numpy"))
    assert 0 < first_package <= 40 and all(module.startswith("numpy") for module in modules[first_package:])


def test_code_chat_rows_tokenize_with_a_spread_of_lengths(qwen_tokenizer):
    result = samples.tokenize_rows(
        chat.EMBEDDED_CODE_CHAT, qwen_tokenizer, max_length=100_000, overlong="truncate",
        min_supervised=16, strict=True, num_workers=1, cache_dir=None,
    )
    lengths = np.array([len(sample) for sample in result.samples])
    assert result.bad_rows == {} and len(lengths) == len(code_chat_rows())
    assert lengths.min() < 200 and lengths.max() > 8000 and np.median(lengths) > 300
    assert all(sample.loss_mask.sum() >= 16 for sample in result.samples)


def test_tiny_target_checkpoint(tiny_target_dir, qwen_tokenizer):
    assert all((tiny_target_dir / name).is_file() for name in CHECKPOINT_FILES)
    config = AutoConfig.from_pretrained(tiny_target_dir)
    expected = tiny_target_config()
    assert (config.model_type, config.hidden_size, config.num_hidden_layers, config.vocab_size) == (
        expected.model_type, expected.hidden_size, expected.num_hidden_layers, expected.vocab_size,
    )
    tokenizer = AutoTokenizer.from_pretrained(tiny_target_dir)
    assert tokenizer.chat_template == CHATML_TEMPLATE
    assert tokenizer_identity(tokenizer)["hash"] == tokenizer_identity(qwen_tokenizer)["hash"]
    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir)
    input_ids = torch.tensor([qwen_tokenizer.encode("def f(x):\n    return x")])
    with torch.no_grad():
        logits = model(input_ids).logits
    assert logits.shape == (1, input_ids.shape[1], expected.vocab_size) and torch.isfinite(logits).all()


def test_tiny_target_is_idempotent_and_deterministic(tiny_target_dir, tokenizer_cache_dir, tmp_path):
    weights = tiny_target_dir / "model.safetensors"
    before = weights.stat().st_mtime_ns
    assert build_tiny_target(tiny_target_dir) == tiny_target_dir
    assert weights.stat().st_mtime_ns == before
    leftovers = [p.name for p in tiny_target_dir.parent.iterdir() if p.name.startswith(".")]
    assert leftovers == []

    (tmp_path / "empty").mkdir()  # an existing empty directory is filled
    other = build_tiny_target(tmp_path / "empty", tokenizer_cache_dir)
    first, second = load_file(weights), load_file(other / "model.safetensors")
    assert first.keys() == second.keys()
    assert all(torch.equal(first[key], second[key]) for key in first)


def test_tiny_target_refuses_a_foreign_directory(tmp_path):
    foreign = tmp_path / "target"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("not a checkpoint")
    with pytest.raises(FileExistsError, match="not empty"):
        build_tiny_target(foreign)
    assert os.listdir(foreign) == ["notes.txt"]
