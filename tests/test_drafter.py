"""The drafter module: export parameter names, shapes, parameter count, init, args."""

import contextlib

import pytest
import torch

from dflash.extract.tiny_target import tiny_target_config
from dflash.model.drafter import (DRAFTER_SIZES, DFlashDrafter, block_embeddings, block_positions, count_parameters,
                                  drafter_args)
from dflash.model.masks import build_masks


def expected_export_keys(num_layers: int) -> set[str]:
    keys = {"norm.weight", "fc.weight", "hidden_norm.weight"}
    for i in range(num_layers):
        keys |= {f"layers.{i}.self_attn.{p}_proj.weight" for p in "qkvo"}
        keys |= {f"layers.{i}.self_attn.{n}_norm.weight" for n in "qk"}
        keys |= {f"layers.{i}.mlp.{p}_proj.weight" for p in ("gate", "up", "down")}
        keys |= {f"layers.{i}.input_layernorm.weight", f"layers.{i}.post_attention_layernorm.weight"}
    return keys


def test_parameter_names_are_the_export_keys():
    model = DFlashDrafter(drafter_args("tiny"))
    names = [name for name, _ in model.named_parameters()]
    assert set(names) == expected_export_keys(2) and len(names) == len(set(names))
    assert set(model.state_dict()) == set(names), "no buffers may leak into the checkpoint"


def test_parameter_count_without_building():
    tiny = drafter_args("tiny")
    assert count_parameters(tiny) == sum(p.numel() for p in DFlashDrafter(tiny).parameters())
    big = count_parameters(DRAFTER_SIZES["qwen3.6-27b"])
    assert 1.70e9 < big < 1.76e9, big


def test_tiny_matches_tiny_target_and_27b_recipe():
    tiny, big = DRAFTER_SIZES["tiny"], DRAFTER_SIZES["qwen3.6-27b"]
    assert tiny.hidden_size == tiny_target_config().hidden_size
    assert max(tiny.target_layer_ids) < tiny_target_config().num_hidden_layers
    assert big.layer_types == ("sliding_attention",) * 4 + ("full_attention",)
    assert (big.target_layer_ids, big.block_size, big.mask_token_id) == ((1, 16, 31, 46, 61), 16, 248070)


def test_qwen3_init():
    torch.manual_seed(0)
    model = DFlashDrafter(drafter_args("qwen3.6-27b", num_layers=1, layer_types=["full_attention"],
                                       hidden_size=256, intermediate_size=512, num_attention_heads=4,
                                       num_key_value_heads=2, head_dim=64))
    std = model.layers[0].mlp.up_proj.weight.std().item()
    assert 0.019 < std < 0.021
    assert torch.all(model.layers[0].self_attn.q_norm.weight == 1) and torch.all(model.hidden_norm.weight == 1)


def test_forward_shapes_and_gradients():
    args = drafter_args("tiny", vocab_size=300, mask_token_id=299)
    model = DFlashDrafter(args)
    num_context, anchor_pos = 20, torch.tensor([3, 9, 15])
    meta = {"doc_ids": torch.zeros(num_context, dtype=torch.long), "position_ids": torch.arange(num_context),
            "anchor_doc": torch.zeros(3, dtype=torch.long), "anchor_pos": anchor_pos}
    masks = build_masks(meta, args.layer_types, args.sliding_window, block_size=args.block_size, backend="dense")
    embed = torch.randn(args.vocab_size, args.hidden_size)
    input_ids = torch.randint(0, 299, (num_context,))
    block = block_embeddings(embed, input_ids, anchor_pos, args.block_size, args.mask_token_id)
    assert block.shape == (3 * 16, 64)
    assert torch.equal(block[16], embed[input_ids[9]]) and torch.equal(block[17], embed[299])
    positions = block_positions(anchor_pos, args.block_size)
    assert positions[:17].tolist() == list(range(3, 19)) + [9]
    feature = torch.randn(num_context, 3 * 64)
    hidden = model(feature, block, meta["position_ids"], positions, masks)
    assert hidden.shape == (48, 64) and torch.isfinite(hidden).all()
    hidden.square().mean().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_bad_args_are_named():
    with pytest.raises(ValueError, match="unknown size"):
        drafter_args("huge")
    with pytest.raises(ValueError, match="num_heads|unknown override"):
        drafter_args("tiny", num_heads=3)
    with pytest.raises(ValueError, match="layer_types has 1 entries"):
        drafter_args("tiny", layer_types=["full_attention"])
    with pytest.raises(ValueError, match="layer_types\\[1\\]"):
        drafter_args("tiny", layer_types=["full_attention", "linear_attention"])
    with pytest.raises(ValueError, match="smaller than block_size"):
        drafter_args("tiny", sliding_window=8)


