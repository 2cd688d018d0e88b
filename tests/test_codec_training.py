"""The fp8 store codec does not change what the drafter learns: a few steps of training from
an fp8 store reach a loss within 1% of the same run from a bf16 store.

Stage one runs twice over the same embedded tiny Qwen3.5 target and real offline rows,
once per `store.codec`; both trainings use the same seed, schedule and settings, so the
decoded context features are the only input that differs.
"""

import numpy as np
import pytest
import torch
import zarr

from dflash.config import load_config, replace
from dflash.store import codecs
from dflash.store.inspection import store_stats
from dflash.store.reader import StoreReader
from stages import extract, train

pytestmark = pytest.mark.slow

CODECS = ("bf16", "fp8")


@pytest.fixture(scope="module")
def runs(tmp_path_factory, pipeline_config) -> dict:
    """Per codec: its stage-one store and a short stage-two run from it, all else equal."""
    root = tmp_path_factory.mktemp("codec-training")
    config_path = pipeline_config(root, 30, 10, """
[store]
bucket_edges = [64, 192, 320, 512]
shard_tokens = 4096
[extract]
batch_tokens = 2048
[drafter]
size = "tiny"
[train]
epochs = 1
max_steps = 3
lr = 3e-3
token_budget = 512
accum_steps = 2
max_anchors = 8
loss_chunk = 512
holdout_fraction = 0.1
eval_every = 3
eval_batches = 1
log_every = 1
save_every = 100
num_workers = 0
wandb = "disabled"
""")
    base = load_config(config_path)
    results = {}
    for codec in CODECS:
        config = replace(base, store={"codec": codec, "path": str(root / f"store-{codec}")},
                         train={"out_dir": str(root / f"run-{codec}")})
        extract.run(config)
        results[codec] = {"store": config.store.path, "train": train.run(config)}
    return results


def decoded_shards(path: str) -> dict[str, tuple[np.ndarray, torch.Tensor]]:
    """Per complete shard: its token ids and its decoded `(T, n*H)` float32 features."""
    reader = StoreReader(path)
    root = zarr.open_group(path, mode="r")
    content = {}
    for name in reader.shard_names:
        shard = root["shards"][name]
        scale = torch.from_numpy(shard["scale"][...]) if reader.codec == "fp8" else None
        features = codecs.decode(torch.from_numpy(shard["hidden"][...]), scale, reader.codec, reader.num_layers,
                                 dtype=torch.float32)
        content[name] = (shard["input_ids"][...], features)
    return content


def test_stores_hold_the_same_tokens_but_different_features(runs):
    """Guards against a vacuous pass: the fp8 run must really train on other (quantised) inputs."""
    bf16, fp8 = (decoded_shards(runs[codec]["store"]) for codec in CODECS)
    assert bf16.keys() == fp8.keys() and bf16
    for name, (ids_bf16, features_bf16) in bf16.items():
        ids_fp8, features_fp8 = fp8[name]
        np.testing.assert_array_equal(ids_bf16, ids_fp8, err_msg=name)
        assert not torch.equal(features_bf16, features_fp8), f"shard {name}: fp8 decodes bit-identical to bf16"
        cosine_T = torch.nn.functional.cosine_similarity(features_bf16, features_fp8, dim=-1)
        assert cosine_T.min() > 0.99, f"shard {name}: min cosine {cosine_T.min():.4f}"
    stored_bytes = {codec: store_stats(runs[codec]["store"])["total"]["stored_bytes"] for codec in CODECS}
    assert stored_bytes["fp8"] < stored_bytes["bf16"], stored_bytes


def test_both_runs_train(runs):
    for codec in CODECS:
        result = runs[codec]["train"]
        assert result.steps == 3 and len(result.losses) == 3, codec
        assert all(np.isfinite(result.losses)), codec
        assert result.losses[-1] < result.losses[0], f"{codec}: loss did not fall: {result.losses}"


def test_fp8_loss_within_one_percent_of_bf16(runs):
    bf16, fp8 = runs["bf16"]["train"], runs["fp8"]["train"]
    assert fp8.losses != bf16.losses, "fp8 and bf16 runs gave bit-identical losses"
    assert fp8.losses[-1] == pytest.approx(bf16.losses[-1], rel=0.01), \
        f"train loss: fp8 {fp8.losses} vs bf16 {bf16.losses}"
    fp8_held_out, bf16_held_out = fp8.eval_metrics["loss"], bf16.eval_metrics["loss"]
    assert fp8_held_out == pytest.approx(bf16_held_out, rel=0.01), \
        f"held-out loss: fp8 {fp8_held_out} vs bf16 {bf16_held_out}"
