"""`dflash generate`: on the embedded tiny target (Qwen3.5, transformers' generate) and on a tiny
Llama checkpoint (the continuous-batching engine): answers, multi-turn rows, bad rows, several
sampled answers per prompt beside the greedy one, refusal, and killed runs that resume to the
same files as uninterrupted ones."""

import functools
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from dflash.config import ConfigError, load_config
from dflash.data import chat, samples
from dflash.model.modeling_dflash import greedy_generate
from dflash.serve import generation
from stages import generate

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llama_target_dir(tmp_path_factory, qwen_tokenizer):
    """A tiny random Llama checkpoint with the Qwen tokenizer: a family the engine serves."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from dflash.recipe import VOCAB_SIZE

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         initializer_range=0.125, max_position_embeddings=2048))
    directory = tmp_path_factory.mktemp("llama-target") / "target"
    model.save_pretrained(directory, safe_serialization=True)
    qwen_tokenizer.save_pretrained(directory)
    return directory


def write_config(root, embedded_cache_dir, rows, target="embedded:tiny") -> str:
    source = root / "rows.jsonl"
    source.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    config = root / "config.toml"
    config.write_text(f"""
[target]
path = "{target}"
[data]
source = "{source}"
max_length = 256
cache_dir = "{embedded_cache_dir}"
""")
    return str(config)


def read_parts(out) -> list[dict]:
    return [json.loads(line) for part in sorted(out.glob("part-*.jsonl")) for line in part.read_text().splitlines()]


@functools.cache
def loaded_target(target_path: str, cache_dir: str):
    """The target's tokenizer, model and stop ids, loaded once per target (a tokenizer load is seconds)."""
    from dflash.data.tokenizer import load_target_tokenizer
    from dflash.extract.target import load_causal_lm, prepare_checkpoint, stop_token_ids

    checkpoint = prepare_checkpoint(target_path, cache_dir)
    tokenizer = load_target_tokenizer(checkpoint)
    target = load_causal_lm(str(checkpoint), torch.float32, torch.device("cpu"))
    return tokenizer, target, stop_token_ids(tokenizer, target)


def plain_greedy(config, row, max_new_tokens):
    """The answer of plain one-at-a-time greedy decoding to `row`'s prompt, and whether it was cut."""
    tokenizer, target, stops = loaded_target(config.target.path, config.data.cache_dir)
    prompt = tokenizer.apply_chat_template(row["messages"][:-1], tokenize=False, add_generation_prompt=True)
    ids = torch.tensor([tokenizer(prompt, add_special_tokens=False)["input_ids"]])
    expected = greedy_generate(target, ids, max_new_tokens, stops)
    cut = expected[-1] not in stops
    return tokenizer.decode(expected if cut else expected[:-1], skip_special_tokens=True), cut


def test_answers_replace_the_last_turn_and_equal_the_targets_greedy_decoding(tmp_path, embedded_cache_dir, capsys):
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
    assert "decoding: transformers' generate (the fast engine does not serve model type 'qwen3_5_text'" in \
        capsys.readouterr().out
    assert (result.num_rows, result.num_prompts, result.answers) == (6, 3, 3)
    assert {reason: rows for reason, rows in result.bad_rows.items()} == {
        chat.BAD_INVALID_JSON: [1], chat.BAD_EMPTY: [3], generation.BAD_PROMPT_TOO_LONG: [5]}
    written = read_parts(out)
    assert [row["source_row"] for row in written] == [1, 3, 5]
    assert [row["sample"] for row in written] == [0, 0, 0]
    assert written[0]["messages"][:4] == rows[0]["messages"][:4]  # earlier turns kept
    assert [m["role"] for m in written[0]["messages"]] == ["system", "user", "assistant", "user", "assistant"]
    assert written[2]["messages"][0] == {"role": "user", "content": "Name a prime."}

    for row in written:
        assert (row["messages"][-1]["content"], row["cut"]) == plain_greedy(config, row, 6)

    tokenizer = loaded_target(config.target.path, config.data.cache_dir)[0]
    # The output is a data source stage one reads: every answer is a supervised assistant turn.
    tokenized = samples.tokenize_rows(str(out), tokenizer, max_length=512)
    assert len(tokenized.samples) + sum(tokenized.bad_rows.values()) == 3

    # Other decoding settings are refused, --overwrite replaces.
    with pytest.raises(generation.GenerateMismatchError, match="max_new_tokens: output has 6, now 7"):
        generate.run(config, generate.GenerateOptions(out=str(out), max_new_tokens=7, rows_per_shard=2))
    generate.run(config, generate.GenerateOptions(out=str(out), max_new_tokens=7, rows_per_shard=2, overwrite=True))
    assert json.loads((out / generation.MANIFEST).read_text())["content"]["max_new_tokens"] == 7


