"""What a new user hits (issue 38): each case one `Error:` line naming the key, file, row or path and
what to do, exit status 1, nothing half-written; Ctrl-C one line and status 130."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from dflash import config as config_module
from dflash.interrupts import EXIT_INTERRUPTED
from stages.cli import main

REPO = Path(__file__).resolve().parents[1]


def invoke(*args):
    return CliRunner().invoke(main, list(args), env={"DFLASH_DEBUG": ""})


def lines(result) -> list[str]:
    return [line for line in result.output.splitlines() if line.strip()]


@pytest.mark.parametrize("override, message", [
    ("train.lr=-1", "train.lr must be > 0, got -1.0"),
    ("train.lr=0", "train.lr must be > 0, got 0.0"),
    ("train.holdout_fraction=1", "train.holdout_fraction must be in [0, 1), got 1.0"),
    ("train.min_lr_ratio=1.5", "train.min_lr_ratio must be in [0, 1], got 1.5"),
    ("train.betas=[0.9, 1.0]", "train.betas must be in [0, 1), got (0.9, 1.0)"),
    ("train.clip=0", "train.clip must be > 0, got 0.0"),
    ("train.weight_decay=-0.1", "train.weight_decay must be >= 0, got -0.1"),
    ("train.seed=-3", "train.seed must be >= 0, got -3"),
    ("drafter.block_size=1", "drafter.block_size must be >= 2, got 1"),
    ("drafter.mask_token_id=-2", "drafter.mask_token_id must be >= -1, got -2"),
    ("store.bucket_edges=[0, 64, 1024]", "store.bucket_edges must be >= 1, got (0, 64, 1024)"),
    ("data.num_workers=-1", "data.num_workers must be >= 0, got -1"),
])
def test_config_show_refuses_a_value_out_of_its_keys_range(override, message):
    """The bounds live on each key's `setting(...)`: `config show` refuses what a stage would."""
    result = invoke("config", "show", "--set", override)
    assert result.exit_code == 1 and lines(result) == [f"Error: {message}"]


def test_every_default_is_inside_its_keys_bounds():
    for key, key_field in config_module.key_fields(config_module.Config()):
        default = key_field.default
        for value in default if isinstance(default, tuple) else (default,):
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                assert config_module.within_bounds(key_field.metadata, value), key


def test_an_unknown_key_is_one_error_line_with_status_1():
    result = invoke("config", "show", "--set", "train.lrr=1")
    assert result.exit_code == 1
    assert lines(result) == ["Error: unknown config key(s): train.lrr (did you mean train.lr?); "
                             "`dflash config show` lists every key"]


def test_a_bad_option_keeps_clicks_usage_status_2():
    result = invoke("config", "show", "--sett", "train.lr=1")
    assert result.exit_code == 2 and "No such option" in result.output


def test_export_of_a_missing_checkpoint_is_one_error_line(tmp_path):
    result = invoke("export", str(tmp_path / "nowhere"), str(tmp_path / "out"))
    assert result.exit_code == 1 and not (tmp_path / "out").exists()
    assert lines(result) == [f"Error: there is no checkpoint directory {tmp_path / 'nowhere'}; stage2-train writes "
                             f"them under train.out_dir/checkpoints (step-NNNNNNNN)"]


def test_inspect_cache_on_what_is_not_a_store_says_so(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    result = invoke("inspect-cache", str(empty), "--verify")
    assert result.exit_code == 1
    assert lines(result) == [f"Error: {empty} is not a dflash store (no zarr.json in it); `dflash stage1-extract` "
                             f"writes one at store.path"]
    afile = tmp_path / "notes.txt"
    afile.write_text("x")
    result = invoke("inspect-cache", str(afile))
    assert result.exit_code == 1 and len(lines(result)) == 1
    assert lines(result)[0].startswith(f"Error: {afile} is not a dflash store (a file;")


def test_eval_checks_the_drafter_before_loading_the_target(tmp_path, monkeypatch):
    from stages import evaluate

    def no_target(*args, **kwargs):
        raise AssertionError("the target was loaded before --drafter was checked")

    monkeypatch.setattr(evaluate, "prepare_checkpoint", no_target)
    result = invoke("eval", "--drafter", str(tmp_path / "missing"))
    assert result.exit_code == 1
    assert lines(result) == [f"Error: --drafter {tmp_path / 'missing'} does not exist; make one with "
                             f"`dflash export CHECKPOINT DIR`"]
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "config.json").write_text("{}")
    result = invoke("eval", "--drafter", str(tmp_path / "half"))
    assert result.exit_code == 1 and "is not a drafter export (no model.safetensors)" in result.output


