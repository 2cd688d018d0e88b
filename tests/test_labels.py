"""Target labels end to end on CPU: stage one stores the target's greedy next tokens, inspect
reports their agreement with the data, verification checks them, stage two trains against them.

The store comes from the embedded tiny Qwen3.5 target over real offline rows; the labels are
compared with an independent forward of the whole target (transformers' own LM head and argmax).
"""

import contextlib
import subprocess
import sys

import numpy as np
import pytest
import torch
import zarr

from dflash.config import load_config
from dflash.store.inspection import verify_store
from dflash.store.reader import StoreReader
from dflash.train import sizing
from dflash.train import step as train_step
from stages import extract, inspect, train

pytestmark = pytest.mark.slow


@contextlib.contextmanager
def untrained_drafter(config_path, reader):
    """(dist, drafter args, model, train context) of the config's drafter on the CPU, freshly initialised."""
    from dflash.dist import init_distributed, shutdown

    config = load_config(config_path)
    dist = init_distributed("cpu")
    try:
        args = sizing.build_drafter_args(config, reader.attrs)
        yield dist, args, train_step.build_model(config, args, dist), train_step.build_context(config, args, reader,
                                                                                               dist)
    finally:
        shutdown(dist)


@pytest.fixture(scope="module")
def labelled(tmp_path_factory, pipeline_config):
    root = tmp_path_factory.mktemp("labels")
    config_path = pipeline_config(root, 30, 10, f"""
[store]
path = "{root / 'store'}"
labels = "target"
codec = "bf16"
bucket_edges = [64, 192, 320, 512]
shard_tokens = 4096
[extract]
batch_tokens = 2048
[drafter]
size = "auto"
num_layers = 1
[train]
out_dir = "{root / 'run'}"
epochs = 1
max_steps = 2
token_budget = 512
accum_steps = 2
max_anchors = 8
loss_chunk = 512
holdout_fraction = 0.2
log_every = 1
save_every = 2
num_workers = 0
wandb = "disabled"
""")
    extract.run(load_config(config_path))
    return root, config_path


def test_stored_labels_are_the_targets_argmax_after_the_data_prefix(labelled, embedded_cache_dir):
    from transformers import AutoModelForCausalLM

    root, _ = labelled
    reader = StoreReader(root / "store")
    assert reader.has_labels and reader.attrs["labels"] == "target"
    model = AutoModelForCausalLM.from_pretrained(embedded_cache_dir / "target-tiny", dtype=torch.float32).eval()
    checked = 0
    for i in np.linspace(0, len(reader) - 1, 6).astype(int):  # six samples across the shards
        sample = reader.read_sample(i)
        with torch.no_grad():
            logits_TV = model(input_ids=torch.as_tensor(sample["input_ids"])[None]).logits[0]
        expected = np.concatenate([sample["input_ids"][:1], logits_TV[:-1].argmax(dim=-1).numpy()])
        differ = np.flatnonzero(sample["labels"] != expected)
        # Stage one ran the sequence in a padded batch: float32 rounding may only flip exact near-ties.
        gaps = (logits_TV[differ - 1].max(dim=-1).values - logits_TV[differ - 1, sample["labels"][differ]]).numpy()
        assert np.all(gaps < 1e-5), f"sample {i}: labels differ at {differ[:5]} by logit gaps {gaps[:5]}"
        assert len(differ) <= len(expected) // 100, f"sample {i}: {len(differ)} labels differ"
        checked += len(expected)
    assert checked > 600


def test_inspect_reports_label_agreement_and_verify_checks_labels(labelled, capsys):
    root, _ = labelled
    result = inspect.run(root / "store", verify=True)
    assert result["ok"]
    out = capsys.readouterr().out
    assert "labels: the target's greedy tokens (store.labels = target)" in out
    reader = StoreReader(root / "store")
    same = total = 0
    for i in range(len(reader)):
        sample = reader.read_sample(i)
        supervised = sample["loss_mask"].copy()
        supervised[0] = False
        same += int((sample["labels"] == sample["input_ids"])[supervised].sum())
        total += int(supervised.sum())
    assert result["stats"]["label_agreement"] == pytest.approx(same / total)
    assert f"{same / total:.1%} of the supervised positions" in out

    # A label outside the vocabulary is caught like a bad checksum.
    copy = root / "broken"
    subprocess.run(["cp", "-r", str(root / "store"), str(copy)], check=True)
    name = reader.shard_names[0]
    labels = zarr.open_group(str(copy), mode="r+")["shards"][name]["labels"]
    labels[3] = 248320
    report = verify_store(copy)
    assert not report.ok and "target labels outside the vocabulary" in report.bad[name]


