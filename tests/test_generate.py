"""`dflash generate` on the embedded tiny target: answers, multi-turn rows, bad rows, refusal,
and a killed run that resumes to the same files as an uninterrupted one."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from dflash import data, generation
from dflash.config import load_config
from dflash.modeling_dflash import greedy_generate
from stages import generate

pytestmark = pytest.mark.slow


def write_config(root, embedded_cache_dir, rows) -> str:
    source = root / "rows.jsonl"
    source.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    config = root / "config.toml"
    config.write_text(f"""
[target]
path = "embedded:tiny"
[data]
source = "{source}"
max_length = 256
cache_dir = "{embedded_cache_dir}"
""")
    return str(config)


def read_parts(out) -> list[dict]:
    return [json.loads(line) for part in sorted(out.glob("part-*.jsonl")) for line in part.read_text().splitlines()]


def test_answers_replace_the_last_turn_and_equal_the_targets_greedy_decoding(tmp_path, embedded_cache_dir):
    rows = [
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi."},
                      {"role": "assistant", "content": "hi"}, {"role": "user", "content": "Again?"},
                      {"role": "assistant", "content": "the answer that goes"}]},
        "{ not json",
        {"prompt": "Write a haiku."},
        {"messages": [{"role": "assistant", "content": "nobody asked"}]},
        {"prompt": "Name a prime.", "response": "7"},
        {"prompt": "word " * 300},
    ]
    config = load_config(write_config(tmp_path, embedded_cache_dir, rows))
    out = tmp_path / "out"
    options = generate.GenerateOptions(out=str(out), max_new_tokens=6, batch_size=1, rows_per_shard=2)
    result = generate.run(config, options)
    assert (result.num_rows, result.num_prompts, result.answers) == (6, 3, 3)
    assert {reason: rows for reason, rows in result.bad_rows.items()} == {
        data.BAD_INVALID_JSON: [1], data.BAD_EMPTY: [3], generation.BAD_PROMPT_TOO_LONG: [5]}
    written = read_parts(out)
    assert [row["source_row"] for row in written] == [1, 3, 5]
    assert written[0]["messages"][:4] == rows[0]["messages"][:4]  # earlier turns kept
    assert [m["role"] for m in written[0]["messages"]] == ["system", "user", "assistant", "user", "assistant"]
    assert written[2]["messages"][0] == {"role": "user", "content": "Name a prime."}

    from dflash.target import load_causal_lm, prepare_checkpoint, stop_token_ids
    from dflash.tokenizer import load_target_tokenizer

    checkpoint = prepare_checkpoint(config.target.path, config.data.cache_dir)
    tokenizer = load_target_tokenizer(checkpoint)
    target = load_causal_lm(str(checkpoint), torch.float32, torch.device("cpu"))
    for row in written:
        prompt = tokenizer.apply_chat_template(row["messages"][:-1], tokenize=False, add_generation_prompt=True)
        ids = torch.tensor([tokenizer(prompt, add_special_tokens=False)["input_ids"]])
        expected = greedy_generate(target, ids, 6, stop_token_ids(tokenizer, target))
        expected = [t for t in expected if t not in stop_token_ids(tokenizer, target)]
        assert row["messages"][-1]["content"] == tokenizer.decode(expected, skip_special_tokens=True)
        assert row["cut"] == (len(expected) == 6)

    # The output is a data source stage one reads: every answer is a supervised assistant turn.
    tokenized = data.tokenize_rows(str(out), tokenizer, max_length=512)
    assert len(tokenized.samples) + sum(tokenized.bad_rows.values()) == 3

    # Other decoding settings are refused, --overwrite replaces.
    with pytest.raises(generation.GenerateMismatchError, match="max_new_tokens: output has 6, now 7"):
        generate.run(config, generate.GenerateOptions(out=str(out), max_new_tokens=7, rows_per_shard=2))
    generate.run(config, generate.GenerateOptions(out=str(out), max_new_tokens=7, rows_per_shard=2, overwrite=True))
    assert json.loads((out / generation.MANIFEST).read_text())["content"]["max_new_tokens"] == 7


def test_a_killed_run_resumes_to_the_same_output(tmp_path, embedded_cache_dir):
    from dflash.embedded import code_chat_rows

    config = write_config(tmp_path, embedded_cache_dir, code_chat_rows()[:12])
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")

    def command(out, *extra):
        return [sys.executable, "-m", "dflash.cli", "generate", "-c", config, "--out", str(out),
                "--max-new-tokens", "12", "--rows-per-shard", "3", "--batch-size", "2", *extra]

    subprocess.run(command(tmp_path / "whole"), check=True, env=env, capture_output=True)
    killed = subprocess.Popen(command(tmp_path / "killed"), env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 300
    while not (tmp_path / "killed" / "part-00001.jsonl").exists() and time.time() < deadline:
        time.sleep(0.05)
    os.killpg(killed.pid, signal.SIGKILL)
    killed.wait()
    left = sorted(p.name for p in (tmp_path / "killed").glob("part-*.jsonl"))
    assert 2 <= len(left) < 4, left  # stopped mid-way
    resumed = subprocess.run(command(tmp_path / "killed"), env=env, capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"plan: 4 shards, {len(left)} already written" in resumed.stdout
    assert f"{4 - len(left)} shards written, {len(left)} kept from an earlier run" in resumed.stdout
    for name in [f"part-{k:05d}.jsonl" for k in range(4)]:
        assert (tmp_path / "killed" / name).read_text() == (tmp_path / "whole" / name).read_text(), name
    assert not [p for p in (tmp_path / "killed").iterdir() if ".tmp-" in p.name]