def test_a_source_with_no_usable_row_writes_no_store(tmp_path, pipeline_config):
    config = pipeline_config(tmp_path, 1, 1, f'[store]\npath = "{tmp_path / "store"}"\n')
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"question {i}"}) + "\n" for i in range(3)))
    result = invoke("stage1-extract", "-c", str(config))
    assert result.exit_code == 1 and not (tmp_path / "store").exists()
    errors = [line for line in lines(result) if line.startswith("Error")]
    assert errors == [f"Error: data.source {rows}: all 3 rows are bad (3 missing_fields (e.g. row 1)); nothing was "
                      f"written. Fix the rows (data.strict=true stops at the first one and names its file), or the "
                      f"settings that drop them (data.max_length, data.overlong, drafter.block_size)"]


def test_strict_mode_names_the_file_and_its_row(tmp_path, pipeline_config):
    folder = tmp_path / "data"
    folder.mkdir()
    config = pipeline_config(tmp_path, 2, 1, f'[store]\npath = "{tmp_path / "store"}"\n')
    good = (tmp_path / "rows.jsonl").read_text().splitlines()
    (folder / "a.jsonl").write_text("\n".join(good[:2]) + "\n")
    (folder / "b.jsonl").write_text("\n".join([good[2], '{"prompt": "no answer"}']) + "\n")
    result = invoke("stage1-extract", "-c", str(config), "--set", f"data.source={json.dumps(str(folder))}",
                    "--set", "data.strict=true")
    assert result.exit_code == 1 and not (tmp_path / "store").exists()
    assert [line for line in lines(result) if line.startswith("Error")] == [
        f"Error: {folder / 'b.jsonl'} row 2: missing_fields (no messages/conversations/prompt+response in keys "
        f"['prompt']); fix the row, or set data.strict=false to skip and count bad rows"]


def test_ctrl_c_is_one_line_and_status_130(monkeypatch):
    from stages import extract

    def interrupted(config):
        raise KeyboardInterrupt

    monkeypatch.setattr(extract, "run", interrupted)
    result = invoke("stage1-extract")
    assert result.exit_code == EXIT_INTERRUPTED
    assert lines(result) == ["Interrupted: rerun the same command to resume (finished shards are kept, only missing "
                             "ones are written)"]


@pytest.mark.slow
def test_ctrl_c_of_stage_one_prints_no_traceback_from_any_process(tmp_path, pipeline_config):
    """A real SIGINT to the process group (as a terminal sends it) while the writers run."""
    config = pipeline_config(tmp_path, 12, 12, f'[store]\npath = "{tmp_path / "store"}"\nshard_tokens = 2048\n'
                                               f'[extract]\nbatch_tokens = 1024\nwriter_processes = 2\n')
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", "DFLASH_DEBUG": ""}
    proc = subprocess.Popen([sys.executable, "-m", "stages.cli", "stage1-extract", "-c", str(config)], cwd=tmp_path,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    output, progress_lines = [], 0
    for line in proc.stdout:  # text mode: the progress bar's carriage returns end lines too
        output.append(line)
        progress_lines += line.startswith("extract (rank")
        if progress_lines == 2:  # the first batches are with the writers
            os.killpg(proc.pid, signal.SIGINT)
            break
    output.append(proc.stdout.read())
    assert proc.wait(timeout=120) == EXIT_INTERRUPTED
    text = "".join(output)
    assert "Traceback" not in text and "KeyboardInterrupt" not in text and "Aborted" not in text
    assert text.rstrip().splitlines()[-1].startswith("Interrupted: rerun the same command to resume")


def test_help_lists_every_command_whole_and_export_names_its_files():
    result = invoke("--help")
    commands = result.output.split("Commands:")[1]
    assert result.exit_code == 0 and "..." not in commands  # click cuts a long first docstring line with "..."
    assert "Train the drafter from a stage-one store (no target needed)." in result.output
    assert "modeling_dflash.py" in " ".join(invoke("export", "--help").output.split())


def test_bucket_labels_say_what_each_bucket_holds():
    from dflash.store.inspection import COLUMN_LEGEND, bucket_range
    from dflash.store.plan import assign_bucket

    edges = [64, 192, 320, 512, 1024]
    assert [bucket_range(edges, b) for b in range(4)] == ["[0,192)", "[192,320)", "[320,512)", "[512,1024]"]
    assert assign_bucket(10, edges) == 0 and assign_bucket(1024, edges) == 3  # what the labels describe
    assert COLUMN_LEGEND.startswith("sup%: share of the tokens that are supervised")
