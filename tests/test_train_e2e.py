"""Stage two end to end on CPU: train from a real stage-one store, kill and resume, DDP, export.

The store comes from the embedded tiny Qwen3.5 target over real offline rows (stage one run
in-process once per module). Runs are short (a few optimizer steps) but go through the
real CLI, schedule, loader, loss, optimizer and checkpoint code.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dflash.config import load_config
from dflash.model.export import load_exported
from dflash.store.schema import CorruptShardError, StoreMismatchError
from dflash.train import loop as train_loop
from dflash.train import sizing
from dflash.train.checkpoint import latest_checkpoint, load_checkpoint
from dflash.train.metrics import NonFiniteError
from dflash.train.sampler import held_out_micro_batches
from stages import extract, train

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def config_path(tmp_path_factory, pipeline_config):
    root = tmp_path_factory.mktemp("train")
    path = pipeline_config(root, 30, 10, f"""
[store]
path = "{root / 'store'}"
bucket_edges = [64, 192, 320, 512]
shard_tokens = 4096
[extract]
batch_tokens = 2048
[drafter]
size = "tiny"
[train]
out_dir = "{root / 'run'}"
epochs = 1
max_steps = 8
lr = 3e-3
token_budget = 512
accum_steps = 2
max_anchors = 8
loss_chunk = 512
holdout_fraction = 0.1
eval_every = 4
eval_batches = 2
log_every = 1
save_every = 2
num_workers = 0
wandb = "disabled"
""")
    extract.run(load_config(path))
    return path


def run_dir_override(path: Path) -> str:
    return f'train.out_dir="{path}"'


def logged_losses(run_dir: Path) -> dict[int, float]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {line["step"]: line["loss"] for line in lines if "loss" in line}


def single_thread_env():
    return dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")


def test_training_runs_logs_evaluates_and_checkpoints(config_path, tmp_path):
    config = load_config(config_path, [run_dir_override(tmp_path / "run")])
    result = train.run(config)
    assert result.steps == 8 and len(result.losses) == 8
    assert all(torch.isfinite(torch.tensor(result.losses)))
    assert set(logged_losses(tmp_path / "run")) == set(range(1, 9))
    assert {"loss", "tau", "acc_slot1", "lr", "tokens_per_s", "data_wait", "padding_efficiency"} <= set(result.last_metrics)
    metrics = result.last_metrics  # anchors come from supervised tokens: at most one a token, 16 block rows each
    assert 0 < metrics["anchors_per_token"] <= 1
    assert metrics["anchor_slots_per_s"] == pytest.approx(
        metrics["tokens_per_s"] * metrics["anchors_per_token"] * 16, rel=1e-6)
    assert result.eval_metrics["tau"] >= 1.0
    checkpoint = load_checkpoint(latest_checkpoint(tmp_path / "run"))
    assert checkpoint.step == 8
    assert len(list((tmp_path / "run" / "checkpoints").iterdir())) <= config.train.keep_last


@pytest.fixture
def one_thread():
    """The killed run trains in a one-thread subprocess: the runs in this process must reduce the
    same way (with 2 threads the CPU sums split differently and the losses differ in the 7th digit)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_killed_run_resumes_with_identical_losses(config_path, tmp_path, one_thread):
    uninterrupted = train.run(load_config(config_path, [run_dir_override(tmp_path / "straight")]))

    run_dir = tmp_path / "killed"
    command = [sys.executable, "-m", "stages.cli", "stage2-train", "-c", str(config_path),
               "--set", run_dir_override(run_dir), "--set", "train.save_every=2"]
    process = subprocess.Popen(command, env=single_thread_env(), stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while time.time() < deadline and process.poll() is None and latest_checkpoint(run_dir) is None:
        time.sleep(0.005)
    process.send_signal(signal.SIGKILL)
    process.wait()
    killed_at = load_checkpoint(latest_checkpoint(run_dir)).step
    assert 0 < killed_at < 8, "the kill must land mid-run"

    resumed = train.run(load_config(config_path, [run_dir_override(run_dir)]), resume="latest")
    assert resumed.steps == 8
    assert resumed.losses == uninterrupted.losses[killed_at:]  # exact on CPU
    final = load_file(str(latest_checkpoint(run_dir) / "model.safetensors"))
    straight = load_file(str(latest_checkpoint(tmp_path / "straight") / "model.safetensors"))
    for key in straight:
        assert torch.equal(final[key], straight[key]), key


def test_ddp_matches_one_process_and_resumes_on_another_number_of_ranks(config_path, tmp_path, capsys):
    """Two gloo ranks with one micro-batch each train like one process with two (losses and
    weights); a checkpoint resumes 2 -> 1 and 1 -> 2 ranks with train.accum_steps rescaled so
    every optimizer step keeps its micro-batches, and the resumed losses equal the uninterrupted run's."""
    common = ["train.max_steps=4", "train.keep_last=5"]
    straight = tmp_path / "straight"
    train.run(load_config(config_path, [run_dir_override(straight), "train.accum_steps=2", *common]))
    expected = logged_losses(straight)

    def two_ranks(run_dir: Path, accum: int, *resume: str) -> str:
        sets = [item for value in [run_dir_override(run_dir), f"train.accum_steps={accum}", *common]
                for item in ("--set", value)]
        result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                                 "-m", "stages.cli", "stage2-train", "-c", str(config_path), *sets, *resume],
                                env=single_thread_env(), capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stderr[-3000:]
        return result.stdout

    two = tmp_path / "two"
    two_ranks(two, 1)  # the config a 2-rank run was given: one micro-batch per rank and step
    ddp_losses = logged_losses(two)
    assert expected.keys() == ddp_losses.keys() == {1, 2, 3, 4}
    for step in expected:
        assert ddp_losses[step] == pytest.approx(expected[step], rel=1e-4), step
    single_weights = load_file(str(latest_checkpoint(straight) / "model.safetensors"))
    ddp_weights = load_file(str(latest_checkpoint(two) / "model.safetensors"))
    for key in single_weights:
        # Adam turns a near-zero gradient into about +-lr whatever its size, so an element whose
        # summed gradient is ~0 may differ by up to ~lr per step between the two summation orders
        # (1 of 4,096 elements, 8e-5, on a 2-core machine): bound the whole tensor, and each element by
        # the 4 steps' largest possible updates.
        gap = (ddp_weights[key] - single_weights[key]).float()
        assert gap.norm() <= 1e-3 * single_weights[key].float().norm() + 1e-6, key
        assert gap.abs().max() <= 4 * 3e-3, key
        assert (gap.abs() > 1e-5 + 1e-4 * single_weights[key].float().abs()).float().mean() <= 1e-3, key
    one = train.run(load_config(config_path, [run_dir_override(tmp_path / "two-to-one"), "train.accum_steps=1",
                                              *common]), resume=str(two / "checkpoints" / "step-00000002"))
    assert "resuming a 2-rank run on 1 rank(s): train.accum_steps 1 -> 2" in capsys.readouterr().out
    assert one.steps == 4
    assert one.losses == pytest.approx([expected[3], expected[4]], rel=1e-4)

    printed = two_ranks(tmp_path / "one-to-two", 2, "--resume", str(straight / "checkpoints" / "step-00000002"))
    assert "resuming a 1-rank run on 2 rank(s): train.accum_steps 2 -> 1" in printed
    resumed = logged_losses(tmp_path / "one-to-two")
    assert resumed.keys() == {3, 4}
    for step in (3, 4):
        assert resumed[step] == pytest.approx(expected[step], rel=1e-4), step