def test_stage_two_trains_against_the_target_labels(labelled, tmp_path):
    root, config_path = labelled
    result = train.run(load_config(config_path, [f'train.out_dir="{tmp_path / "run"}"']))
    assert result.checkpoint is not None and result.steps == 2
    refused = subprocess.run([sys.executable, "-m", "stages.cli", "stage2-train", "-c", str(config_path),
                              "--set", "store.labels=data", "--set", f'train.out_dir="{tmp_path / "other"}"'],
                             capture_output=True, text=True)
    assert refused.returncode == 1
    assert refused.stderr.strip().splitlines()[-1] == (
        f"Error: store.labels: the store at {root / 'store'} holds target labels, the config asks for data; "
        f"run stage one with store.labels = data (into another store.path) or set store.labels = target")


def test_the_loss_reads_the_stored_labels_not_the_data_tokens(labelled):
    """The same micro-batch with its labels replaced by the data tokens gives another loss."""
    from dflash.train.batch import StoreDataset, collate_packed

    root, config_path = labelled
    reader = StoreReader(root / "store")
    items = [StoreDataset(reader, max_anchors=8, seed=0)[(0, i)] for i in range(3)]
    batch = collate_packed(items, pad_multiple=16)
    np.testing.assert_array_equal(batch["labels"][:int(batch["num_real_tokens"])].numpy(),
                                  np.concatenate([item["labels"] for item in items]))
    assert not torch.equal(batch["labels"], batch["input_ids"])
    with untrained_drafter(config_path, reader) as (_, _, model, ctx), torch.no_grad():
        stored = train_step.forward_loss(model, ctx, batch)[0].loss
        as_data = dict(batch, labels=batch["input_ids"])
        data = train_step.forward_loss(model, ctx, as_data)[0].loss
        without = train_step.forward_loss(model, ctx, {k: v for k, v in batch.items() if k != "labels"})[0].loss
    assert torch.equal(data, without) and not torch.equal(stored, data)


