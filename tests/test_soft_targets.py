"""Soft targets (store.topk, train.distill_weight): the distillation term against a dense full-vocabulary
reference, the target's top-k against a full softmax, the arrays' round trip through the store, the
store identity of stores without them, and stage one -> inspect -> stage two on the tiny target."""

import numpy as np
import pytest
import torch

from dflash.config import load_config
from dflash.extract.target import topk_distribution
from dflash.model.loss import IGNORE_LABEL, block_soft_targets, dflash_loss, gamma_weights
from dflash.store import schema
from dflash.store.inspection import verify_store
from dflash.store.plan import ShardPlan
from dflash.store.reader import StoreReader
from dflash.store.writer import ShardWriter, create_or_open_store


def soft_problem(seed, num_anchors=6, block_size=8, hidden_size=16, vocab=40, k=5):
    """Random rows, labels with masked slots, and soft targets: k distinct ids per row with probabilities
    summing below 1 (zeros, repeated id 0, at the masked rows, as a store holds them)."""
    generator = torch.Generator().manual_seed(seed)
    rows = num_anchors * block_size
    hidden = torch.randn(rows, hidden_size, generator=generator, dtype=torch.float64)
    lm_head = torch.randn(vocab, hidden_size, generator=generator, dtype=torch.float64)
    labels = torch.randint(0, vocab, (num_anchors, block_size), generator=generator)
    valid = torch.rand(num_anchors, block_size, generator=generator) < 0.7
    valid[:, 0] = False
    labels = torch.where(valid, labels, IGNORE_LABEL)
    ids = torch.stack([torch.randperm(vocab, generator=generator)[:k] for _ in range(rows)])
    probs = torch.softmax(3 * torch.randn(rows, k + 1, generator=generator, dtype=torch.float64), -1)[:, :k]
    keep = valid.reshape(-1, 1)
    ids, probs = torch.where(keep, ids, 0), torch.where(keep, probs, 0.0)
    soft = (ids.view(num_anchors, block_size, k), probs.float().view(num_anchors, block_size, k))
    return hidden, lm_head, labels, valid, gamma_weights(block_size, 7.0), soft


def dense_distill(logits_QV, ids_Qk, probs_Qk, kind):
    """d(p, q) per row from the whole softmax: buckets the k ids and the rest, each summed directly."""
    q_QV = torch.softmax(logits_QV, -1)
    q_Qk = q_QV.gather(1, ids_Qk)
    in_top = torch.zeros_like(q_QV, dtype=torch.bool).scatter_(1, ids_Qk, True)
    q_rest = (q_QV * ~in_top).sum(-1)
    p_Qk = probs_Qk.double()
    p_rest = (1 - p_Qk.sum(-1)).clamp(min=0)
    if kind == "kl":
        return (torch.xlogy(p_Qk, p_Qk) - p_Qk * q_Qk.log()).sum(-1) + torch.xlogy(p_rest, p_rest) - p_rest * q_rest.log()
    return 0.5 * ((q_Qk - p_Qk).abs().sum(-1) + (q_rest - p_rest).abs())


def dense_objective(hidden, lm_head, labels, valid, weights, soft, distill_weight, kind, group=None, groups=1):
    logits = hidden @ lm_head.T
    ce = torch.nn.functional.cross_entropy(logits, labels.reshape(-1).clamp(min=0), reduction="none")
    ids, probs = (values.reshape(hidden.shape[0], -1) for values in soft)
    distill = dense_distill(logits, ids, probs, kind)
    w = (weights[None, :] * valid).reshape(-1).double()
    if group is None:
        return ((w * (ce + distill_weight * distill)).sum() / w.sum(), (w * ce).sum() / w.sum(),
                (w * distill).sum() / w.sum())
    row_group = group.repeat_interleave(labels.shape[1])
    totals = [torch.stack([(w * x)[row_group == g].sum() / w[row_group == g].sum() for g in range(groups)]).mean()
              for x in (ce + distill_weight * distill, ce, distill)]
    return tuple(totals)