def compiled_graph_count(num_layers: int) -> int:
    """Graphs torch.compile makes for `compile_layers` over two input shapes; also checks that the
    compiled drafter equals the eager one, outputs and gradients."""
    from dflash.model.drafter import compile_layers

    graphs = []

    def counting_backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    args = drafter_args("tiny", num_layers=num_layers,
                        layer_types=("sliding_attention", "full_attention") * (num_layers // 2))
    eager = DFlashDrafter(args)
    compiled = DFlashDrafter(args)
    compiled.load_state_dict(eager.state_dict())
    torch._dynamo.reset()
    compile_layers(compiled, backend=counting_backend)
    generator = torch.Generator().manual_seed(0)
    for num_context, num_anchors in ((40, 3), (56, 5)):
        anchor_pos = torch.sort(torch.randperm(num_context - 1, generator=generator)[:num_anchors] + 1).values
        meta = {"doc_ids": torch.zeros(num_context, dtype=torch.long), "position_ids": torch.arange(num_context),
                "anchor_doc": torch.zeros(num_anchors, dtype=torch.long), "anchor_pos": anchor_pos}
        masks = build_masks(meta, args.layer_types, args.sliding_window, block_size=args.block_size, backend="dense")
        feature = torch.randn(num_context, args.context_feature_size, generator=generator)
        block = torch.randn(num_anchors * args.block_size, args.hidden_size, generator=generator)
        positions = block_positions(anchor_pos, args.block_size)
        outputs = []
        for model in (eager, compiled):
            model.zero_grad()
            hidden = model(feature, block, meta["position_ids"], positions, masks)
            hidden.square().mean().backward()
            outputs.append((hidden.detach(), [p.grad.clone() for p in model.parameters()]))
        torch.testing.assert_close(outputs[1][0], outputs[0][0])
        for grad_compiled, grad_eager in zip(outputs[1][1], outputs[0][1]):
            torch.testing.assert_close(grad_compiled, grad_eager)
    return len(graphs)


def test_compiled_layers_share_one_graph_per_half_and_match_eager():
    """compile_layers gives every layer the same two compiled functions: the number of graphs
    does not grow with the layers (per-layer compiles made the 27B warm-up take minutes), and the first
    layer's input asks for a gradient as the others' do (the frozen embeddings' requires_grad guard compiled
    each half twice): one graph per half. The row axes are dynamic from the first call, so the second shape
    adds no graph (unmarked, it compiled them all again)."""
    assert compiled_graph_count(2) == compiled_graph_count(6) == 2



def test_compiled_norms_are_one_more_graph_for_both_norms_and_match_eager(monkeypatch):
    """`drafter.COMPILE_NORMS` (bench_stage2 --compile-norms): the context's norm and the final norm run one compiled
    `rms_norm`, one graph more for the two (rows dynamic: none for the second shape), equal to eager."""
    from dflash.model import drafter as drafter_module

    monkeypatch.setattr(drafter_module, "COMPILE_NORMS", True)
    assert compiled_graph_count(2) == 3


def test_held_out_passes_reuse_the_compiled_training_graphs():
    """Compiled graphs are guarded on the grad mode: a held-out pass under no_grad compiled the halves
    again (and flex attention, on the GPU). `evaluation_mode` runs it with gradients on, so it reuses
    the training graphs; the inductor setting that kept a size check from guarding the rows is set."""
    import torch._inductor.config as inductor_config

    from dflash.model.drafter import compile_layers, is_compiled
    from dflash.train.step import evaluation_mode

    graphs = []

    def counting_backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    args = drafter_args("tiny")
    model = DFlashDrafter(args)
    assert not is_compiled(model) and isinstance(evaluation_mode(model)[1], torch.no_grad)
    torch._dynamo.reset()
    compile_layers(model, backend=counting_backend)
    assert is_compiled(model) and inductor_config.triton.mix_order_reduction_non_strict_mode
    num_context, anchor_pos = 40, torch.tensor([3, 11, 30])
    meta = {"doc_ids": torch.zeros(num_context, dtype=torch.long), "position_ids": torch.arange(num_context),
            "anchor_doc": torch.zeros(3, dtype=torch.long), "anchor_pos": anchor_pos}
    masks = build_masks(meta, args.layer_types, args.sliding_window, block_size=args.block_size, backend="dense")
    inputs = (torch.randn(num_context, args.context_feature_size), torch.randn(3 * args.block_size, args.hidden_size),
              meta["position_ids"], block_positions(anchor_pos, args.block_size), masks)
    model(*inputs).square().mean().backward()
    trained = len(graphs)
    evaluated, grad_mode = evaluation_mode(model)
    with grad_mode:
        held_out = evaluated(*inputs)
    assert len(graphs) == trained, "the held-out pass compiled graphs of its own"
    with torch.no_grad():
        torch.testing.assert_close(model(*inputs), held_out.detach())
    assert len(graphs) > trained  # what evaluation_mode avoids


def micro_batch_inputs(args, seed: int, dtype=torch.float32) -> list[tuple]:
    """The drafter's inputs for three random micro-batches (20, 33 and 47 context tokens, 3 anchors each)."""
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for num_context in (20, 33, 47):
        anchor_pos = torch.sort(torch.randperm(num_context - 2, generator=generator)[:3]).values
        meta = {"doc_ids": torch.zeros(num_context, dtype=torch.long), "position_ids": torch.arange(num_context),
                "anchor_doc": torch.zeros(3, dtype=torch.long), "anchor_pos": anchor_pos}
        masks = build_masks(meta, args.layer_types, args.sliding_window, block_size=args.block_size, backend="dense")
        batches.append((torch.randn(num_context, args.context_feature_size, generator=generator).to(dtype),
                        torch.randn(3 * args.block_size, args.hidden_size, generator=generator).to(dtype),
                        meta["position_ids"], block_positions(anchor_pos, args.block_size), masks))
    return batches


@pytest.mark.parametrize("accumulate, checkpointing", [(True, False), (False, False), (True, True)])
@pytest.mark.parametrize("seed", range(3))
def test_weights_cast_once_give_every_micro_batch_the_gradients_of_casting_at_each_use(seed, accumulate,
                                                                                          checkpointing):
    """`weights_cast_once`: the layers' matmul weights cast to bf16 once and that cast used by three micro-batches,
    under autocast to bf16 (as the CUDA step runs), give the same loss and the same fp32 gradients, bit for bit and
    laid out as the weights, as autocast's own cast at every use, whether the casts add the gradients into `.grad`
    themselves (`accumulate`) or autograd does; each weight is cast once; nothing is kept after the span, and the
    next span casts the weights as they are then (after an update); under activation checkpointing too (the
    recomputed layers take the same casts)."""
    import functools

    from dflash.model.drafter import weights_cast_once
    from dflash.train.step import checkpointed_forward

    torch.manual_seed(seed)
    args = drafter_args("tiny", vocab_size=300, mask_token_id=299)
    model = DFlashDrafter(args)
    if checkpointing:  # as train.activation_checkpointing wraps them
        for layer in model.layers:
            layer.forward = functools.partial(checkpointed_forward, layer.forward)
    batches = micro_batch_inputs(args, seed)

    def step(cast_once: bool):
        model.zero_grad(set_to_none=True)
        losses = []
        with (weights_cast_once(model, torch.bfloat16, accumulate=accumulate) if cast_once
              else contextlib.nullcontext()) as cast:
            for inputs in batches:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = model(*inputs).float().square().mean()
                loss.backward()
                losses.append(loss.detach())
        return losses, [p.grad.clone() for p in model.parameters()], cast

    plain_losses, plain_grads, _ = step(False)
    once_losses, once_grads, cast = step(True)
    assert once_losses == plain_losses
    for once, plain, weight in zip(once_grads, plain_grads, model.parameters()):
        assert once.dtype == torch.float32 and torch.equal(once, plain) and once.stride() == weight.stride()
    assert len(cast.casts) == 7 * len(model.layers) + 1  # q, k, v, o, gate, up, down and fc: once for 3 micro-batches
    assert all(layer.weight_cast is None for layer in model.layers)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    updated_once, updated_plain = step(True)[1], step(False)[1]  # after an update: the new weights' gradients
    assert all(torch.equal(a, b) for a, b in zip(updated_once, updated_plain))
    assert not all(torch.equal(a, b) for a, b in zip(updated_once, once_grads))


def test_weights_cast_once_through_the_compiled_halves_equal_eager_and_compile_nothing_more():
    """The compiled halves (AOT autograd's joint graph, `aot_eager`) given the once-cast bf16 weights, under autocast
    as on CUDA: every micro-batch's gradients reach the fp32 weights as eager's do, and the halves stay two graphs."""
    from torch._dynamo.utils import counters

    from dflash.model.drafter import compile_layers, weights_cast_once

    args = drafter_args("tiny", vocab_size=300, mask_token_id=299)
    batches = micro_batch_inputs(args, 5, torch.bfloat16)
    grads = {}
    for compiled in (False, True):
        torch.manual_seed(0)
        model = DFlashDrafter(args)
        if compiled:
            torch._dynamo.reset()
            counters.clear()
            compile_layers(model, backend="aot_eager")
        with weights_cast_once(model, torch.bfloat16):
            for inputs in batches:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    model(*inputs).float().square().mean().backward()
        grads[compiled] = [p.grad for p in model.parameters()]
    assert counters["stats"]["unique_graphs"] == 2
    for compiled_grad, eager_grad in zip(grads[True], grads[False]):
        torch.testing.assert_close(compiled_grad, eager_grad)