@pytest.mark.parametrize("engine", ["generate", "slots"])
def test_a_killed_run_resumes_to_the_same_output(tmp_path, embedded_cache_dir, llama_target_dir, engine):
    """transformers' generate on the Qwen3.5 tiny target (greedy), and the engine on the Llama one
    (two sampled answers and the greedy one per prompt)."""
    from dflash.data.embedded import code_chat_rows

    target = "embedded:tiny" if engine == "generate" else str(llama_target_dir)
    config = write_config(tmp_path, embedded_cache_dir, code_chat_rows()[:12], target)
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    sampling = [] if engine == "generate" else ["--temperature", "0.9", "--num-samples", "2", "--with-greedy"]

    def command(out, *extra):
        return [sys.executable, "-m", "stages.cli", "generate", "-c", config, "--out", str(out), "--engine", engine,
                "--max-new-tokens", "12", "--rows-per-shard", "3", "--batch-size", "2", *sampling, *extra]

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


def test_several_sampled_answers_beside_the_greedy_one(tmp_path, embedded_cache_dir, llama_target_dir, capsys):
    from dflash.data.embedded import code_chat_rows

    rows = code_chat_rows()[:5]
    config = load_config(write_config(tmp_path, embedded_cache_dir, rows, str(llama_target_dir)))
    options = generate.GenerateOptions(out=str(tmp_path / "out"), max_new_tokens=24, temperature=1.0, top_k=50,
                                       num_samples=3, with_greedy=True, rows_per_shard=2, batch_size=4)
    result = generate.run(config, options)
    assert "decoding: continuous batching over a preallocated KV cache" in capsys.readouterr().out
    assert (result.num_prompts, result.answers, result.shards_written) == (5, 20, 3)
    written = read_parts(tmp_path / "out")
    assert [(row["source_row"], row["sample"]) for row in written] == [(r, k) for r in range(1, 6) for k in range(4)]
    for row in written[::4]:  # sample 0 is the target's own greedy answer
        assert (row["messages"][-1]["content"], row["cut"]) == plain_greedy(config, row, 24)
    answers = [[row["messages"][-1]["content"] for row in written[i:i + 4]] for i in range(0, 20, 4)]
    assert all(len(set(per_prompt[1:])) > 1 for per_prompt in answers)  # samples differ from each other
    manifest = json.loads((tmp_path / "out" / generation.MANIFEST).read_text())["content"]
    assert (manifest["num_samples"], manifest["with_greedy"], manifest["top_k"]) == (3, True, 50)
    with pytest.raises(ConfigError, match="need --temperature > 0"):
        generate.run(config, generate.GenerateOptions(out=str(tmp_path / "x"), num_samples=2))

    # A store of the answers holds each prompt's answers out together (train.holdout_by = "prompt").
    from dflash.store.reader import StoreReader
    from dflash.train.sampler import holdout_groups, split_holdout
    from stages import extract

    store_config = load_config(None, [f'target.path="{llama_target_dir}"', f'data.source="{tmp_path / "out"}"',
                                      f'store.path="{tmp_path / "store"}"', f'data.cache_dir="{embedded_cache_dir}"',
                                      "store.bucket_edges=[32, 64, 128, 512]", "data.max_length=512", "train.holdout_fraction=0.4",
                                      "target.layer_ids=[0, 1]"])
    extract.run(store_config)
    reader = StoreReader(store_config.store.path)
    groups = holdout_groups(store_config, reader)
    source_rows = np.array([written[int(row)]["source_row"] for row in reader.sample_row_id])
    assert len(set(groups)) == 5 and all(len(set(groups[source_rows == r])) == 1 for r in range(1, 6))
    train_indices, eval_indices = split_holdout(len(reader), 0.4, 0, groups)
    assert eval_indices.size and not set(source_rows[train_indices]) & set(source_rows[eval_indices])