def test_the_held_out_tau_as_served_packed_equals_each_answer_walked_alone(labelled, monkeypatch):
    """`evaluate_served` over packed micro-batches gives the walk of each answer evaluated on its own (the
    acceptance at every window position, then `serve_walk`); `read_tokens` reads what `read_sample` does.
    An untrained drafter accepts nothing, so the slots' correctness is made a function of their labels
    (about 3 in 4 correct), the same in both paths: the walks then take steps of every length."""
    from dflash.model.anchors import eligible_anchors
    from dflash.model.loss import block_labels

    forward_loss = train_step.forward_loss

    def forward_with_correct_by_label(model, ctx, batch):
        out, valid_AB = forward_loss(model, ctx, batch)
        labels_AB, _ = block_labels(batch["labels"], batch["loss_mask"], batch["doc_ids"], batch["anchor_index"],
                                    batch["anchor_valid"], valid_AB.shape[1])
        out.correct = (labels_AB % 4 != 0) & valid_AB
        return out, valid_AB

    monkeypatch.setattr(train_step, "forward_loss", forward_with_correct_by_label)
    from dflash.train import served
    from dflash.train.batch import StoreDataset, collate_packed

    root, config_path = labelled
    reader = StoreReader(root / "store")
    indices = list(range(min(len(reader), 9)))
    for tokens, sample in zip(reader.read_tokens(indices[::-1]), [reader.read_sample(i) for i in indices[::-1]]):
        for key in ("input_ids", "loss_mask", "labels"):
            np.testing.assert_array_equal(tokens[key], sample[key])
    window = 24
    dataset = StoreDataset(reader, max_anchors=32, seed=0, served_tokens=window)
    item = dataset[(0, 0)]
    start = served.answer_start(item["loss_mask"])
    assert item["anchors"].tolist() == [a for a in eligible_anchors(item["loss_mask"]).tolist()
                                        if start <= a < start + window]
    with untrained_drafter(config_path, reader) as (dist, args, model, ctx):
        collate = lambda items: collate_packed(items, pad_multiple=16, block_size=args.block_size)  # noqa: E731
        packed = train_step.evaluate_served(dist, model, ctx, dataset, collate, [indices[:4], indices[4:]], window)
        lengths = []
        with torch.no_grad():
            for i in indices:
                one = dataset[(0, i)]
                out, valid_AB = train_step.forward_loss(model, ctx, collate([one]))
                accepted = served.accepted_lengths(out.correct, valid_AB)[:len(one["anchors"])].tolist()
                lengths += served.serve_walk(dict(zip(one["anchors"].tolist(), accepted)), served.answer_start(
                    one["loss_mask"]), served.answer_end(one["loss_mask"]), window)
    assert len(set(lengths)) > 3  # steps of several lengths
    assert packed["served_answers"] == len(indices)
    assert packed["served_tau"] == pytest.approx(sum(lengths) / len(lengths))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_fused_step_gives_the_loss_and_gradients_of_its_micro_batches_one_at_a_time(labelled, seed):
    """train.fuse_accum against the unfused step on fresh random drafters: the step's micro-batches (several
    length buckets) packed as one give the loss the unfused step averages over them, and the same gradients."""
    from dflash.train.batch import StoreDataset, collate_packed
    from dflash.train.sampler import build_epoch_schedule

    root, config_path = labelled
    reader = StoreReader(root / "store")
    torch.manual_seed(seed)
    with untrained_drafter(config_path, reader) as (dist, args, model, ctx):
        dataset = StoreDataset(reader, max_anchors=8, seed=seed)
        schedule = build_epoch_schedule(reader.index["length"], reader.index["bucket"], 512, 1, 3, seed, 0)
        collate = lambda items: collate_packed(items, pad_multiple=16, block_size=args.block_size)  # noqa: E731
        micro_batches = schedule.step(0)[0]
        assert len({int(reader.index["bucket"][group[0]]) for group in micro_batches}) > 1  # lengths mixed

        def loss_and_grads(batches):
            model.zero_grad(set_to_none=True)
            total = 0.0
            for batch in batches:
                out, _ = train_step.forward_loss(model, ctx, batch)
                (out.loss / len(batches)).backward()
                total += float(out.loss.detach()) / len(batches)
            return total, [parameter.grad.clone() for parameter in model.parameters()]

        one_at_a_time = [collate([dataset[(0, int(i))] for i in samples]) for samples in micro_batches]
        fused = collate([dataset[(0, int(i), group)] for group, samples in enumerate(micro_batches) for i in samples])
        assert fused["group_buckets"] == [int(batch["bucket"]) for batch in one_at_a_time]
        loss, grads = loss_and_grads(one_at_a_time)
        fused_loss, fused_grads = loss_and_grads([fused])
        assert fused_loss == pytest.approx(loss, rel=1e-5) and loss > 0
        for grad, fused_grad in zip(grads, fused_grads):
            torch.testing.assert_close(fused_grad, grad, rtol=1e-4, atol=1e-7)
        # A plain mean over the fused micro-batch weighs the micro-batches by their anchors: not the same loss.
        out, _ = train_step.forward_loss(model, ctx, {k: v for k, v in fused.items() if k != "anchor_group"})
        assert float(out.loss.detach()) != pytest.approx(loss, rel=1e-5)


def test_stage_two_fused_trains_as_unfused(labelled, tmp_path):
    """The trainer with train.fuse_accum: the same steps over the same samples, the same losses and, after
    them, the same weights as without (up to float rounding)."""
    from dflash.train.checkpoint import load_checkpoint

    root, config_path = labelled
    runs = {}
    for fuse in (False, True):
        out = tmp_path / f"fuse-{fuse}"
        overrides = [f'train.out_dir="{out}"', f"train.fuse_accum={str(fuse).lower()}"]
        runs[fuse] = train.run(load_config(config_path, overrides))
    plain, fused = runs[False], runs[True]
    assert fused.steps == plain.steps == 2 and fused.tokens_seen == plain.tokens_seen
    assert fused.losses == pytest.approx(plain.losses, rel=1e-5)
    weights = [load_checkpoint(run.checkpoint).model_state for run in (plain, fused)]
    for name, value in weights[0].items():
        # atol 1e-5 (under 2% of one AdamW update at lr 6e-4): Adam divides by sqrt(v), so a near-zero
        # gradient's float rounding (fused sums in another order) moves its element by ~1e-6 (torch 2.13).
        torch.testing.assert_close(weights[1][name], value, rtol=1e-4, atol=1e-5, msg=name)
