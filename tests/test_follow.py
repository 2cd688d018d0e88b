"""Stage two following a store that stage one is still writing (`train.follow`, dflash/train/follow.py).

Stage one writes the store once; each test copies it and takes the completion mark off the
shards that have "not arrived yet", then gives them back in stage one's write order
(`plan.write_order`) as training goes: a few at every fixed point, and one whenever the run
waits. Arrivals are a function of the step and of the waits, so an uninterrupted run and a
killed-and-resumed one see the same store at the same steps.
"""

import json
import os
import shutil
import signal
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr
from safetensors.torch import load_file

from dflash.config import load_config
from dflash.dist import DistState
from dflash.store import plan
from dflash.store.reader import StoreReader
from dflash.store.schema import COMPLETE_KEY
from dflash.train import follow
from dflash.train.checkpoint import latest_checkpoint, read_state
from stages import extract, train

pytestmark = pytest.mark.slow

FIRST, PER_POINT = 3, 1  # shards there at the start; shards arriving at each fixed point


@pytest.fixture(scope="module")
def written(tmp_path_factory, pipeline_config):
    root = tmp_path_factory.mktemp("follow")
    path = pipeline_config(root, 18, 6, f"""
[store]
path = "{root / 'store'}"
bucket_edges = [64, 192, 320, 512]
shard_tokens = 768
[extract]
batch_tokens = 2048
[drafter]
size = "tiny"
[train]
epochs = 2
lr = 3e-3
token_budget = 512
accum_steps = 2
max_anchors = 4
loss_chunk = 512
holdout_fraction = 0.1
eval_every = 100
eval_batches = 2
log_every = 1
save_every = 1000
num_workers = 0
follow = true
follow_every = 2
follow_poll_s = 0.0
wandb = "disabled"
""")
    extract.run(load_config(path))
    return path, root / "store"


class Arrivals:
    """A copy of the store whose shards complete in stage one's write order as training goes."""

    def __init__(self, source: Path, path: Path, first: int = FIRST):
        shutil.copytree(source, path)
        self.path = path
        root = zarr.open_group(str(path), mode="r+")
        plans = [plan.ShardPlan(e["name"], e["bucket"], (), e["num_tokens"]) for e in root.attrs["dflash"]["shards"]]
        self.order = [p.name for p in plan.write_order(plans)]
        self.marks = {}
        for name in self.order[first:]:
            shard = root["shards"][name]
            self.marks[name] = shard.attrs[COMPLETE_KEY]
            del shard.attrs[COMPLETE_KEY]
        self.arrived, self.waits = first, 0

    def until(self, count: int) -> None:
        root = zarr.open_group(str(self.path), mode="r+")
        while self.arrived < min(count, len(self.order)):
            name = self.order[self.arrived]
            root["shards"][name].attrs[COMPLETE_KEY] = self.marks[name]
            self.arrived += 1