def test_no_prompt_the_target_wrote_ended_so_none_is_answered(tmp_path, embedded_cache_dir, llama_target_dir, capsys):
    """A random target ends no turn within 8 tokens: every prompt it was asked to write is dropped and counted,
    nothing is answered, and the shards are written empty (the recipe's cheap dry runs hit this)."""
    from dflash.data.embedded import ask_code_rows

    config = load_config(write_config(tmp_path, embedded_cache_dir, ask_code_rows()[:2], str(llama_target_dir)))
    options = generate.GenerateOptions(out=str(tmp_path / "out"), max_new_tokens=8, ask_temperature=1.0,
                                       rows_per_shard=3, batch_size=4, engine="slots")
    result = generate.run(config, options)
    assert result.asked == 0 and sum(result.ask_dropped.values()) == 2 and result.answers == 0
    assert read_parts(tmp_path / "out") == [] and "asked: the target wrote 2 prompts" in capsys.readouterr().out


@pytest.mark.parametrize("engine", ["slots", "generate"])
def test_the_target_writes_the_prompts_it_then_answers(tmp_path, embedded_cache_dir, llama_target_dir, monkeypatch,
                                                       capsys, engine):
    """--ask-temperature: each row's user turn is its start plus what the target wrote after it (sampled,
    from its own stream: a second run writes the same files); the answer is the target's greedy answer to
    that prompt; prompts it did not end are dropped and counted. A random target rarely ends a turn, so
    one token in 16 ends it here."""
    from dflash.data.embedded import ask_code_rows
    from dflash.extract.target import stop_token_ids

    real_stops = stop_token_ids
    monkeypatch.setattr(generate, "stop_token_ids",
                        lambda tokenizer, model: sorted(set(real_stops(tokenizer, model)) | set(range(7, 240_000, 16))))
    config = load_config(write_config(tmp_path, embedded_cache_dir, ask_code_rows()[:8], str(llama_target_dir)))
    options = generate.GenerateOptions(out=str(tmp_path / "out"), max_new_tokens=24, ask_temperature=1.0,
                                       rows_per_shard=3, batch_size=4, engine=engine)
    result = generate.run(config, options)
    summary = capsys.readouterr().out
    assert result.asked + sum(result.ask_dropped.values()) == 8 and result.asked >= 3, (result, summary)
    assert f"asked: the target wrote 8 prompts (temperature 1), {result.asked} answered" in summary
    written = read_parts(tmp_path / "out")
    assert len(written) == result.answers == result.asked
    assert [row["source_row"] for row in written] == sorted(row["source_row"] for row in written)
    tokenizer, target = loaded_target(config.target.path, config.data.cache_dir)[:2]
    stops = generate.stop_token_ids(tokenizer, target)  # with the patched ends of turn
    for row in written:
        assert row["asked"] is True and row["sample"] == 0
        user, answer = row["messages"][0]["content"], row["messages"][-1]["content"]
        seed = ask_code_rows()[row["source_row"] - 1]["messages"][-1]["content"]
        assert row["kind"] == "code"
        assert user.startswith(seed) and len(user) > len(seed)
        ids = torch.tensor([samples.prompt_token_ids(row["messages"][:-1], tokenizer)])
        expected = greedy_generate(target, ids, 24, stops)
        cut = expected[-1] not in stops
        assert (answer, row["cut"]) == (tokenizer.decode(expected if cut else expected[:-1], skip_special_tokens=True), cut)
    assert len({row["messages"][0]["content"] for row in written}) == len(written)  # sampled: they differ
    manifest = json.loads((tmp_path / "out" / generation.MANIFEST).read_text())["content"]
    assert manifest["ask_temperature"] == 1.0
    again = generate.run(config, generate.GenerateOptions(**{**options.__dict__, "out": str(tmp_path / "again")}))
    assert again.asked == result.asked
    for name in sorted(p.name for p in (tmp_path / "out").glob("part-*.jsonl")):
        assert (tmp_path / "again" / name).read_text() == (tmp_path / "out" / name).read_text(), name