@pytest.mark.parametrize("kind", ["kl", "tv"])
def test_compiled_distill_pass_equals_eager_on_two_row_counts(kind):
    """CUDA runs the compiled distillation pass (`_compiled_ce_distill_and_grad`); inductor on the CPU checks
    the same function against the eager one, with zero-filled masked rows, on two row counts (the second is
    the shape-generic recompile the last loss chunk triggers)."""
    from dflash.model.loss import _ce_distill_and_grad, _compiled_ce_distill_and_grad

    hidden, lm_head, labels, valid, weights, (ids, probs) = soft_problem(11, num_anchors=8, vocab=300, k=6)
    logits = (hidden @ lm_head.T).float()
    row_weight = (weights[None, :] * valid).reshape(-1).float()
    args = (logits, labels.reshape(-1).clamp(min=0), row_weight, ids.reshape(-1, 6), probs.reshape(-1, 6))
    compiled = _compiled_ce_distill_and_grad(0.7, kind, torch.float32)
    for rows in (64, 40):
        rows_args = [arg[:rows] for arg in args]
        eager = _ce_distill_and_grad(*rows_args, distill_weight=0.7, kind=kind)
        for want, got in zip(eager, compiled(*rows_args)):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["kl", "tv"])
@pytest.mark.parametrize("chunk_size", [3, 1000])
@pytest.mark.parametrize("fused", [False, True])
def test_distill_loss_and_gradients_equal_a_dense_reference(kind, chunk_size, fused):
    hidden, lm_head, labels, valid, weights, soft = soft_problem(chunk_size + 2 * fused + (kind == "tv"))
    group = torch.tensor([0, 0, 1, 1, 1, 0]) if fused else None
    grouping = {"group_A": group, "num_groups": 2} if fused else {}
    mine = hidden.clone().requires_grad_(True)
    out = dflash_loss(mine, lm_head, labels, valid, weights, chunk_size, soft_targets=soft, distill_weight=0.7,
                      distill=kind, **grouping)
    out.objective.backward()
    reference = hidden.clone().requires_grad_(True)
    objective, ce, distill = dense_objective(reference, lm_head, labels, valid, weights, soft, 0.7, kind,
                                             group, 2)
    objective.backward()
    # the loss computes in float32 from float64 inputs
    for value, expected in ((out.objective, objective), (out.loss, ce), (out.distill, distill),
                            (mine.grad, reference.grad)):
        torch.testing.assert_close(value.double(), expected.detach(), rtol=1e-5, atol=1e-6)
    assert not out.loss.requires_grad and distill > 0
    # Without the term the loss is the cross entropy alone, differentiable as before.
    plain = dflash_loss(hidden.clone().requires_grad_(True), lm_head, labels, valid, weights, chunk_size, **grouping)
    torch.testing.assert_close(plain.loss.double(), ce.detach(), rtol=1e-5, atol=1e-6)
    assert plain.distill is None and plain.objective is plain.loss and plain.loss.requires_grad


def test_block_soft_targets_read_each_slots_label_row():
    topk_ids = torch.arange(10 * 2).view(10, 2)
    topk_probs = torch.rand(10, 2)
    loss_mask = torch.tensor([0, 1, 1, 0, 1, 0, 1, 1, 0, 0])
    doc_ids = torch.tensor([0, 0, 0, 0, 0, 1, 1, 1, -1, -1])
    anchor_index, anchor_valid = torch.tensor([0, 2, 5]), torch.tensor([True, True, True])
    ids, probs = block_soft_targets(topk_ids, topk_probs, loss_mask, doc_ids, anchor_index, anchor_valid, 4)
    assert ids.shape == (3, 4, 2)
    assert ids[0, 1].tolist() == topk_ids[1].tolist() and ids[0, 2].tolist() == topk_ids[2].tolist()
    assert ids[0, 3].tolist() == [0, 0] and probs[0, 0].tolist() == [0.0, 0.0]  # masked slot, slot 0
    assert ids[2, 2].tolist() == topk_ids[7].tolist() and ids[2, 3].tolist() == [0, 0]  # not into padding


def test_topk_distribution_equals_the_full_softmax_in_vocabulary_chunks():
    generator = torch.Generator().manual_seed(0)
    hidden, head = torch.randn(13, 8, generator=generator), torch.randn(50, 8, generator=generator)
    ids, probs = topk_distribution(hidden, head, 6, rows=5, vocab=7)
    expected_probs, expected_ids = torch.softmax(hidden @ head.T, -1).topk(6, -1)
    assert ids.dtype == torch.int32 and torch.equal(ids.long(), expected_ids)
    torch.testing.assert_close(probs, expected_probs)


def test_probabilities_round_to_uint16_bits():
    probs = torch.tensor([0.0, 1.0, 0.5, 1 / 65535, 0.99999])
    bits = schema.probs_to_bits(probs).numpy().view(np.uint16)
    assert bits.tolist() == [0, 65535, 32768, 1, 65534]
    np.testing.assert_allclose(schema.bits_to_probs(bits), probs.numpy(), atol=0.5 / 65535)


