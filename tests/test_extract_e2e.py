"""Stage one end to end on CPU: extract, resume, refusal, kill -9 and several ranks.

Runs the real CLI on the embedded tiny Qwen3.5 target and real offline chat rows. The
subprocess runs pin one thread per process so that stores made by different process
layouts can be compared bit for bit.
"""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import zarr

from dflash.config import load_config
from dflash.store.inspection import verify_store
from dflash.store.reader import StoreReader
from dflash.store.schema import StoreMismatchError, completed_shards
from stages import extract

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, pipeline_config):
    """A config over 64 embedded rows with small shards, sharing the session's target cache."""
    root = tmp_path_factory.mktemp("extract")
    config_path = pipeline_config(root, 40, 24, f"""
[store]
path = "{root / 'store'}"
codec = "fp8"
bucket_edges = [64, 192, 320, 512]
shard_tokens = 2048
[extract]
batch_tokens = 2048
rows_per_chunk = 32
chunks_per_file = 4
[train]
token_budget = 512
""")
    return root, config_path


def cli(config_path, *extra, env=None, **kwargs):
    command = [sys.executable, "-m", "stages.cli", "stage1-extract", "-c", str(config_path), *extra]
    return subprocess.run(command, env=env or single_thread_env(), capture_output=True, text=True, **kwargs)


def single_thread_env():
    return dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")


def store_content(path) -> dict:
    """Every shard's arrays, as numpy, keyed by shard and array name."""
    root = zarr.open_group(str(path), mode="r")
    content = {}
    for name in sorted(completed_shards(root)):
        shard = root["shards"][name]
        for array_name, array in shard.arrays():
            content[f"{name}/{array_name}"] = array[...]
    return content


def assert_same_content(a: dict, b: dict):
    assert a.keys() == b.keys()
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)


@pytest.fixture(scope="module")
def reference_store(workspace):
    """An uninterrupted single-process run through the CLI."""
    root, config_path = workspace
    store = root / "reference"
    result = cli(config_path, "--set", f'store.path="{store}"')
    assert result.returncode == 0, result.stderr[-3000:]
    assert "stage one done" in result.stdout
    return store


def test_extract_writes_a_verified_store_and_reruns_do_nothing(workspace, capsys):
    root, config_path = workspace
    config = load_config(config_path, [f'store.path="{root / "inproc"}"'])
    result = extract.run(config)
    assert result.shards_written > 1 and result.num_tokens > 0
    report = verify_store(config.store.path)
    assert report.ok, report.bad
    reader = StoreReader(config.store.path)
    assert len(reader) == result.num_samples
    sample = reader.read_sample(0)
    assert sample["hidden"].shape == (len(sample["input_ids"]), 3 * 64)
    assert sample["loss_mask"].any() and not sample["loss_mask"].all()
    assert reader.attrs["target_layer_ids"] == [1, 3, 5]
    embed, lm_head = reader.read_frozen_weights()
    assert embed.shape == lm_head.shape == (248320, 64)

    capsys.readouterr()
    again = extract.run(config)
    assert again.shards_written == 0
    assert "nothing to do" in capsys.readouterr().out


def test_store_made_with_another_config_is_refused(workspace, reference_store):
    """A copy of the reference store (a store's identity is its content: test_store_identity_is_its_content)."""
    import shutil

    root, config_path = workspace
    shutil.copytree(reference_store, root / "mismatch")
    changed = load_config(config_path, [f'store.path="{root / "mismatch"}"', "store.codec=bf16",
                                        "data.max_length=320"])
    with pytest.raises(StoreMismatchError) as error:
        extract.run(changed)
    assert "codec" in str(error.value) and "max_length" in str(error.value)
    overwritten = load_config(config_path, [f'store.path="{root / "mismatch"}"', "store.codec=bf16",
                                            "data.max_length=320", "store.overwrite=true"])
    assert extract.run(overwritten).shards_written > 0
    assert StoreReader(overwritten.store.path).attrs["codec"] == "bf16"


