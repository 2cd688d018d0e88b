"""The CUDA paths against their plain references, on fresh random inputs (skipped without CUDA).

- flex attention with its BlockMask (from the collate's tiles, or compiled create_block_mask) vs the
  dense SDPA mask, through the training forward and backward of a tiny drafter;
- the compiled drafter layers (`train.compile`) vs eager, one optimizer step each;
- a fused step (`train.fuse_accum`) vs its micro-batches one after the other, compiled;
- stage one's capture with the fp8 codec encoded on the GPU vs the same features encoded on
  the CPU, and target labels on the GPU vs the model's own argmax.
Run on a GPU machine: `pytest -m gpu`.
"""

import functools
from pathlib import Path

import numpy as np
import pytest
import torch

from dflash.model.drafter import DFlashDrafter, compile_layers, drafter_args
from dflash.model import masks as dflash_masks
from dflash.model.loss import gamma_weights
from dflash.model.masks import layer_windows
from dflash.model.tiles import TILE
from dflash.train.batch import StoreDataset, collate_packed
from dflash.train.step import (TrainContext, checkpointed_forward, evaluation_mode, forward_loss, step_weights,
                               to_device, train_step)
from support import PlainDescent

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

NUM_LAYERS, HIDDEN, VOCAB = 3, 64, 512


class RandomReader:
    """A StoreReader stand-in: random bf16 features, ids and loss masks of the tiny drafter's shape."""

    def __init__(self, lengths, seed: int):
        rng = np.random.default_rng(seed)
        self.attrs = {"codec": "bf16"}
        self.samples = []
        for row_id, length in enumerate(lengths):
            features = torch.randn(length, NUM_LAYERS * HIDDEN, generator=torch.Generator().manual_seed(seed + row_id))
            self.samples.append({
                "hidden": features.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16),
                "scale": None, "labels": None,
                "input_ids": rng.integers(0, VOCAB, length).astype(np.int64),
                "loss_mask": rng.random(length) < 0.7,
                "row_id": row_id,
            })
        self.index = {"bucket": np.zeros(len(lengths), dtype=np.int64)}

    def __len__(self):
        return len(self.samples)

    def read_sample(self, i):
        return dict(self.samples[i])


def random_items(seed: int, group: int | None = None) -> list[dict]:
    """Six random samples' dataset items (each keyed with `group`, a fused step's micro-batch, when given)."""
    rng = np.random.default_rng(seed)
    reader = RandomReader(rng.integers(40, 400, 6).tolist(), seed)
    keys = [(0, i) if group is None else (0, i, group) for i in range(len(reader))]
    return [StoreDataset(reader, max_anchors=32, seed=seed)[key] for key in keys]


def micro_batch(seed: int, device, masks: str = "tiles", items: list[dict] | None = None, tile: int = TILE) -> dict:
    """A packed micro-batch (of `items`, else `random_items(seed)`); `masks`: "tiles", the block-mask tiles
    the trainer's loader lays out; "gathered", over each query tile's own context keys; "rule", none
    (create_block_mask builds them)."""
    items = random_items(seed) if items is None else items
    args = drafter_args("tiny")
    windows = layer_windows(args.layer_types, args.sliding_window) if masks != "rule" else None
    return to_device(collate_packed(items, pad_multiple=128, block_size=args.block_size, mask_windows=windows,
                                    gather_keys=masks == "gathered", mask_tile=tile), device)


def context(backend: str, device, seed: int = 0, dtype=torch.bfloat16, **overrides) -> TrainContext:
    generator = torch.Generator().manual_seed(seed)
    args = drafter_args("tiny", mask_token_id=VOCAB - 1, vocab_size=VOCAB, **overrides)
    return TrainContext(args=args, codec="bf16",
                        embed_VH=(0.02 * torch.randn(VOCAB, HIDDEN, generator=generator)).to(device, dtype),
                        lm_head_VH=(0.02 * torch.randn(VOCAB, HIDDEN, generator=generator)).to(device, dtype),
                        weights_B=gamma_weights(args.block_size, 7.0, device=device), backend=backend,
                        loss_chunk=256, device=device)


