"""Training checkpoints: bit-exact resume (AdamW + scheduler + RNG), atomicity, pruning."""

import random

import numpy as np
import pytest
import torch

from dflash.model.drafter import DFlashDrafter, block_positions, drafter_args
from dflash.model.masks import build_masks
from dflash.train.checkpoint import (capture_rng_states, flatten_optimizer_state, latest_checkpoint, load_checkpoint,
                                     restore_rng_states, save_checkpoint, unflatten_optimizer_state)


def build_training(seed: int):
    torch.manual_seed(seed)
    model = DFlashDrafter(drafter_args("tiny"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 3))
    return model, optimizer, scheduler


def train_step(model, optimizer, scheduler) -> None:
    """One step on inputs drawn from the global torch RNG (so a resume must restore it)."""
    args = model.args
    num_tokens, anchor_pos_A = 24, torch.tensor([2, 11])
    meta = {"doc_ids": torch.zeros(num_tokens, dtype=torch.long), "position_ids": torch.arange(num_tokens),
            "anchor_doc": torch.zeros(2, dtype=torch.long), "anchor_pos": anchor_pos_A}
    masks = build_masks(meta, args.layer_types, args.sliding_window, block_size=args.block_size, backend="dense")
    context_TF = torch.randn(num_tokens, args.context_feature_size)
    block_QH = torch.randn(2 * args.block_size, args.hidden_size)
    target_QH = torch.randn(2 * args.block_size, args.hidden_size)
    out_QH = model(context_TF, block_QH, meta["position_ids"], block_positions(anchor_pos_A, args.block_size), masks)
    loss = (out_QH - target_QH).pow(2).mean()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)


def save(run_dir, step, model, optimizer, scheduler, keep_last=3, **extra):
    return save_checkpoint(
        run_dir, step, model.state_dict(), optimizer.state_dict(), scheduler.state_dict(),
        data_cursor=extra.get("data_cursor", {"epoch": 0, "micro_batch": 7 * step}),
        rng_states=extra.get("rng_states", capture_rng_states()),
        config=extra.get("config", {"train": {"lr": 1e-2, "betas": [0.9, 0.95]}}),
        keep_last=keep_last, is_writer=extra.get("is_writer", True),
    )