def write_soft_shard(path, k=4, topk=True):
    """One shard of three samples through `ShardWriter`, with random soft targets; returns what went in."""
    from dflash.store.writer import WRITE_EVERY_CHUNK  # noqa: F401 (the writer's own module)

    rng = np.random.default_rng(0)
    lengths = np.array([7, 5, 9])
    plan = ShardPlan(name="b00-00000", bucket=0, sample_indices=[0, 1, 2], num_tokens=int(lengths.sum()))
    attrs = {"schema_version": schema.SCHEMA_VERSION, "codec": "bf16", "hidden_size": 4, "target_layer_ids": [0],
             "target": {"vocab_size": 100}, "max_length": 16, "bucket_edges": [1, 16],
             "shards": [{"name": plan.name, "bucket": 0, "num_samples": 3, "num_tokens": plan.num_tokens}]}
    if topk:
        attrs["topk"] = k
    root = create_or_open_store(str(path), attrs, overwrite=False)
    writer = ShardWriter(root, plan, lengths, np.arange(3), codec="bf16", num_layers=1, hidden_size=4,
                         rows_per_chunk=4, rows_per_zarr_shard=8, topk=k if topk else 0)
    written = []
    for i, length in enumerate(lengths):
        sample = {"hidden": rng.integers(0, 0x3F00, (length, 4)).astype(np.uint16),
                  "input_ids": rng.integers(0, 100, length).astype(np.int32),
                  "loss_mask": (rng.random(length) < 0.6).astype(np.uint8)}
        soft = {}
        if topk:
            probs = rng.dirichlet(np.ones(k + 1), length)[:, :k]
            soft = {"topk_ids": rng.integers(0, 100, (length, k)).astype(np.int32),
                    "topk_probs": schema.probs_to_bits(torch.from_numpy(probs)).numpy().view(np.uint16)}
        writer.write_sample(i, sample["hidden"], None, sample["input_ids"], sample["loss_mask"], **soft)
        written.append({**sample, **soft})
    writer.commit()
    return written


def test_topk_round_trips_through_the_store_bit_exactly_and_is_verified(tmp_path, capsys):
    from stages import inspect

    written = write_soft_shard(tmp_path / "store")
    reader = StoreReader(tmp_path / "store", soft_targets=True)
    assert reader.topk == 4
    for i, sample in enumerate(written):
        read = reader.read_sample(i)
        supervised = sample["loss_mask"].astype(bool)[:, None]
        assert read["topk_ids"].dtype == np.int32 and read["topk_probs"].dtype == np.uint16
        np.testing.assert_array_equal(read["topk_ids"], np.where(supervised, sample["topk_ids"], 0))
        np.testing.assert_array_equal(read["topk_probs"], np.where(supervised, sample["topk_probs"], 0))
    assert "topk_ids" not in StoreReader(tmp_path / "store").read_sample(0)  # only when asked
    result = inspect.run(tmp_path / "store", verify=True)
    assert result["ok"]
    assert "optional arrays: topk_ids, topk_probs (k=4)" in capsys.readouterr().out
    import zarr
    probs = zarr.open_group(str(tmp_path / "store"), mode="r+")["shards"]["b00-00000"]["topk_probs"]
    probs[2] = np.array([40000, 30000, 0, 0], dtype=np.uint16)  # sums above 1
    report = verify_store(tmp_path / "store")
    assert not report.ok and "topk_probs sum above 1" in report.bad["b00-00000"]


@pytest.mark.parametrize("override, key", [("store.topk=-1", "store.topk"),
                                           ("train.distill_weight=-0.5", "train.distill_weight"),
                                           ('train.distill="js"', "train.distill")])
def test_soft_target_settings_are_checked_by_key(override, key):
    from dflash.config import ConfigError

    with pytest.raises(ConfigError, match=key):
        load_config(None, [override])


def test_a_store_without_soft_targets_keeps_its_identity_and_is_refused_for_distillation(tmp_path):
    from dflash.store.schema import content_identity, diff_attrs

    plain, soft = load_config(None), load_config(None, ["store.topk=32"])
    assert "topk" not in content_identity(plain)["store"] and content_identity(soft)["store"]["topk"] == 32
    before = {"schema_version": 1, "content": content_identity(plain)}  # written before store.topk existed
    assert diff_attrs(before, {**before}) == {}
    assert set(diff_attrs(before, {**before, "topk": 32})) == {"topk"}
    write_soft_shard(tmp_path / "store", topk=False)
    reader = StoreReader(tmp_path / "store")
    assert reader.topk == 0 and "topk_ids" not in reader.read_sample(0)
    with pytest.raises(schema.StoreMismatchError, match="train.distill_weight: the store at .* holds no soft"):
        StoreReader(tmp_path / "store", soft_targets=True)