def fresh_drafter(args, device) -> DFlashDrafter:
    torch.manual_seed(0)
    return DFlashDrafter(args).to(device)


def assert_flex_step_equals_dense(batch: dict, device, backend_under_test: str = "flex", checkpointing: bool = False,
                                  **overrides) -> None:
    """The training step's loss and gradients under flex attention (or `backend_under_test`, its layers'
    activations recomputed in the backward with `checkpointing`, as `train.activation_checkpointing` trains) equal
    the dense mask's (SDPA)."""
    results = {}
    for backend in ("dense", backend_under_test):
        ctx = context(backend, device, **overrides)
        model = fresh_drafter(ctx.args, device)
        if checkpointing and backend == backend_under_test:
            for layer in model.layers:
                layer.forward = functools.partial(checkpointed_forward, layer.forward)
        out, _ = forward_loss(model, ctx, batch)
        out.loss.backward()
        results[backend] = (out.loss.detach().float(), [p.grad.float() for p in model.parameters()])
    exact = overrides.get("dtype") == torch.float32  # bf16 on the GPU
    torch.testing.assert_close(results[backend_under_test][0], results["dense"][0], rtol=1e-5 if exact else 2e-3,
                               atol=1e-5 if exact else 2e-3)
    for flex_grad, dense_grad in zip(results[backend_under_test][1], results["dense"][1]):
        torch.testing.assert_close(flex_grad, dense_grad, rtol=1e-4 if exact else 5e-2, atol=1e-6 if exact else 5e-3)


@pytest.mark.parametrize("kernel", ["default", "small-head"])
@pytest.mark.parametrize("masks", ["tiles", "gathered", "rule"])
@pytest.mark.parametrize("seed", range(3))
def test_flex_attention_equals_dense_sdpa_in_the_training_step(seed, masks, kernel, monkeypatch):
    """Every way of building the flex block masks (the collate's tiles, over gathered keys,
    create_block_mask), under inductor's default kernel tiles and the small heads' ones
    (`masks.SMALL_HEAD_OPTIONS`), gives the dense mask's loss and gradients."""
    # The head dim below which the small heads' tiles apply: none (inductor's defaults) or every head.
    monkeypatch.setattr(dflash_masks, "SMALL_HEAD_DIM", 0 if kernel == "default" else 1 << 20)
    device = torch.device("cuda")
    batch = micro_batch(seed, device, masks)
    assert_flex_step_equals_dense(batch, device)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("seed", range(2))
def test_blockwise_kernels_equal_dense_sdpa_in_the_training_step(seed, head_dim):
    """dflash's own kernels (`train.attention = "blockwise"`) in the training step, bf16: the dense mask's
    loss and gradients (tests/test_block_attention.py checks the kernels alone, fp32, on fresh batches)."""
    device = torch.device("cuda")
    batch = micro_batch(seed, device, "rule")
    assert_flex_step_equals_dense(batch, device, backend_under_test="blockwise", head_dim=head_dim)