def test_a_prompt_to_continue_ends_with_the_start_of_its_user_turn(embedded_cache_dir, qwen_tokenizer):
    """ask_prompt_ids: the chat template's rendering cut right after the user turn's text (its end of turn
    left for the target to write), and asked_prompt's reasons to drop what the target wrote."""
    messages = [{"role": "user", "content": "Write a Python function"}]
    ids = samples.ask_prompt_ids(messages, qwen_tokenizer)
    text = qwen_tokenizer.decode(ids)
    full = qwen_tokenizer.apply_chat_template(messages, tokenize=False)
    assert text.endswith("Write a Python function") and full.startswith(text) and len(full) > len(text)
    with pytest.raises(ValueError, match="must end with a user turn"):
        samples.ask_prompt_ids(messages + [{"role": "assistant", "content": "x"}], qwen_tokenizer)
    prompt = generation.Prompt(4, messages, [])
    made = generation.asked_prompt(prompt, generation.Answer([1], " that adds two numbers.", False), qwen_tokenizer, 256)
    assert made.asked and made.row_id == 4
    assert made.messages == [{"role": "user", "content": "Write a Python function that adds two numbers."}]
    assert made.input_ids == samples.prompt_token_ids(made.messages, qwen_tokenizer)
    assert generation.asked_prompt(prompt, generation.Answer([1], " that", True), qwen_tokenizer, 256) == generation.ASKED_CUT
    assert generation.asked_prompt(prompt, generation.Answer([], " ", False), qwen_tokenizer, 256) == generation.ASKED_EMPTY
    assert generation.asked_prompt(prompt, generation.Answer([1], " x", False), qwen_tokenizer, 8) == \
        generation.BAD_PROMPT_TOO_LONG