@pytest.fixture
def arrivals(monkeypatch):
    """Store path -> its Arrivals; fixed points and waits of a following run drive them."""
    stores: dict[str, Arrivals] = {}
    kill_at = {}
    original = follow.StoreFollower.at_fixed_point

    def at_fixed_point(self, steps_done, step, deadline=None, stopping=None):
        if step == kill_at.get(str(self.reader.path)):
            os.kill(os.getpid(), signal.SIGTERM)  # the run saves at this step and stops
        stores[str(self.reader.path)].until(FIRST + PER_POINT * (step // self.config.train.follow_every))
        return original(self, steps_done, step, deadline, stopping)

    def sleep(seconds):  # waiting for stage one: it completes one more shard
        for store in stores.values():
            if store.arrived < len(store.order):
                store.waits += 1
                store.until(store.arrived + 1)

    monkeypatch.setattr(follow.StoreFollower, "at_fixed_point", at_fixed_point)
    monkeypatch.setattr(follow.time, "sleep", sleep)
    return stores, kill_at


def run(config_path, store: Path, out: Path, resume=None):
    config = load_config(config_path, [f'store.path="{store}"', f'train.out_dir="{out}"'])
    return train.run(config, resume=resume)


def logged(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_following_run_mixes_lengths_takes_up_shards_and_resumes_exactly(written, arrivals, tmp_path):
    config_path, source = written
    stores, kill_at = arrivals
    stores[str(tmp_path / "a")] = Arrivals(source, tmp_path / "a")
    straight = run(config_path, tmp_path / "a", tmp_path / "run-a")

    state = read_state(latest_checkpoint(tmp_path / "run-a"))
    recorded = state["scheduler"]["follow"]
    assert recorded["exact"] and len(recorded["segments"]) >= 3  # shards were taken up at several points
    assert sorted(recorded["arrival"]) == sorted(stores[str(tmp_path / "a")].order)
    assert straight.steps == recorded["horizon"] and stores[str(tmp_path / "a")].waits >= 1
    print(f"{straight.steps} steps, {len(recorded['segments'])} segments, {stores[str(tmp_path / 'a')].waits} waits")

    # Every logged step mixed sequence lengths (log_every = 1: one window per step).
    for line in (entry for entry in logged(tmp_path / "run-a") if "loss" in entry):
        buckets = [key for key, value in line.items() if key.startswith("bucket") and value > 0]
        assert len(buckets) >= 2, f"step {line['step']} trained one length: {line}"

    # The first epoch trained every training sample once, across its segments.
    config = load_config(config_path, [f'store.path="{tmp_path / "a"}"'])
    reader = StoreReader(str(tmp_path / "a"), shards=recorded["arrival"])
    follower = follow.StoreFollower(config, reader, DistState(0, 1, 0, torch.device("cpu")), recorded,
                                    report=lambda text: None)
    trained = []
    for index, segment in enumerate(follower.segments):
        if segment.schedule is None:
            continue
        last = index + 1 == len(follower.segments)
        steps = segment.schedule.num_steps if last else follower.segments[index + 1].after_steps
        trained += [i for m in segment.schedule.rank_plan[:steps].reshape(-1).tolist()
                    for i in segment.schedule.micro_batches[m]]
    assert sorted(trained) == follower.train_indices().tolist()
    assert not set(trained) & set(follower.eval_indices().tolist())

    # Killed (SIGTERM) mid-way through the first epoch, resumed: the same losses and weights.
    stores[str(tmp_path / "b")] = Arrivals(source, tmp_path / "b")
    kill_at[str(tmp_path / "b")] = 4
    killed = run(config_path, tmp_path / "b", tmp_path / "run-b")
    assert killed.steps == 4
    resumed = run(config_path, tmp_path / "b", tmp_path / "run-b", resume="latest")
    assert resumed.steps == straight.steps
    assert killed.losses + resumed.losses == straight.losses  # exact on CPU
    final = load_file(str(latest_checkpoint(tmp_path / "run-b") / "model.safetensors"))
    expected = load_file(str(latest_checkpoint(tmp_path / "run-a") / "model.safetensors"))
    for key in expected:
        assert torch.equal(final[key], expected[key]), key


def test_refresh_keeps_every_sample_index_and_appends_new_shards(written, tmp_path):
    _, source = written
    store = Arrivals(source, tmp_path / "store")
    reader = StoreReader(str(store.path))
    before = {key: value.copy() for key, value in reader.index.items()}
    assert not reader.finished and len(reader.shard_names) == FIRST
    assert reader.refresh() == []
    store.until(FIRST + 2)
    added = reader.refresh()
    assert added == store.order[FIRST:FIRST + 2]
    for key, value in before.items():
        assert np.array_equal(reader.index[key][:len(value)], value), key
    store.until(len(store.order))
    reader.refresh()
    assert reader.finished and not reader.incomplete_shards


def test_a_missing_store_or_a_stalled_stage_one_stops_with_what_to_do(written, tmp_path, monkeypatch):
    config_path, source = written
    monkeypatch.setattr(follow.time, "sleep", lambda seconds: None)
    dist = DistState(0, 1, 0, torch.device("cpu"))
    config = load_config(config_path, [f'store.path="{tmp_path / "nothing"}"', "train.follow_timeout_s=0"])
    with pytest.raises(follow.FollowTimeout, match="start `dflash stage1-extract`"):
        follow.wait_for_store(config, dist, status=lambda text: None)

    Arrivals(source, tmp_path / "stalled", first=7)  # stage one stopped after 7 shards
    config = load_config(config_path, [f'store.path="{tmp_path / "stalled"}"', f'train.out_dir="{tmp_path / "run"}"',
                                       "train.follow_timeout_s=0"])
    with pytest.raises(follow.FollowTimeout, match=r"no shard .* completed .* Saved .* at step"):
        train.run(config)
    assert latest_checkpoint(tmp_path / "run") is not None  # the steps trained are kept


def test_two_ranks_follow_together_and_stop_together_when_stage_one_stalls(written, tmp_path):
    """Under DDP rank 0 looks at the store and broadcasts what it found: both ranks take up the same
    shards, and when no shard comes both stop with the message (no rank left waiting in a collective)."""
    import subprocess
    import sys

    config_path, source = written
    Arrivals(source, tmp_path / "store", first=7)  # stage one stopped after 7 shards
    sets = [f'store.path="{tmp_path / "store"}"', f'train.out_dir="{tmp_path / "run"}"', "train.accum_steps=1",
            "train.follow_timeout_s=0", "train.save_every=2"]
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                             "-m", "stages.cli", "stage2-train", "-c", str(config_path),
                             *[item for value in sets for item in ("--set", value)]],
                            env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=600)
    assert result.returncode != 0
    assert "no shard of" in result.stdout + result.stderr and "Saved" in result.stdout + result.stderr
    state = read_state(latest_checkpoint(tmp_path / "run"))
    assert state["scheduler"]["world_size"] == 2 and len(state["scheduler"]["follow"]["arrival"]) == 7
