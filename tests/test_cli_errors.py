"""Errors a user can act on: one `Error:` line and exit status 1, the traceback only with --debug;
config keys explained by `dflash config show`, typos answered with a suggestion."""

import errno
import os

import pytest
from click.testing import CliRunner

from dflash import config as config_module
from dflash.extract.writers import describe_failure
from stages.cli import main, one_line


def invoke(*args, env=None):
    return CliRunner().invoke(main, list(args), env={"DFLASH_DEBUG": "", **(env or {})})


def error_lines(result) -> list[str]:
    return [line for line in result.output.splitlines() if line.strip()]


def test_missing_store_is_one_error_line(tmp_path):
    result = invoke("stage2-train", "--set", f"store.path={tmp_path / 'nowhere'}", "--set", "train.wandb=disabled")
    assert result.exit_code == 1
    assert error_lines(result) == [f"Error: store.path: there is no store at {tmp_path / 'nowhere'}; "
                                   "`dflash stage1-extract` writes it"]


def test_a_directory_that_is_not_a_checkpoint_is_one_error_line(tmp_path):
    result = invoke("export", str(tmp_path), str(tmp_path / "out"))
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert error_lines(result) == [f"Error: {tmp_path} is not a complete checkpoint: state.json is missing"]


def test_debug_keeps_the_traceback(tmp_path):
    result = invoke("--debug", "export", str(tmp_path), str(tmp_path / "out"))
    assert result.exit_code == 1 and isinstance(result.exception, FileNotFoundError)
    assert invoke("export", str(tmp_path), str(tmp_path / "out"), env={"DFLASH_DEBUG": "1"}).exception is not None


def test_a_full_disk_names_where_it_was_writing():
    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    assert one_line(full, ["/data/store"]) == "no space left on the device writing /data/store (No space left on device)"
    named = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/data/store/shards/b00-00001/hidden/c/0/0")
    assert "/data/store/shards/b00-00001/hidden/c/0/0" in one_line(named, ["/data/store"])
    assert describe_failure(full, "/data/store") == "no space left on the device of /data/store (No space left on device)"


def test_unknown_keys_get_a_suggestion():
    with pytest.raises(config_module.ConfigError, match=r"train.lrr \(did you mean train.lr\?\)"):
        config_module.load_config(None, ["train.lrr=1"])
    with pytest.raises(config_module.ConfigError, match=r"trian \(did you mean train\?\)"):
        config_module.load_config(None, ["trian.lr=1"])
    result = invoke("config", "show", "--set", "data.max_lenght=5")
    assert result.exit_code == 1 and "did you mean data.max_length?" in result.output


def test_config_show_explains_every_key():
    rows = config_module.describe(config_module.load_config())
    keys = [key for key, *_ in rows]
    assert len(keys) == len(set(keys)) == sum(len(section.__dataclass_fields__) for section in
                                              config_module.Config().__dict__.values())
    assert all(meaning.strip() for *_, meaning in rows)  # each field's own `setting(...)` meaning
    result = invoke("config", "show", "--set", "train.max_steps=7")
    assert result.exit_code == 0
    for key in ("train.max_steps", "data.overlong", "train.skip_corrupt_shards", "train.attention"):
        assert key in result.output
    assert "7  (default 0)" in result.output


@pytest.mark.slow
def test_a_bad_row_in_strict_mode_and_a_store_mismatch_are_one_error_line(tmp_path, pipeline_config):
    config = pipeline_config(tmp_path, 3, 1, f"""
[store]
path = "{tmp_path / 'store'}"
bucket_edges = [64, 192, 320, 512]
shard_tokens = 4096
[extract]
batch_tokens = 2048
""")
    rows = (tmp_path / "rows.jsonl").read_text().splitlines()
    (tmp_path / "rows.jsonl").write_text("\n".join(rows[:2] + ['{"prompt": "no answer"}'] + rows[2:]) + "\n")
    strict = invoke("stage1-extract", "-c", str(config), "--set", "data.strict=true")
    assert strict.exit_code == 1 and "Traceback" not in strict.output
    assert [line for line in error_lines(strict) if line.startswith("Error")] == [
        f"Error: {tmp_path / 'rows.jsonl'} row 3: missing_fields (no messages/conversations/prompt+response in keys "
        f"['prompt']); fix the row, or set data.strict=false to skip and count bad rows"]
    assert invoke("stage1-extract", "-c", str(config)).exit_code == 0
    mismatch = invoke("stage1-extract", "-c", str(config), "--set", "store.codec=bf16")
    assert mismatch.exit_code == 1 and "Traceback" not in mismatch.output
    assert "Error: store" in mismatch.output and "codec: store has 'fp8', config gives 'bf16'" in mismatch.output