def test_resume_continues_training_bit_exactly(tmp_path):
    model, optimizer, scheduler = build_training(seed=0)
    train_step(model, optimizer, scheduler)
    path = save(tmp_path, 1, model, optimizer, scheduler)
    after_save = (np.random.rand(), random.random())
    train_step(model, optimizer, scheduler)
    train_step(model, optimizer, scheduler)

    resumed, resumed_optimizer, resumed_scheduler = build_training(seed=123)  # different init
    checkpoint = load_checkpoint(latest_checkpoint(tmp_path))
    assert checkpoint.path == path and checkpoint.step == 1
    assert checkpoint.data_cursor == {"epoch": 0, "micro_batch": 7}
    assert checkpoint.config == {"train": {"lr": 1e-2, "betas": [0.9, 0.95]}}
    resumed.load_state_dict(checkpoint.model_state)
    resumed_optimizer.load_state_dict(checkpoint.optimizer_state)
    resumed_scheduler.load_state_dict(checkpoint.scheduler_state)
    restore_rng_states(checkpoint.rng_states)
    assert (np.random.rand(), random.random()) == after_save
    train_step(resumed, resumed_optimizer, resumed_scheduler)
    train_step(resumed, resumed_optimizer, resumed_scheduler)

    for (name, expected), actual in zip(model.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(expected, actual), name
    expected_tensors, expected_meta = flatten_optimizer_state(optimizer.state_dict())
    actual_tensors, actual_meta = flatten_optimizer_state(resumed_optimizer.state_dict())
    assert expected_meta == actual_meta
    for key, expected in expected_tensors.items():
        assert torch.equal(expected, actual_tensors[key]), key
    assert resumed_scheduler.get_last_lr() == scheduler.get_last_lr()


def test_optimizer_state_flattens_and_back_exactly():
    model, optimizer, scheduler = build_training(seed=0)
    train_step(model, optimizer, scheduler)
    original = optimizer.state_dict()
    tensors, meta = flatten_optimizer_state(original)
    assert set(tensors) == {f"state.{i}.{field}" for i in original["state"] for field in ("step", "exp_avg", "exp_avg_sq")}
    restored = unflatten_optimizer_state(tensors, meta)
    assert restored["param_groups"] == original["param_groups"]
    assert restored["param_groups"][0]["betas"] == (0.9, 0.95)
    for index, fields in original["state"].items():
        for name, value in fields.items():
            assert torch.equal(restored["state"][index][name], value), (index, name)


def test_named_parameter_groups_round_trip():
    layer = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(layer.named_parameters(), betas=(0.8, 0.9))
    layer(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    original = optimizer.state_dict()
    restored = unflatten_optimizer_state(*flatten_optimizer_state(original))
    assert restored["param_groups"] == original["param_groups"]  # param_names stays a list
    assert restored["param_groups"][0]["param_names"] == ["weight", "bias"]
    torch.optim.AdamW(layer.named_parameters()).load_state_dict(restored)


def test_files_are_safetensors_and_json_only(tmp_path):
    model, optimizer, scheduler = build_training(seed=0)
    train_step(model, optimizer, scheduler)
    path = save(tmp_path, 1, model, optimizer, scheduler)
    assert path == tmp_path / "checkpoints" / "step-00000001"
    assert sorted(p.name for p in path.iterdir()) == [
        "model.safetensors", "optimizer.safetensors", "rng.safetensors", "state.json"
    ]
    assert all(v.dtype == torch.float32 for v in load_checkpoint(path).model_state.values())


def small_state():
    layer = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(layer.parameters())
    layer(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    return layer.state_dict(), optimizer.state_dict()


def save_small(run_dir, step, keep_last=2, **kwargs):
    model_state, optimizer_state = small_state()
    defaults = dict(scheduler_state={"last_epoch": step}, data_cursor={"step": step},
                    rng_states={"torch": torch.get_rng_state()}, config={}, keep_last=keep_last)
    defaults.update(kwargs)
    return save_checkpoint(run_dir, step, model_state, optimizer_state, **defaults)


def test_keep_last_prunes_old_checkpoints(tmp_path):
    for step in range(1, 6):
        save_small(tmp_path, step * 10, keep_last=2)
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["step-00000040", "step-00000050"]
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoints" / "step-00000050"


def test_leftover_temp_and_incomplete_dirs_are_ignored(tmp_path):
    assert latest_checkpoint(tmp_path) is None
    save_small(tmp_path, 5)
    root = tmp_path / "checkpoints"
    crashed = root / ".tmp-step-00000009-abc"  # a save that died before its rename
    crashed.mkdir()
    (crashed / "model.safetensors").write_bytes(b"partial")
    (root / "step-00000012").mkdir()  # no state.json: not a checkpoint
    assert latest_checkpoint(tmp_path) == root / "step-00000005"
    save_small(tmp_path, 6)
    assert not crashed.exists()  # the next save clears stale temp dirs
    with pytest.raises(FileNotFoundError, match="step-00000012 is not a complete checkpoint"):
        load_checkpoint(root / "step-00000012")


def test_only_the_writer_writes(tmp_path):
    path = save_small(tmp_path, 3, is_writer=False)
    assert path == tmp_path / "checkpoints" / "step-00000003"
    assert not (tmp_path / "checkpoints").exists()


def test_resaving_a_step_replaces_it(tmp_path):
    save_small(tmp_path, 3, data_cursor={"pass": 1})
    path = save_small(tmp_path, 3, data_cursor={"pass": 2})
    assert load_checkpoint(path).data_cursor == {"pass": 2}
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step-00000003"]


def test_per_device_rng_lists_round_trip(tmp_path):
    device_states = [torch.arange(8, dtype=torch.uint8), torch.arange(8, 16, dtype=torch.uint8)]
    path = save_small(tmp_path, 1, rng_states={"cuda": device_states, "seed": 42})
    loaded = load_checkpoint(path).rng_states
    assert loaded["seed"] == 42
    assert len(loaded["cuda"]) == 2 and all(torch.equal(a, b) for a, b in zip(loaded["cuda"], device_states))


def test_unserialisable_state_fails_cleanly(tmp_path):
    with pytest.raises(TypeError, match="checkpoint state: object value"):
        save_small(tmp_path, 1, config={"bad": object()})
    assert list((tmp_path / "checkpoints").iterdir()) == []
    assert latest_checkpoint(tmp_path) is None


def test_checkpoints_and_exports_follow_the_umask(tmp_path):
    """Under umask 022 a plain file is 0644 and a directory 0755: a serving process of another
    user can read them (mkdtemp and safetensors alone would make them 0700 / 0600)."""
    import os
    import stat

    from dflash.model.drafter import DFlashDrafter, drafter_args
    from dflash.model.export import export_drafter

    previous = os.umask(0o022)
    try:
        model, optimizer, scheduler = build_training(seed=0)
        path = save(tmp_path / "run", 1, model, optimizer, scheduler)
        args = drafter_args("tiny")
        export = export_drafter(DFlashDrafter(args).state_dict(), args, tmp_path / "export")
    finally:
        os.umask(previous)
    for item in [path, *path.iterdir(), *export.iterdir()]:
        expected = 0o755 if item.is_dir() else 0o644
        assert stat.S_IMODE(item.stat().st_mode) == expected, item