@pytest.mark.parametrize("engine", ["slots", "generate"])
def test_two_turns_the_target_asks_a_follow_up_and_answers_it(tmp_path, embedded_cache_dir, llama_target_dir,
                                                              monkeypatch, capsys, engine):
    """--turns 2 over embedded:ask-general's first rows: after each greedy answer that ended, the target writes
    a second user turn from a follow-up start and answers it (two-turn rows, both answers the target's greedy
    ones); a cut first answer stays a one-turn row. Made in groups of two shards; a run that lost its last
    group remakes the same files. One token in 16 ends a turn, as above."""
    from dflash.data.embedded import ask_general_rows
    from dflash.data.starts import FOLLOW_UP_STARTS
    from dflash.extract.target import stop_token_ids

    real_stops = stop_token_ids
    monkeypatch.setattr(generate, "stop_token_ids",
                        lambda tokenizer, model: sorted(set(real_stops(tokenizer, model)) | set(range(7, 240_000, 16))))
    monkeypatch.setattr(generate, "TURNS_GROUP_PROMPTS", 3)  # groups of two shards of two prompts
    config = load_config(write_config(tmp_path, embedded_cache_dir, ask_general_rows()[:8], str(llama_target_dir)))
    out = tmp_path / "out"
    options = generate.GenerateOptions(out=str(out), max_new_tokens=20, ask_temperature=1.0, turns=2,
                                       rows_per_shard=2, batch_size=4, engine=engine)
    with pytest.raises(ConfigError, match="--turns 2: .* --ask-temperature"):
        generate.run(config, generate.GenerateOptions(out=str(out), turns=2))
    result = generate.run(config, options)
    summary = capsys.readouterr().out
    assert f"turns: {result.follow_ups} two-turn rows" in summary
    written = read_parts(out)
    assert len(written) == result.asked and result.answers == result.asked + result.follow_ups
    two_turn = [row for row in written if row.get("turns") == 2]
    cut_first = [row for row in written if "turns" not in row and row["cut"]]
    assert len(two_turn) == result.follow_ups >= 2 and len(cut_first) >= 1, (result, summary)
    assert len(cut_first) == result.follow_up_dropped[generation.FIRST_ANSWER_CUT]
    assert len(written) - len(two_turn) == sum(result.follow_up_dropped.values())

    tokenizer, target = loaded_target(config.target.path, config.data.cache_dir)[:2]
    stops = generate.stop_token_ids(tokenizer, target)  # with the patched ends of turn

    def greedy(messages):
        ids = torch.tensor([samples.prompt_token_ids(messages, tokenizer)])
        expected = greedy_generate(target, ids, 20, stops)
        cut = expected[-1] not in stops
        return tokenizer.decode(expected if cut else expected[:-1], skip_special_tokens=True), cut

    for row in two_turn:
        messages = row["messages"]
        assert [m["role"] for m in messages[-4:]] == ["user", "assistant", "user", "assistant"]
        assert row["kind"] == ask_general_rows()[row["source_row"] - 1]["kind"] and row["asked"] is True
        assert any(messages[-2]["content"].startswith(start) and len(messages[-2]["content"]) > len(start)
                   for start in FOLLOW_UP_STARTS)
        assert greedy(messages[:-3]) == (messages[-3]["content"], False)  # the first answer ended
        assert greedy(messages[:-1]) == (messages[-1]["content"], row["cut"])
    for row in cut_first:
        assert row["messages"][-2]["role"] == "user" and greedy(row["messages"][:-1]) == (row["messages"][-1]["content"], True)

    # Stage one supervises both answers of a two-turn row.
    tokenized = samples.tokenize_rows(str(out), tokenizer, max_length=1024, strict=True)
    for sample in tokenized.samples:
        spans = int(np.count_nonzero(np.diff(np.concatenate([[0], sample.loss_mask.astype(int)])) == 1))
        assert spans == (2 if written[sample.row_id].get("turns") == 2 else 1)

    # A run killed in its second group: the first group's shards kept, the rest remade as before.
    first = {name: (out / name).read_text() for name in sorted(p.name for p in out.glob("part-*.jsonl"))}
    assert len(first) == 4
    for name in ("part-00002.jsonl", "part-00003.jsonl"):
        (out / name).unlink()
    resumed = generate.run(config, options)
    assert (resumed.shards_kept, resumed.shards_written) == (2, 2)
    assert {name: (out / name).read_text() for name in first} == first
    assert json.loads((out / generation.MANIFEST).read_text())["content"]["turns"] == 2


def test_slots_fill_half_the_free_memory_or_their_share_of_the_whole_gpu(monkeypatch):
    """Side-by-side generates (`--cache-share`) each size their KV cache from the GPU's whole memory, so the
    last to start gets as many slots as the first; alone, half of what is free (faked memory report)."""
    per_slot = 2**20
    monkeypatch.setattr(generation.SlotDecoder, "cache_bytes_per_slot", staticmethod(lambda model, context: per_slot))
    free = [400 * per_slot]
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free[0], 1000 * per_slot))

    def slots(share: float) -> int:
        engine = generation.Generator.__new__(generation.Generator)
        engine.device, engine.requested_batch, engine.cache_share, engine.target = torch.device("cuda"), 0, share, None
        return engine.slot_count(max_context=64)

    assert slots(0.0) == 200  # half of the 400 free
    assert slots(0.175) == 175  # its share of the 1000, though 400 are free
    free[0] = 100 * per_slot
    assert slots(0.175) == 80  # never more than 80% of what is free
    free[0] = 1
    with pytest.raises(ValueError, match="does not fit in 1[78]% of the GPU"):
        slots(0.175)