def test_export_cli_and_fine_tune_from_export(config_path, tmp_path):
    run_dir = tmp_path / "run"
    train.run(load_config(config_path, [run_dir_override(run_dir), "train.max_steps=2"]))
    checkpoint = latest_checkpoint(run_dir)
    export_dir = tmp_path / "export"
    result = subprocess.run([sys.executable, "-m", "stages.cli", "export", str(checkpoint), str(export_dir)],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    config_json = json.loads((export_dir / "config.json").read_text())
    assert config_json["dflash_config"]["target_layer_ids"] == [1, 3, 5]
    args, state = load_exported(export_dir)
    trained = load_checkpoint(checkpoint).model_state
    for key, value in state.items():
        assert torch.equal(value, trained[key].to(value.dtype)), key

    tuned = train.run(load_config(config_path, [run_dir_override(tmp_path / "tuned"), "train.max_steps=1",
                                                f'drafter.init_from="{export_dir}"']))
    assert tuned.steps == 1

    # Nothing persisted names a module path, so moving a module breaks no store, checkpoint or export.
    store_dir = Path(load_config(config_path).store.path)
    persisted = [p for root in (store_dir, checkpoint, export_dir) for p in root.rglob("*") if p.suffix == ".json"]
    assert len(persisted) > 3
    for path in persisted:
        assert not re.search(r"\b(dflash|stages)\.[a-z_]+", path.read_text()), path


def test_store_that_does_not_match_the_drafter_is_refused(config_path):
    config = load_config(config_path)
    attrs = {"target": {"vocab_size": 248320}, "target_layer_ids": [1, 5], "hidden_size": 128, "mask_token_id": 248070}
    with pytest.raises(StoreMismatchError) as error:
        sizing.build_drafter_args(config, attrs)
    assert "target_layer_ids" in str(error.value) and "hidden_size" in str(error.value)


def test_sigterm_saves_a_final_checkpoint(config_path, tmp_path):
    run_dir = tmp_path / "term"
    command = [sys.executable, "-m", "stages.cli", "stage2-train", "-c", str(config_path),
               "--set", run_dir_override(run_dir), "--set", "train.save_every=100"]
    process = subprocess.Popen(command, env=single_thread_env(), stdout=subprocess.PIPE,
                               stderr=subprocess.DEVNULL, text=True)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and process.poll() is None and not (metrics.exists() and metrics.stat().st_size):
        time.sleep(0.005)
    process.send_signal(signal.SIGTERM)
    stdout, _ = process.communicate(timeout=300)
    assert process.returncode == 0
    step = load_checkpoint(latest_checkpoint(run_dir)).step
    assert 0 < step < 8, "SIGTERM must land mid-run"
    assert "SIGTERM: saved checkpoint" in stdout


def test_max_minutes_stops_at_a_logging_step_and_saves(config_path, tmp_path, capsys):
    """train.max_minutes ends the run at the first logging step after it (log_every = 1 here: step 1,
    a step takes far longer than a microsecond), with a checkpoint and a line that says so."""
    run_dir = tmp_path / "timed"
    result = train.run(load_config(config_path, [run_dir_override(run_dir), "train.max_minutes=1e-8"]))
    assert result.steps == 1 and result.out_of_time
    assert load_checkpoint(latest_checkpoint(run_dir)).step == 1
    logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert any("eval/tau" in line and line["step"] == 1 for line in logged)  # the last step is evaluated
    assert "train.max_minutes (1e-08) reached: stopped at step 1 of 8" in capsys.readouterr().out


def test_first_step_notice_names_the_compile_cache_on_cuda_only(monkeypatch):
    """The bar says why the first CUDA step takes minutes (and where the cache lives); not on CPU."""
    from types import SimpleNamespace

    from dflash.dist import DistState

    one = DistState(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    assert train_loop.first_step_notice(SimpleNamespace(device=torch.device("cpu")), one) == ""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/scratch/inductor")
    cuda = SimpleNamespace(device=torch.device("cuda", 1))
    notice = train_loop.first_step_notice(cuda, one)
    assert "compiling" in notice and "/scratch/inductor" in notice and "ranks" not in notice
    three = DistState(rank=1, world_size=3, local_rank=1, device=torch.device("cuda", 1))
    assert "each of the 3 ranks compiles for its own GPU" in train_loop.first_step_notice(cuda, three)


def test_a_finished_runs_last_line_sums_it_up():
    """Steps, this process's minutes, tokens and rate (a resumed run's earlier part left out of the rate), and the
    last held-out numbers (served tau where measured)."""
    started = time.perf_counter() - 120.0
    fresh = train_loop.TrainResult(run_dir="r", tokens_seen=240_000, eval_metrics={"loss": 2.5, "tau": 3.25})
    text = train_loop.run_summary(fresh, 81, 81, 0, started)
    assert re.fullmatch(r"81 steps in 2\.0 min, 240,000 tokens at 2,0\d\d tokens/s \(compiling and held-out passes "
                        r"included\); held-out loss 2\.5000, tau 3\.250", text), text
    resumed = train_loop.TrainResult(run_dir="r", tokens_seen=240_000,
                                     eval_metrics={"loss": 2.5, "tau": 3.25, "served_tau": 3.1})
    text = train_loop.run_summary(resumed, 81, 40, 120_000, started)
    assert text.startswith("81 steps (40 in this run) in 2.0 min, 120,000 tokens at 1,0") and "served tau 3.100" in text
    assert "held-out loss" not in train_loop.run_summary(train_loop.TrainResult(run_dir="r"), 3, 3, 0, started)


def test_a_held_out_set_too_small_for_mixed_steps_still_evaluates():
    from types import SimpleNamespace

    import numpy as np

    config = load_config(None, ["train.token_budget=1024", "train.eval_batches=4"])
    reader = SimpleNamespace(index={"length": np.array([100, 200, 300, 120]), "bucket": np.array([0, 1, 1, 0]),
                                    "num_supervised": np.array([50, 60, 70, 40])})
    for eval_indices in (np.array([2]), np.array([1, 2])):
        batches = held_out_micro_batches(config, reader, eval_indices, rank=0, world_size=1)
        assert sorted(int(i) for batch in batches for i in batch) == eval_indices.tolist()


def test_a_nan_in_the_store_stops_training_and_nothing_non_finite_is_saved(config_path, tmp_path):
    """A stored row set to NaN (checksums valid): stage two names the step and rows, skips that
    update, writes no checkpoint after it, and no export of non-finite weights is possible."""
    import shutil

    import numpy as np
    import zarr

    from dflash.model.drafter import DFlashDrafter, drafter_args
    from dflash.model.export import ExportFormatError, export_drafter

    config = load_config(config_path)
    store = tmp_path / "store"
    shutil.copytree(config.store.path, store)
    root = zarr.open_group(str(store), mode="a")
    for name in root["shards"].group_keys():
        hidden = root["shards"][name]["hidden"]
        hidden[:8] = np.full((8, hidden.shape[1]), 0x7F, dtype=np.uint8)  # fp8 e4m3 NaN, its first sample
    poisoned = load_config(config_path, [f'store.path="{store}"', run_dir_override(tmp_path / "run")])
    with pytest.raises(NonFiniteError, match=r"step \d+: the loss or gradient is not finite.*"
                                                   r"\[rows \d+\] \(loss not finite\)") as error:
        train.run(poisoned)
    failed_step = int(str(error.value).split()[1].rstrip(":"))
    for checkpoint in (tmp_path / "run" / "checkpoints").glob("step-*"):
        saved = load_checkpoint(checkpoint)
        assert saved.step < failed_step
        assert all(bool(torch.isfinite(tensor).all()) for tensor in saved.model_state.values())

    args = drafter_args("tiny")
    state = DFlashDrafter(args).state_dict()
    state["norm.weight"][0] = float("nan")
    with pytest.raises(ExportFormatError, match="norm.weight holds non-finite"):
        export_drafter(state, args, tmp_path / "export")
    assert not (tmp_path / "export" / "model.safetensors").exists()


def flip_a_byte_in_every_shards_features(store) -> None:
    for hidden_file in sorted((store / "shards").glob("*/hidden/c/0/0")):
        data = bytearray(hidden_file.read_bytes())
        data[100] ^= 0xFF  # inside the first chunk's compressed bytes: its crc32c no longer holds
        hidden_file.write_bytes(bytes(data))


def test_a_corrupt_chunk_is_named_skipped_on_request_and_repaired(config_path, tmp_path, capsys):
    """Also: a shard without its completion mark (stage one still writing it) is named and left out."""
    import shutil

    import zarr

    from dflash.store.schema import COMPLETE_KEY

    config = load_config(config_path)
    store = tmp_path / "store"
    shutil.copytree(config.store.path, store)
    shards = zarr.open_group(store / "shards", mode="r+")
    names = sorted(shards.group_keys())
    del shards[names[-1]].attrs[COMPLETE_KEY]
    flip_a_byte_in_every_shards_features(store)
    overrides = [f'store.path="{store}"', "train.max_steps=0"]

    with pytest.raises(CorruptShardError, match=r"shard b\d\d-\d+: cannot read sample \d+ \(row \d+\).*"
                                                r"--verify --repair"):
        train.run(load_config(config_path, overrides + [run_dir_override(tmp_path / "stop")]))

    skipping = train.run(load_config(config_path, overrides + [run_dir_override(tmp_path / "skip"),
                                                               "train.skip_corrupt_shards=true"]))
    assert skipping.skipped_samples > 0 and skipping.steps > 0
    assert logged_metric(tmp_path / "skip", "skipped_samples") == skipping.skipped_samples
    printed = capsys.readouterr().out
    assert f"1 of {len(names)} planned shards are not complete" in printed
    last_lines = printed.strip().splitlines()[-2:]
    assert f"{skipping.skipped_samples} unreadable samples skipped; checkpoint {skipping.checkpoint}" in last_lines[0]
    assert last_lines[1].strip() == f"export it for serving: dflash export {skipping.checkpoint} EXPORT_DIR"

    cli = [sys.executable, "-m", "stages.cli", "inspect-cache", str(store), "--verify", "--repair"]
    repaired = subprocess.run(cli, capture_output=True, text=True)
    assert repaired.returncode == 1 and "repair: removed" in repaired.stdout
    extract.run(load_config(config_path, [f'store.path="{store}"']))
    assert subprocess.run(cli, capture_output=True, text=True).returncode == 0


def test_a_read_failure_saves_the_steps_trained_before_it(config_path, tmp_path, monkeypatch):
    from dflash.store.reader import StoreReader

    config = load_config(config_path, [run_dir_override(tmp_path / "run"), "train.save_every=100"])
    reads = []
    real_read = StoreReader.read_sample

    def failing_read(self, index):
        reads.append(index)
        if len(reads) > 12:  # a few steps in (2 micro-batches of a few samples each per step)
            raise CorruptShardError(f"shard b00-00000: cannot read sample {index} (row 1): crc32c mismatch")
        return real_read(self, index)

    monkeypatch.setattr(StoreReader, "read_sample", failing_read)
    with pytest.raises(CorruptShardError, match=r"Training stopped before step (\d+); saved .*step-0+(\d+)") as error:
        train.run(config)
    saved = latest_checkpoint(tmp_path / "run")
    assert saved is not None and str(saved) in str(error.value)
    assert f"before step {load_checkpoint(saved).step + 1}" in str(error.value)


def logged_metric(run_dir: Path, key: str):
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [line[key] for line in lines if key in line][-1]
