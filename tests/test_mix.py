"""A mix of training sources by weight (`data.mix`, dflash/train/mix.py): the config's sources and
their errors, the store's `source_ids` and `sources`, each epoch's token shares, the held-out split
per source, and (slow) stage one -> stage two -> resume on two sources weighted 3:1.
"""

import json
from types import SimpleNamespace

import numpy as np
import pytest
import zarr

from dflash.config import ConfigError, load_config, training_sources
from dflash.store.inspection import store_stats, verify_store
from dflash.store.plan import plan_shards
from dflash.store.reader import StoreReader
from dflash.store.schema import ATTRS_KEY, content_identity, diff_attrs
from dflash.store.writer import ShardWriter, create_or_open_store
from dflash.train import mix
from dflash.train.sampler import split_holdout

TWO_SOURCES = 'data.mix=[{source = "/data/general.jsonl", weight = 3}, {source = "embedded:humaneval", weight = 1}]'
N_LAYERS, HIDDEN = 2, 8


# ------------------------------------------------------------------ config


def test_training_sources_name_each_source_and_default_to_data_source():
    config = load_config(None, [TWO_SOURCES])
    assert training_sources(config.data) == [("general", "/data/general.jsonl", 3.0),
                                             ("humaneval", "embedded:humaneval", 1.0)]
    plain = load_config(None, [])
    assert training_sources(plain.data) == [("code-chat", "embedded:code-chat", 1.0)]