def check_blockwise_under_activation_checkpointing(device: str) -> None:
    """The blockwise kernels with each layer's activations recomputed in the backward (the custom op run again
    under torch.utils.checkpoint) give the dense mask's loss and gradients; float32 off CUDA (Triton's
    interpreter, tests/test_block_attention.py)."""
    device = torch.device(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    assert_flex_step_equals_dense(micro_batch(1, device, "rule"), device, backend_under_test="blockwise",
                                  checkpointing=True, dtype=dtype)


def test_blockwise_kernels_under_activation_checkpointing_equal_dense_sdpa():
    check_blockwise_under_activation_checkpointing("cuda")


@pytest.mark.parametrize("seed", range(2))
def test_the_triton_cross_entropy_pass_trains_as_the_compiled_one(seed):
    """`train.loss_kernel = "triton"` in the training step: the loss, accuracy and gradients of inductor's pass
    (`"compiled"`), on a fresh micro-batch."""
    device = torch.device("cuda")
    batch = micro_batch(seed, device)
    results = {}
    for kernel in ("compiled", "triton"):
        ctx = context("flex", device, seed=seed)
        ctx.loss_kernel = kernel
        model = fresh_drafter(ctx.args, device)
        out, valid = forward_loss(model, ctx, batch)
        out.loss.backward()
        results[kernel] = (out.loss.detach().float(), out.correct, [p.grad.float() for p in model.parameters()])
    torch.testing.assert_close(results["triton"][0], results["compiled"][0], rtol=1e-4, atol=1e-4)
    assert torch.equal(results["triton"][1], results["compiled"][1])
    for ours, theirs in zip(results["triton"][2], results["compiled"][2]):
        torch.testing.assert_close(ours, theirs, rtol=1e-2, atol=1e-4)


def test_the_blockwise_kernels_and_their_launchers_are_kept_for_a_new_machine(tmp_path, monkeypatch):
    """After a blockwise step, every kernel dflash launched has its files (where it was compiled: an earlier
    test's cache may hold some) and its C launcher in Triton's cache (`compile_cache.kernel_entries`), and the
    kept tar writes them byte for byte into an empty cache."""
    from dflash.train import compile_cache

    device = torch.device("cuda")
    assert_flex_step_equals_dense(micro_batch(0, device, "rule"), device, backend_under_test="blockwise")
    kernels = compile_cache.compiled_own_kernels()
    names = {kernel.name for kernel in kernels}
    assert {"forward_kernel", "dq_kernel", "dkdv_kernel"} <= names, names
    cache = compile_cache.triton_cache_dir()
    entries = compile_cache.kernel_entries(kernels, cache)
    launchers = [e for e in entries if e["group"] is None]
    assert len(launchers) >= 1 and all(Path(path).is_file() for e in entries for path in e["files"].values())
    assert all(compile_cache.launcher_entry(kernel) is not None for kernel in kernels)
    tar = tmp_path / "compile-artifacts.triton.tar"
    assert compile_cache.save_triton_kernels(tar, kernels) > 0
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "new-cache"))
    assert compile_cache.restore_triton_kernels(tar) == len([e for e in entries if e["group"]])
    for entry in entries:
        for name, path in entry["files"].items():
            assert (tmp_path / "new-cache" / entry["dir"] / name).read_bytes() == open(path, "rb").read()


@pytest.mark.parametrize("seed", range(2))
def test_small_heads_over_64_key_mask_tiles_equal_dense_sdpa(seed):
    """64-dim heads under the small heads' kernel tiles over 64 x 64 mask tiles (their default since 12-06;
    torch's backward lowering needs `masks.backward_configs_follow_options` for them): the dense mask's
    loss and gradients, compiled flex forward and backward."""
    device = torch.device("cuda")
    batch = micro_batch(seed, device, tile=64)
    assert_flex_step_equals_dense(batch, device, head_dim=64)