@pytest.fixture(scope="module")
def soft_store(tmp_path_factory, pipeline_config):
    """Stage one with store.topk = 8 on the embedded tiny target over a few offline rows."""
    from stages import extract

    root = tmp_path_factory.mktemp("soft")
    config_path = pipeline_config(root, 30, 10, f"""
[store]
path = "{root / 'store'}"
codec = "bf16"
topk = 8
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
distill_weight = 0.5
""")
    extract.run(load_config(config_path))
    return root, config_path


@pytest.mark.slow
def test_stage_one_stores_the_targets_next_token_top_k(soft_store, embedded_cache_dir, capsys):
    from transformers import AutoModelForCausalLM

    from stages import inspect

    root, _ = soft_store
    reader = StoreReader(root / "store", soft_targets=True)
    assert reader.topk == 8 and reader.attrs["content"]["store"]["topk"] == 8
    model = AutoModelForCausalLM.from_pretrained(embedded_cache_dir / "target-tiny", dtype=torch.float32).eval()
    for i in (0, len(reader) - 1):
        sample = reader.read_sample(i)
        with torch.no_grad():
            logits_TV = model(input_ids=torch.as_tensor(sample["input_ids"])[None]).logits[0]
        # row p: the distribution of the token at p, from the logits at p - 1 (as labels are aligned)
        expected_probs, expected_ids = torch.softmax(logits_TV[:-1], -1).topk(8, -1)
        supervised = np.flatnonzero(sample["loss_mask"])
        assert supervised.min() >= 1 and len(supervised) > 8
        np.testing.assert_allclose(schema.bits_to_probs(sample["topk_probs"][supervised]),
                                   expected_probs[supervised - 1].numpy(), atol=1e-4)
        agree = (sample["topk_ids"][supervised, :1] == expected_ids[supervised - 1, :1].numpy()).mean()
        assert agree > 0.98  # float32 rounding of the batched forward may only swap near-ties
        assert not sample["topk_ids"][~sample["loss_mask"]].any()  # zero-filled elsewhere
    assert inspect.run(root / "store", verify=True)["ok"]
    assert "optional arrays: topk_ids, topk_probs (k=8)" in capsys.readouterr().out


@pytest.mark.slow
def test_stage_two_trains_with_the_distillation_term(soft_store, tmp_path):
    from stages import train

    _, config_path = soft_store
    result = train.run(load_config(config_path, [f'train.out_dir="{tmp_path / "kl"}"']))
    assert result.steps == 2 and all(np.isfinite(result.losses))
    assert result.last_metrics["distill"] > 0 and "loss" in result.last_metrics
    tv = train.run(load_config(config_path, [f'train.out_dir="{tmp_path / "tv"}"', 'train.distill="tv"']))
    assert 0 < tv.last_metrics["distill"] <= 1
    # The same store trains without the term (its soft targets are not read).
    plain = train.run(load_config(config_path, [f'train.out_dir="{tmp_path / "plain"}"', "train.distill_weight=0"]))
    assert "distill" not in plain.last_metrics
    assert plain.losses[0] == pytest.approx(result.losses[0], rel=1e-5)  # loss stays the cross entropy


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", ["kl", "tv"])
def test_distill_loss_on_cuda_equals_the_dense_reference(kind):
    hidden, lm_head, labels, valid, weights, soft = soft_problem(5, num_anchors=64, vocab=3000, k=32)
    mine = hidden.float().cuda().requires_grad_(True)
    out = dflash_loss(mine, lm_head.float().cuda(), labels.cuda(), valid.cuda(), weights.cuda(), 100,
                      soft_targets=tuple(values.cuda() for values in soft), distill_weight=0.7, distill=kind)
    out.objective.backward()
    reference = hidden.clone().requires_grad_(True)
    objective, ce, distill = dense_objective(reference, lm_head, labels, valid, weights, soft, 0.7, kind)
    objective.backward()
    for value, expected in ((out.objective, objective), (out.loss, ce), (out.distill, distill),
                            (mine.grad, reference.grad)):
        torch.testing.assert_close(value.double().cpu(), expected.detach(), rtol=1e-4, atol=1e-5)
