"""Metrics logging: JSONL lines, console lines, wandb offline and its failure path, throughput."""

import json
import sys
import types
import warnings

import pytest

from dflash.train.metrics import MetricsLogger


def read_lines(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_jsonl_lines_parse_and_console_line_is_compact(tmp_path, capsys):
    with MetricsLogger(tmp_path, use_wandb=False) as logger:
        logger.log(10, {"loss": 2.5, "lr": 6e-4})
        logger.log(20, {"loss": float("nan"), "acc": 0.25})
    lines = read_lines(tmp_path)
    assert [line["step"] for line in lines] == [10, 20]
    assert lines[0]["loss"] == 2.5 and lines[0]["lr"] == 6e-4 and isinstance(lines[0]["time"], float)
    assert lines[1]["loss"] is None and lines[1]["acc"] == 0.25  # NaN is written as null: strict JSON
    printed = capsys.readouterr().out.splitlines()
    assert printed == ["step 10 | loss 2.5000 | lr 6.00e-04", "step 20 | loss nan | acc 0.2500"]


def test_reopening_appends(tmp_path):
    for step in (1, 2):
        logger = MetricsLogger(tmp_path)
        logger.log(step, {"loss": 1.0})
        logger.close()
    assert [line["step"] for line in read_lines(tmp_path)] == [1, 2]


def test_non_writer_rank_writes_nothing(tmp_path, capsys):
    logger = MetricsLogger(tmp_path / "run", use_wandb=True, is_writer=False)
    logger.log(1, {"loss": 1.0})
    logger.close()
    assert not (tmp_path / "run").exists()
    assert capsys.readouterr().out == ""


def test_wandb_offline_writes_a_local_run(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb-dir"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    (tmp_path / "wandb-dir").mkdir()
    logger = MetricsLogger(tmp_path / "run", use_wandb=True, wandb_mode="online", project="dflash-test",
                           config={"train": {"lr": 1e-3}})
    assert logger.wandb_run is not None  # WANDB_MODE=offline overrode "online": no network needed
    logger.log(1, {"loss": 3.0})
    logger.log(2, {"loss": 2.0})
    logger.close()
    offline_runs = list((tmp_path / "wandb-dir" / "wandb").glob("offline-run-*"))
    assert len(offline_runs) == 1
    assert any(path.suffix == ".wandb" for path in offline_runs[0].iterdir())
    assert [line["loss"] for line in read_lines(tmp_path / "run")] == [3.0, 2.0]


def test_wandb_failure_warns_once_and_logging_continues(tmp_path, monkeypatch):
    def failing_init(**kwargs):
        raise RuntimeError("no API key")

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=failing_init))
    monkeypatch.delenv("WANDB_MODE", raising=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        logger = MetricsLogger(tmp_path, use_wandb=True, wandb_mode="online")
        logger.log(1, {"loss": 1.0})
        logger.log(2, {"loss": 0.5})
        logger.close()
    assert [str(w.message) for w in caught] == ["wandb could not start (online); continuing without it: no API key"]
    assert len(read_lines(tmp_path)) == 2


def test_bad_wandb_mode_is_refused(tmp_path):
    with pytest.raises(ValueError, match="wandb_mode must be one of"):
        MetricsLogger(tmp_path, use_wandb=True, wandb_mode="offlne")


def test_wandb_keeps_quiet_on_the_console(tmp_path, monkeypatch, capfd):
    """W&B's start and end banners would bury the run's own last lines; one line says where it is."""
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_SILENT", raising=False)
    logger = MetricsLogger(tmp_path / "run", use_wandb=True, wandb_mode="offline", project="dflash-test")
    logger.log(1, {"loss": 3.0})
    logger.close()
    output = capfd.readouterr()
    assert not [line for line in (output.out + output.err).splitlines() if line.startswith("wandb")]
    assert "W&B offline run in" in logger.where and "wandb sync" in logger.where