@pytest.mark.parametrize("norms", [False, True])
def test_compiled_layers_equal_eager_over_one_optimizer_step(norms, monkeypatch):
    """One `train_step` (two micro-batches, clip, update) each way. Gradient descent at lr 1 makes each
    parameter's update its clipped gradient, so the updates compare the gradients themselves; Adam's
    first step would turn every near-zero gradient into a +-lr step whose sign is rounding noise. With `norms`
    the model's two norms are compiled too (`drafter.COMPILE_NORMS`)."""
    from dflash.model import drafter as drafter_module

    monkeypatch.setattr(drafter_module, "COMPILE_NORMS", norms)
    device = torch.device("cuda")
    batches = [micro_batch(10, device), micro_batch(11, device)]
    after = {}
    for compiled in (False, True):
        ctx = context("flex", device)
        model = fresh_drafter(ctx.args, device)
        before = [p.detach().float().clone() for p in model.parameters()]
        if compiled:
            compile_layers(model)
        optimizer = PlainDescent(model.parameters())
        stats = train_step(model, ctx, batches, optimizer, lr=1.0, clip=1.0, step=1)
        updates = [p.detach().float() - start for p, start in zip(model.parameters(), before)]
        after[compiled] = (float(stats.values[0]) / stats.micro_batches, float(stats.grad_norm), updates)
    assert after[True][0] == pytest.approx(after[False][0], rel=5e-3)
    assert after[True][1] == pytest.approx(after[False][1], rel=1e-2)
    for index, (compiled_update, eager_update) in enumerate(zip(after[True][2], after[False][2])):
        gap = (compiled_update - eager_update).norm() / eager_update.norm().clamp_min(1e-12)
        assert gap < 2e-2, f"parameter {index}: the compiled update differs from eager by {gap:.2e} of its norm"


def compiled_step(ctx: TrainContext, batches: list[dict]) -> tuple:
    """A fresh drafter with compiled layers after one `train_step` over `batches` at lr 1 (plain descent, so each
    update is the clipped gradient): `(model, mean micro-batch loss, each parameter's update)`."""
    model = fresh_drafter(ctx.args, ctx.device)
    before = [p.detach().float().clone() for p in model.parameters()]
    compile_layers(model)
    stats = train_step(model, ctx, batches, PlainDescent(model.parameters()), lr=1.0, clip=1.0, step=1)
    updates = [p.detach().float() - start for p, start in zip(model.parameters(), before)]
    return model, float(stats.values[0]) / stats.micro_batches, updates


def test_a_fused_step_equals_its_micro_batches_one_at_a_time_compiled():
    """train.fuse_accum on the trainer's GPU path (flex from the collate's tiles, compiled layers): two
    micro-batches packed as one give the loss and the update of the two run one after the other."""
    device = torch.device("cuda")
    apart = [micro_batch(20, device), micro_batch(21, device)]
    fused = [micro_batch(0, device, items=random_items(20, group=0) + random_items(21, group=1))]
    after = {name: compiled_step(context("flex", device), batches)[1:]
             for name, batches in (("apart", apart), ("fused", fused))}
    assert after["fused"][0] == pytest.approx(after["apart"][0], rel=5e-3)
    for index, (fused_update, apart_update) in enumerate(zip(after["fused"][1], after["apart"][1])):
        gap = (fused_update - apart_update).norm() / apart_update.norm().clamp_min(1e-12)
        assert gap < 2e-2, f"parameter {index}: the fused update differs from the two micro-batches' by {gap:.2e}"


def test_weights_cast_once_train_as_casting_at_each_use_compiled():
    """`TrainContext.cast_weights_once` (each step's micro-batches share one bf16 cast of each weight) on the
    compiled GPU step: the loss and the update of casting inside the compiled halves at every micro-batch; a
    held-out pass after it reuses its graphs."""
    from torch._dynamo.utils import counters

    device = torch.device("cuda")
    batches = [micro_batch(30, device), micro_batch(31, device), micro_batch(32, device)]
    after = {}
    for once in (False, True):
        torch._dynamo.reset()
        counters.clear()
        ctx = context("flex", device)
        ctx.cast_weights_once = once
        model, loss, updates = compiled_step(ctx, batches)
        after[once] = (loss, updates)
        torch.cuda.synchronize()
        trained = counters["stats"]["unique_graphs"]
        held_out, grad_mode = evaluation_mode(model)
        with grad_mode, step_weights(held_out, ctx):
            forward_loss(held_out, ctx, batches[0])
        torch.cuda.synchronize()
        assert counters["stats"]["unique_graphs"] == trained, f"cast once {once}: the held-out pass compiled more"
    # The same bf16 operands; the matmuls may see them in another layout (cuBLAS's order of sums), hence not exact;
    # one micro-batch's gradients lost or added twice would be a third of the update.
    assert after[True][0] == pytest.approx(after[False][0], rel=5e-3)
    for index, (once_update, plain_update) in enumerate(zip(after[True][1], after[False][1])):
        gap = (once_update - plain_update).norm() / plain_update.norm().clamp_min(1e-12)
        assert gap < 1e-2, f"parameter {index}: the update with the weights cast once differs by {gap:.2e}"