def test_kill_9_then_rerun_equals_uninterrupted(workspace, reference_store):
    root, config_path = workspace
    store = root / "killed"
    command = [sys.executable, "-m", "stages.cli", "stage1-extract", "-c", str(config_path),
               "--set", f'store.path="{store}"']
    process = subprocess.Popen(command, env=single_thread_env(), stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and process.poll() is None:
        if (store / "shards").is_dir() and completed_shards(zarr.open_group(str(store), mode="r")):
            break
        time.sleep(0.005)
    process.send_signal(signal.SIGKILL)
    process.wait()
    planned = len(StoreReader(reference_store).attrs["shards"])
    done_after_kill = completed_shards(zarr.open_group(str(store), mode="r"))
    assert 0 < len(done_after_kill) < planned, "the kill must land mid-run"
    assert not verify_store(store).ok  # planned shards are missing, and verify says so

    result = cli(config_path, "--set", f'store.path="{store}"')
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"{len(done_after_kill)} already complete" in result.stdout
    assert verify_store(store).ok
    assert_same_content(store_content(store), store_content(reference_store))


def test_two_ranks_write_the_same_store_as_one(workspace, reference_store):
    root, config_path = workspace
    store = root / "two-ranks"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               "-m", "stages.cli", "stage1-extract", "-c", str(config_path), "--set", f'store.path="{store}"']
    result = subprocess.run(command, env=single_thread_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "over 2 rank(s)" in result.stdout
    assert verify_store(store).ok
    assert_same_content(store_content(store), store_content(reference_store))


def test_inspect_cli_verifies_and_reports(reference_store, tmp_path):
    command = [sys.executable, "-m", "stages.cli", "inspect-cache", str(reference_store), "--json", "--verify"]
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert report["ok"] and report["stats"]["total"]["tokens"] > 0


def remove_completion_mark(store, name):
    shard = zarr.open_group(str(store), mode="a")["shards"][name]
    del shard.attrs["complete"]


def test_store_identity_is_its_content(workspace, reference_store, tmp_path, capsys):
    """A moved or copied store, another path spelling, other worker counts and a rerun after
    --overwrite all continue the store; a content change names every differing key."""
    import shutil

    root, config_path = workspace
    copied = tmp_path / "copied"
    shutil.copytree(reference_store, copied)
    for overrides in ([f'store.path="{copied}"'], [f'store.path="{copied}"', "data.num_workers=2",
                                                   "extract.writer_processes=1", "extract.batch_tokens=1024"]):
        capsys.readouterr()
        assert extract.run(load_config(config_path, overrides)).shards_written == 0
        assert "nothing to do" in capsys.readouterr().out
    relative = subprocess.run([sys.executable, "-m", "stages.cli", "stage1-extract", "-c", str(config_path),
                               "--set", 'store.path="copied"'], cwd=tmp_path, env=single_thread_env(),
                              capture_output=True, text=True)
    assert relative.returncode == 0 and "nothing to do" in relative.stdout, relative.stderr[-2000:]

    # A run with --overwrite that stopped mid-way (one shard left incomplete) is continued, with or without it.
    first = sorted(completed_shards(zarr.open_group(str(copied), mode="r")))[0]
    for overwrite in ("true", "false"):
        remove_completion_mark(copied, first)
        result = extract.run(load_config(config_path, [f'store.path="{copied}"', f"store.overwrite={overwrite}"]))
        assert result.shards_written == 1 and result.shards_skipped == len(StoreReader(copied).attrs["shards"]) - 1
    assert_same_content(store_content(copied), store_content(reference_store))

    with pytest.raises(StoreMismatchError) as error:
        extract.run(load_config(config_path, [f'store.path="{copied}"', "data.max_length=320"]))
    message = str(error.value)
    assert "content.data.max_length: store has 512, config gives 320" in message