@pytest.mark.parametrize("override, message", [
    ('data.mix=[{source = "a/x.jsonl"}, {source = "b/x.jsonl"}]', r"data\.mix\[1\]\.name: 'x' is also"),
    ('data.mix=[{source = "a", name = "m"}, {source = "b", name = "m"}]', r"data\.mix\[1\]\.name"),
    ('data.mix=[{source = "", name = "m"}]', r"data\.mix\[0\]\.source is empty"),
    ('data.mix=[{source = "a", weight = -1}]', r"data\.mix\[0\]\.weight must be > 0"),
])
def test_mix_errors_name_the_table_and_key(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


def test_weights_are_not_store_content_but_the_sources_are():
    config = load_config(None, [TWO_SOURCES])
    reweighted = load_config(None, [TWO_SOURCES.replace("weight = 3", "weight = 7")])
    assert content_identity(config) == content_identity(reweighted)
    fewer = load_config(None, ['data.mix=[{source = "/data/general.jsonl", weight = 3}]'])
    assert diff_attrs({"content": content_identity(config)}, {"content": content_identity(fewer)})
    assert diff_attrs({"content": content_identity(fewer)}, {"content": content_identity(config)})


def test_a_following_run_refuses_a_weighted_mix():
    with pytest.raises(ConfigError, match="train.follow"):
        mix.refuse_follow(load_config(None, [TWO_SOURCES]))
    mix.refuse_follow(load_config(None, []))


# ------------------------------------------------------------------ token shares


def shares_of(indices, sources, lengths, num_sources):
    tokens = np.bincount(sources[indices], weights=lengths[indices], minlength=num_sources)
    return tokens / tokens.sum()


@pytest.mark.parametrize("weights", [(3, 1), (1, 1), (6, 3, 1), (1, 10)])
def test_an_epoch_gives_each_source_its_weights_token_share(weights):
    rng = np.random.default_rng(0)
    sizes = (2000, 300, 700)[:len(weights)]  # sources of unequal sizes and lengths
    sources = np.concatenate([np.full(n, s) for s, n in enumerate(sizes)])
    lengths = np.concatenate([rng.integers(20 + 100 * s, 400 + 300 * s, n) for s, n in enumerate(sizes)])
    train = np.flatnonzero(rng.random(len(sources)) > 0.05)
    shares = np.asarray(weights, dtype=float) / sum(weights)
    for epoch in range(3):
        drawn = mix.weighted_epoch(train, sources, lengths, shares, seed=1, epoch=epoch)
        np.testing.assert_allclose(shares_of(drawn, sources, lengths, len(weights)), shares, atol=0.01)
        assert lengths[drawn].sum() == pytest.approx(lengths[train].sum(), rel=0.01)  # the epoch keeps its size
        assert np.isin(drawn, train).all()
    again = mix.weighted_epoch(train, sources, lengths, shares, seed=1, epoch=2)
    np.testing.assert_array_equal(again, drawn)  # deterministic in (seed, epoch): resume rebuilds it
    assert not np.array_equal(again, mix.weighted_epoch(train, sources, lengths, shares, seed=1, epoch=1))


def test_a_small_source_with_a_large_weight_repeats_its_samples():
    sources, lengths = np.array([0] * 90 + [1] * 10), np.full(100, 10)
    drawn = mix.weighted_epoch(np.arange(100), sources, lengths, np.array([0.5, 0.5]), seed=0, epoch=0)
    counts = np.bincount(drawn, minlength=100)
    assert (counts[90:] == 5).all()  # 500 tokens of 100 tokens: every sample five times
    assert counts[:90].sum() == 50 and counts[:90].max() == 1


# ------------------------------------------------------------------ the store


def write_store(path, source_ids=None, names=None, num_samples=40):
    """A small bf16 store; with `source_ids`, a store of the sources `names` (root attribute, arrays)."""
    rng = np.random.default_rng(0)
    lengths = rng.integers(8, 60, num_samples)
    row_ids = np.arange(num_samples) % 25  # row ids repeat across sources
    plans = plan_shards(lengths, row_ids, [1, 32, 64], 400)
    attrs = {"schema_version": 1, "codec": "bf16", "hidden_size": HIDDEN, "target_layer_ids": [1, 2],
             "max_length": 64, "bucket_edges": [1, 32, 64], "config": {"data": {"source": "/data/old.jsonl"}},
             "shards": [{"name": p.name, "bucket": p.bucket, "num_samples": len(p.sample_indices),
                         "num_tokens": p.num_tokens} for p in plans]}
    if names is not None:
        attrs["sources"] = names
    root = create_or_open_store(str(path), attrs, overwrite=False)
    for plan in plans:
        writer = ShardWriter(root, plan, lengths, row_ids, "bf16", N_LAYERS, HIDDEN, 8, 32, source_ids=source_ids)
        for i in plan.sample_indices:
            n = int(lengths[i])
            mask = np.zeros(n, np.uint8)
            mask[n // 2:] = 1  # the first half is the prompt: one prompt per (source, row)
            ids = np.full(n, 5 + row_ids[i], np.int32)
            writer.write_sample(i, rng.integers(0, 2**14, (n, N_LAYERS * HIDDEN)).astype(np.uint16), None, ids, mask)
        writer.commit()
    return lengths, row_ids


def test_store_with_sources_round_trips_and_verifies(tmp_path):
    source_ids = np.arange(40) % 2
    lengths, row_ids = write_store(tmp_path / "store", source_ids, ["general", "code"])
    reader = StoreReader(tmp_path / "store")
    assert reader.has_sources and reader.source_names == ["general", "code"]
    order = np.lexsort((reader.sample_row_id, reader.sample_source))
    expected = np.lexsort((row_ids, source_ids))
    np.testing.assert_array_equal(reader.sample_source[order], source_ids[expected])
    np.testing.assert_array_equal(reader.sample_length[order], lengths[expected])
    assert reader.read_sample(0)["source"] == reader.sample_source[0]
    assert "of source" in reader.sample_label(0)
    assert verify_store(tmp_path / "store").ok
    stats = store_stats(tmp_path / "store")
    assert [s["name"] for s in stats["sources"]] == ["general", "code"]
    assert sum(s["tokens"] for s in stats["sources"]) == stats["total"]["tokens"] == lengths.sum()


def test_a_store_written_before_sources_reads_as_one_source(tmp_path):
    write_store(tmp_path / "store")
    reader = StoreReader(tmp_path / "store")
    assert not reader.has_sources and reader.source_names == ["old"]
    assert (reader.sample_source == 0).all() and reader.read_sample(0)["source"] == 0
    config = load_config(None, ["train.holdout_fraction=0.2"])
    groups = reader.prompt_groups()
    np.testing.assert_array_equal(mix.held_out_split(config, reader)[1],
                                  split_holdout(len(reader), 0.2, config.train.seed, groups)[1])  # as before
    assert mix.resolve_mix(config, reader) is None
    assert store_stats(tmp_path / "store")["sources"] == []
    with pytest.raises(ConfigError, match="holds one"):
        mix.resolve_mix(load_config(None, [TWO_SOURCES]), reader)


def test_held_out_split_is_drawn_per_source(tmp_path):
    source_ids = (np.arange(40) >= 30).astype(np.int32)  # 30 samples of general, 10 of code
    write_store(tmp_path / "store", source_ids, ["general", "code"])
    reader = StoreReader(tmp_path / "store")
    config = load_config(None, ["train.holdout_fraction=0.2", "train.holdout_by=sample"])
    train, held = mix.held_out_split(config, reader)
    assert np.intersect1d(train, held).size == 0 and train.size + held.size == len(reader)
    assert np.bincount(reader.sample_source[held], minlength=2).tolist() == [6, 2]
    np.testing.assert_array_equal(held, mix.held_out_split(config, reader)[1])
    with pytest.raises(ConfigError, match="no source 'math'"):
        mix.source_number(reader, "math")


def test_stage_two_matches_the_mix_to_the_store_by_name(tmp_path):
    write_store(tmp_path / "store", np.arange(40) % 2, ["general", "humaneval"])
    reader = StoreReader(tmp_path / "store")
    resolved = mix.resolve_mix(load_config(None, [TWO_SOURCES]), reader)
    assert resolved.names == ("general", "humaneval") and resolved.weights == (3.0, 1.0)
    renamed = TWO_SOURCES.replace("weight = 1}", 'weight = 1, name = "code"}')
    with pytest.raises(ConfigError, match="the sources may not"):
        mix.resolve_mix(load_config(None, [renamed]), reader)
    assert mix.resolve_mix(load_config(None, []), reader) is None  # no data.mix: every sample once


# ------------------------------------------------------------------ end to end (tiny target, CPU)


@pytest.mark.slow
def test_two_sources_weighted_extract_train_resume_and_heldout_prompts(tmp_path, pipeline_config, capsys):
    from dflash.data.embedded import code_chat_rows
    from dflash.data.tokenizer import load_target_tokenizer
    from dflash.extract.target import prepare_checkpoint
    from dflash.serve.evaluation import load_prompts
    from dflash.train.checkpoint import complete_checkpoints
    from stages import extract, train

    rows = code_chat_rows()
    for name, picked in (("short", rows[:36]), ("long", rows[-6:])):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in picked))
    path = pipeline_config(tmp_path, 1, 1, f"""mix = [{{source = "{tmp_path / 'short.jsonl'}", weight = 3}},
       {{source = "{tmp_path / 'long.jsonl'}", weight = 1}}]
[store]
path = "{tmp_path / 'store'}"
bucket_edges = [64, 192, 320, 512]
shard_tokens = 4096
[extract]
batch_tokens = 2048
[drafter]
size = "tiny"
[train]
out_dir = "{tmp_path / 'run'}"
epochs = 2
max_steps = 4
token_budget = 512
accum_steps = 2
max_anchors = 8
loss_chunk = 512
holdout_fraction = 0.1
eval_every = 100
log_every = 1
save_every = 2
keep_last = 5
num_workers = 0
wandb = "disabled"
""")
    config = load_config(path)
    extract.run(config)
    reader = StoreReader(config.store.path)
    assert reader.source_names == ["short", "long"]
    assert np.bincount(reader.sample_source).tolist() == [36, 6]

    straight = train.run(config)
    assert "source short: weight 75.0%" in capsys.readouterr().out
    resumed = train.run(load_config(path, [f'train.out_dir="{tmp_path / "resumed"}"']),
                        resume=str(complete_checkpoints(tmp_path / "run" / "checkpoints")[0]))
    assert resumed.losses == straight.losses[2:]

    tokenizer = load_target_tokenizer(prepare_checkpoint(config.target.path, config.data.cache_dir))
    prompts = load_prompts(config, "heldout:long", 10, tokenizer)
    assert prompts and all("of source long" in label for label, *_ in prompts)
    everything = load_prompts(config, "heldout", 10, tokenizer)
    assert {label.split(" of source ")[1].split(" ")[0] for label, *_ in everything} == {"short", "long"}

    old = zarr.open_group(config.store.path, mode="r+")  # the same store as one written before sources
    attrs = dict(old.attrs[ATTRS_KEY])
    del attrs["sources"]
    old.attrs[ATTRS_KEY] = attrs
    single = load_config(path, [f'train.out_dir="{tmp_path / "old"}"', "data.mix=[]"])
    assert train.run(single).steps == 4
    again = train.run(load_config(path, [f'train.out_dir="{tmp_path / "old-resumed"}"', "data.mix=[]"]),
                      resume=str(complete_checkpoints(tmp_path / "old" / "checkpoints")[0]))
    assert again.steps == 4