def test_the_compiled_step_compiles_nothing_more_for_micro_batches_of_other_shapes():
    """Compiled layers, flex attention and the loss have their row axes dynamic from the first step
    (issue 25): micro-batches of three other shapes after the first add no graph, nor does a held-out pass."""
    from torch._dynamo.utils import counters

    device = torch.device("cuda")
    torch._dynamo.reset()
    counters.clear()
    ctx = context("flex", device)
    model = fresh_drafter(ctx.args, device)
    compile_layers(model)
    optimizer = PlainDescent(model.parameters())
    batches = [micro_batch(seed, device) for seed in (20, 21, 22, 23)]
    assert len({(len(b["doc_ids"]), len(b["anchor_doc"]), len(b["label_rows"])) for b in batches}) == 4
    graphs = []
    for batch in batches:
        train_step(model, ctx, [batch], optimizer, lr=1e-3, clip=1.0)
        torch.cuda.synchronize()
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[1:] == graphs[:1] * 3, f"graphs after each step: {graphs}"
    held_out, grad_mode = evaluation_mode(model)  # a held-out pass reuses the training graphs (grad mode on)
    with grad_mode:
        forward_loss(held_out, ctx, batches[0])
    torch.cuda.synchronize()
    assert counters["stats"]["unique_graphs"] == graphs[-1], "the held-out pass compiled graphs of its own"


def test_fp8_capture_on_the_gpu_equals_the_cpu_encode_and_labels_equal_the_argmax(tiny_target_dir):
    from transformers import AutoModelForCausalLM

    from dflash.data.samples import Sample
    from dflash.extract.capture import capture_batch
    from dflash.extract.target import load_target, pad_batch
    from dflash.padding import target_batch_multiple
    from dflash.store import codecs

    device = torch.device("cuda")
    target = load_target(str(tiny_target_dir), device, dtype=torch.float32, layer_ids=[1, 3, 5],
                         predict_labels=True)
    rng = np.random.default_rng(5)
    samples = [Sample(row_id=i, input_ids=rng.integers(0, 248000, n).astype(np.int32),
                      loss_mask=np.ones(n, dtype=np.uint8)) for i, n in enumerate([37, 5, 90])]
    captured = capture_batch(target, samples, "fp8", device)
    captured.wait()
    input_ids, mask = pad_batch([s.input_ids for s in samples], pad_id=0, multiple=target_batch_multiple(device))
    hidden_BTnH = target.capture(input_ids, mask).cpu()
    expected = codecs.encode(hidden_BTnH.reshape(-1, *hidden_BTnH.shape[2:]), "fp8")
    got_scale = captured.parts["scale"].reshape(-1, expected["scale"].shape[1])
    torch.testing.assert_close(got_scale, expected["scale"], rtol=1e-6, atol=0)
    got_bits = captured.parts["hidden"].reshape(expected["hidden"].shape)
    assert (got_bits != expected["hidden"]).float().mean() < 1e-3  # a rounding tie may differ, nothing more
    reference = AutoModelForCausalLM.from_pretrained(str(tiny_target_dir), dtype=torch.float32).to(device).eval()
    for row, sample in enumerate(samples):
        with torch.no_grad():
            logits_TV = reference(input_ids=torch.as_tensor(sample.input_ids, device=device).long()[None]).logits[0]
        argmax = logits_TV[:-1].argmax(dim=-1).cpu()
        labels = captured.parts["labels"][row, 1:len(sample.input_ids)].long()
        assert (labels != argmax).float().mean() < 0.01, f"row {row}"


def test_compiled_decoder_layers_capture_what_eager_captures(tiny_target_dir):
    """Stage one's regional compile (`compile_decoder_layers`) against the eager layers, on
    batches of two shapes (the second compiles the shape-generic graph), every real row."""
    from dflash.extract.target import compile_decoder_layers, load_target, pad_batch
    from dflash.padding import target_batch_multiple

    device = torch.device("cuda")
    target = load_target(str(tiny_target_dir), device, dtype=torch.float32, layer_ids=[1, 3, 5])
    rng = np.random.default_rng(7)
    batches = [[rng.integers(0, 248000, n).astype(np.int32) for n in lengths] for lengths in ([37, 5, 90], [200, 130])]
    padded = [pad_batch(batch, pad_id=0, multiple=target_batch_multiple(device)) for batch in batches]
    eager = [target.capture(ids, mask) for ids, mask in padded]
    assert compile_decoder_layers(target) == 6
    for (ids, mask), batch, reference in zip(padded, batches, eager):
        compiled = target.capture(ids, mask)
        for row, tokens in enumerate(batch):
            real = slice(0, len(tokens))
            gap = (compiled[row, real] - reference[row, real]).norm() / reference[row, real].norm()
            # Not bitwise: the compiled layers fuse in other orders and may take other linear-attention
            # kernels (4.4e-3 on an H200 in float32); the store's fp8 codec itself is 2.6e-2 from bf16.
            assert gap < 1e-2, f"row {row} of a {tuple(ids.shape)} batch: {gap:.2e} from eager"


def test_kernels_warmed_ahead_compile_nothing_at_their_first_launch(monkeypatch):
    """dflash/train/warm_kernels.py: after the warm-up (heads of a shape no other test launches, a vocabulary
    of its own) the attention op's forward and backward and the loss pass's kernel compile nothing."""
    import triton
    from support import tiled_packed_meta

    from dflash.model import block_attention, ce_kernel
    from dflash.train.warm_kernels import Warming

    compiled = []
    monkeypatch.setattr(triton.knobs.runtime, "jit_post_compile_hook",
                        lambda **hook: compiled.append((hook["fn"].name, hook["compile"]["is_warmup"])))
    device = torch.device("cuda")
    heads, key_heads, dim, vocab = 6, 2, 32, 3_000
    results = Warming({"attention": lambda: block_attention.warm_kernels(heads, key_heads, dim, torch.bfloat16, device),
                       "loss pass": lambda: [ce_kernel.warm(vocab, torch.bfloat16, device)]}, device).join()
    assert all(result.startswith(("3 compiled", "1 compiled")) for result in results.values()), results
    assert len(compiled) == 4 and all(warmup for _, warmup in compiled)
    meta = {k: v.to(device) for k, v in tiled_packed_meta(np.random.default_rng(7), 16).items()}
    ranges = dflash_masks.build_masks(meta, ["full_attention"], 0, block_size=16, backend="blockwise")["full_attention"]
    rows, keys = len(meta["anchor_doc"]) * 16, len(meta["doc_ids"]) + len(meta["anchor_doc"]) * 16
    q = torch.randn(1, heads, rows, dim, device=device, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(1, key_heads, keys, dim, device=device, dtype=torch.bfloat16, requires_grad=True)
            for _ in range(2))
    block_attention.block_attention(q, k, v, ranges).sum().backward()
    logits = torch.randn(40, vocab, device=device, dtype=torch.bfloat16)
    ce_kernel.ce_and_grad(logits, torch.randint(0, vocab, (40,), device=device), torch.rand(40, device=device),
                          torch.bfloat16)
    torch.cuda.synchronize()
    assert len(compiled) == 4, compiled[4:]  # every first launch found its kernel warmed
