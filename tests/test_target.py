"""Target loading and layer capture against plain transformers forwards on tiny real-family models."""

import hashlib
import json

import numpy as np
import pytest
import torch
from transformers import (AutoConfig, LlamaConfig, LlamaForCausalLM, Qwen3_5Config, Qwen3_5ForCausalLM,
                          Qwen3_5ForConditionalGeneration)

from dflash.extract.target import (default_layer_ids, describe_target_config, load_remapped_text_weights, load_target,
                                   pad_batch, validate_layer_ids)
from dflash.extract.tiny_target import tiny_target_config

QWEN_LAYER_IDS = [0, 2, 3, 5]  # 8 layers: linear, full (3) and the cut after 5 are all covered
TINY_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                   num_position_embeddings=16, patch_size=4)


@pytest.fixture(scope="module")
def qwen35_vl(tmp_path_factory):
    """A tiny random `Qwen3_5ForConditionalGeneration` (the real checkpoints' class), saved in float32."""
    torch.manual_seed(0)
    config = Qwen3_5Config(text_config=tiny_target_config().to_dict(), vision_config=TINY_VISION)
    model = Qwen3_5ForConditionalGeneration(config).eval()
    path = tmp_path_factory.mktemp("qwen35_vl")
    model.save_pretrained(path)
    return str(path), model


@pytest.fixture(scope="module")
def qwen35_target(qwen35_vl):
    path, _ = qwen35_vl
    return load_target(path, "cpu", dtype=torch.float32, layer_ids=QWEN_LAYER_IDS)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A tiny tied-embedding LlamaForCausalLM: a non-Qwen family."""
    torch.manual_seed(1)
    config = LlamaConfig(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    model = LlamaForCausalLM(config).eval()
    path = tmp_path_factory.mktemp("llama")
    model.save_pretrained(path)
    return str(path), model


def random_seqs(lengths, vocab_size, seed):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab_size, size=n).astype(np.int32) for n in lengths]


def reference_states(text_model, seq, layer_ids):
    """`hidden_states[i + 1]` of a full single-row forward, stacked to `(T, n, H)`."""
    with torch.no_grad():
        out = text_model(input_ids=torch.as_tensor(seq, dtype=torch.long)[None], output_hidden_states=True)
    return torch.stack([out.hidden_states[i + 1][0] for i in layer_ids], dim=1)


def test_default_layer_ids():
    assert default_layer_ids(64) == [1, 16, 31, 46, 61]
    assert default_layer_ids(64, 3) == [1, 31, 61]
    assert default_layer_ids(8) == [1, 2, 3, 4, 5]


@pytest.mark.parametrize("layer_ids", [[0, 8], [-1, 3], [3, 3], [4, 2], []])
def test_bad_layer_ids_name_the_key(layer_ids):
    with pytest.raises(ValueError, match="target.layer_ids"):
        validate_layer_ids(layer_ids, 8)


def test_default_layer_ids_too_few_layers_raise():
    with pytest.raises(ValueError, match="target.layer_ids"):
        default_layer_ids(4)  # all five ids would be 1


def test_pad_batch_right_pads():
    input_ids_BT, attention_mask_BT = pad_batch([np.array([5, 6, 7]), np.array([8])], pad_id=0)
    assert input_ids_BT.dtype == torch.long and attention_mask_BT.dtype == torch.long
    assert input_ids_BT.tolist() == [[5, 6, 7], [8, 0, 0]]
    assert attention_mask_BT.tolist() == [[1, 1, 1], [1, 0, 0]]


def test_vl_checkpoint_loads_text_weights(qwen35_vl, qwen35_target):
    path, vl_model = qwen35_vl
    vl_state = vl_model.state_dict()
    target_state = qwen35_target.model.state_dict()
    assert any(name.startswith("model.layers.") for name in target_state)
    for name, tensor in target_state.items():
        vl_name = name.replace("model.", "model.language_model.", 1) if name.startswith("model.") else name
        torch.testing.assert_close(tensor, vl_state[vl_name], rtol=0, atol=0, msg=name)
    config_dict = json.loads(open(f"{path}/config.json").read())
    canonical = json.dumps(config_dict, sort_keys=True, separators=(",", ":")).encode()
    assert qwen35_target.config_hash == hashlib.sha256(canonical).hexdigest()
    assert qwen35_target.model_type == "qwen3_5"
    assert (qwen35_target.num_layers, qwen35_target.hidden_size, qwen35_target.vocab_size) == (8, 64, 248320)
    assert qwen35_target.layer_ids == QWEN_LAYER_IDS


def test_remap_fallback_fills_text_model(qwen35_vl):
    """The path used when transformers does not strip `language_model.` itself."""
    path, vl_model = qwen35_vl
    torch.manual_seed(123)
    text_model = Qwen3_5ForCausalLM(tiny_target_config())
    load_remapped_text_weights(text_model, path)
    vl_state = vl_model.state_dict()
    for name, tensor in text_model.state_dict().items():
        vl_name = name.replace("model.", "model.language_model.", 1) if name.startswith("model.") else name
        torch.testing.assert_close(tensor, vl_state[vl_name], rtol=0, atol=0, msg=name)


def test_embedding_and_lm_head_weights(qwen35_vl, qwen35_target):
    _, vl_model = qwen35_vl
    torch.testing.assert_close(qwen35_target.embedding_weight(), vl_model.model.language_model.embed_tokens.weight)
    torch.testing.assert_close(qwen35_target.lm_head_weight(), vl_model.lm_head.weight)
    assert qwen35_target.embedding_weight().shape == (248320, 64)
    assert not torch.equal(qwen35_target.embedding_weight(), qwen35_target.lm_head_weight())  # untied


def test_capture_matches_output_hidden_states(qwen35_vl, qwen35_target):
    _, vl_model = qwen35_vl
    (seq,) = random_seqs([45], 248320, seed=2)
    captured_BTnH = qwen35_target.capture(*pad_batch([seq], pad_id=0))
    assert captured_BTnH.shape == (1, 45, len(QWEN_LAYER_IDS), 64)
    assert captured_BTnH.dtype == torch.float32
    expected_TnH = reference_states(vl_model.model.language_model, seq, QWEN_LAYER_IDS)
    torch.testing.assert_close(captured_BTnH[0], expected_TnH, rtol=1e-5, atol=1e-5)


def test_batched_right_padded_capture_equals_single_rows(qwen35_target):
    lengths = [37, 5, 64, 20]
    seqs = random_seqs(lengths, 248320, seed=3)
    batched_BTnH = qwen35_target.capture(*pad_batch(seqs, pad_id=248044))
    assert batched_BTnH.shape == (4, 64, len(QWEN_LAYER_IDS), 64)
    for row, seq in enumerate(seqs):
        single_BTnH = qwen35_target.capture(*pad_batch([seq], pad_id=0))
        # float32 rounding differs with the padded shape (about 2e-6 of the activations'
        # scale); a leak between rows would differ by the scale itself.
        scale = single_BTnH.abs().max().item()
        torch.testing.assert_close(batched_BTnH[row, : len(seq)], single_BTnH[0], rtol=1e-5, atol=1e-5 * scale,
                                   msg=f"row {row} (length {len(seq)})")


def test_capture_reads_no_scalar_from_the_model(qwen35_target, llama):
    """A scalar read of a device tensor is a host-device sync. Capture makes the right-padding
    check on the host mask and at most one in the model (transformers' packed-sequence check);
    a forward given the mask makes more (Qwen3.5: 3), each idling the GPU between batches."""
    from torch.profiler import ProfilerActivity, profile

    llama_target = load_target(llama[0], "cpu", dtype=torch.float32, layer_ids=[0, 2])
    for target, vocab_size in ((qwen35_target, 248320), (llama_target, 512)):
        batch = pad_batch(random_seqs([12, 30, 7], vocab_size, seed=8), pad_id=0)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            target.capture(*batch)
        reads = sum(e.name == "aten::_local_scalar_dense" for e in prof.events())
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            with torch.no_grad():
                target.base_model(input_ids=batch[0], attention_mask=batch[1], use_cache=False)
        masked = sum(e.name == "aten::_local_scalar_dense" for e in prof.events())
        assert reads <= 2, f"{target.model_type}: {reads} scalar reads in capture"
        assert reads - 1 < masked, f"{target.model_type}: capture's forward reads {reads - 1}, masked {masked}"


def test_layers_after_last_id_and_lm_head_never_run(qwen35_target):
    layers = qwen35_target.base_model.layers
    assert len(layers) == QWEN_LAYER_IDS[-1] + 1  # 6 of 8 kept
    layer_calls, head_calls = [], []
    handles = [layer.register_forward_hook(lambda *_, i=i: layer_calls.append(i)) for i, layer in enumerate(layers)]
    handles.append(qwen35_target.model.lm_head.register_forward_hook(lambda *_: head_calls.append(1)))
    try:
        qwen35_target.capture(*pad_batch(random_seqs([9], 248320, seed=4), pad_id=0))
    finally:
        for handle in handles:
            handle.remove()
    assert layer_calls == list(range(QWEN_LAYER_IDS[-1] + 1))
    assert head_calls == []


def test_capture_rejects_left_padding(qwen35_target):
    input_ids_BT = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="right-padded"):
        qwen35_target.capture(input_ids_BT, torch.tensor([[0, 1, 1, 1]]))


def test_generic_llama_family(llama):
    path, llama_model = llama
    target = load_target(path, "cpu", dtype=torch.float32, layer_ids=[0, 2, 3])
    assert (target.num_layers, target.hidden_size, target.vocab_size, target.model_type) == (6, 32, 512, "llama")
    assert len(target.base_model.layers) == 4
    # Tied head: the very same tensor as the embedding, equal to the saved model's.
    assert target.lm_head_weight().data_ptr() == target.embedding_weight().data_ptr()
    torch.testing.assert_close(target.embedding_weight(), llama_model.model.embed_tokens.weight)
    seqs = random_seqs([11, 30, 2], 512, seed=5)
    batched_BTnH = target.capture(*pad_batch(seqs, pad_id=0))
    for row, seq in enumerate(seqs):
        expected_TnH = reference_states(llama_model.model, seq, [0, 2, 3])
        torch.testing.assert_close(batched_BTnH[row, : len(seq)], expected_TnH, rtol=1e-5, atol=1e-5)


def test_bfloat16_capture_dtype(llama):
    path, _ = llama
    target = load_target(path, "cpu", layer_ids=[1])
    captured_BTnH = target.capture(*pad_batch(random_seqs([7], 512, seed=6), pad_id=0))
    assert captured_BTnH.dtype == torch.bfloat16 and captured_BTnH.shape == (1, 7, 1, 32)


@pytest.mark.parametrize("fixture_name", ["qwen35_vl", "llama"])
def test_describe_target_config_agrees_with_loaded_target(fixture_name, request):
    path, _ = request.getfixturevalue(fixture_name)
    described = describe_target_config(AutoConfig.from_pretrained(path), path)
    target = load_target(path, "cpu", dtype=torch.float32, layer_ids=[1])
    assert described == {"path": path, "config_hash": target.config_hash, "model_type": target.model_type,
                         "num_hidden_layers": target.num_layers, "hidden_size": target.hidden_size,
                         "vocab_size": target.vocab_size}


def test_a_hybrid_target_on_the_cpu_says_in_one_line_how_linear_attention_runs(tiny_target_dir, capfd):
    """Instead of transformers' per-kernel "falling back ... not installed" warnings."""
    from dflash.extract.target import load_causal_lm

    model = load_causal_lm(str(tiny_target_dir), torch.float32, torch.device("cpu"))
    model(input_ids=torch.tensor([[1, 2, 3]]))
    captured = capfd.readouterr()
    assert "linear-attention layers run on transformers' PyTorch path" in captured.out
    assert "not installed" not in captured.out + captured.err


@pytest.mark.parametrize("fixture_name,vocab_size", [("qwen35_vl", 248320), ("llama", 512)])
def test_target_labels_equal_an_independent_argmax_of_the_target(fixture_name, vocab_size, request):
    """Labels of a right-padded batch: position p holds the argmax of the full model's logits at
    p - 1 (its own token at 0), as a plain transformers forward of each sequence alone gives them."""
    from transformers import AutoModelForCausalLM

    path, _ = request.getfixturevalue(fixture_name)
    target = load_target(path, "cpu", dtype=torch.float32, layer_ids=[0, 2], predict_labels=True)
    assert len(target.base_model.layers) == target.num_layers  # labels keep every layer
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    seqs = random_seqs([23, 4, 40], vocab_size, seed=9)
    features_BTnH, labels_BT = target.capture_with_labels(*pad_batch(seqs, pad_id=0))
    assert labels_BT.dtype == torch.int32 and labels_BT.shape == (3, 40)
    torch.testing.assert_close(features_BTnH, target.capture(*pad_batch(seqs, pad_id=0)))
    for row, seq in enumerate(seqs):
        with torch.no_grad():
            logits_TV = reference(input_ids=torch.as_tensor(seq)[None]).logits[0]
        expected = torch.cat([torch.as_tensor(seq[:1]), logits_TV[:-1].argmax(dim=-1)])
        assert torch.equal(labels_BT[row, :len(seq)].long(), expected), f"row {row}"


def test_chunked_greedy_tokens_equal_the_whole_argmax_and_break_ties_low():
    from dflash.extract.target import greedy_tokens

    generator = torch.Generator().manual_seed(10)
    hidden_RH = torch.randn(37, 16, generator=generator)
    head_VH = torch.randn(301, 16, generator=generator)
    head_VH[250] = head_VH[7]  # exact ties across vocabulary chunks: the lower id wins
    head_VH[120] = head_VH[119]  # and inside one chunk
    hidden_RH[:5] = head_VH[7] * 10
    hidden_RH[5:9] = head_VH[119] * 10
    expected = (hidden_RH @ head_VH.T).argmax(dim=-1)
    for rows, vocab in ((8, 64), (37, 301), (1, 1), (100, 1000)):
        assert torch.equal(greedy_tokens(hidden_RH, head_VH, rows=rows, vocab=vocab).long(), expected), (rows, vocab)
    assert expected[:5].tolist() == [7] * 5 and expected[5:9].tolist() == [119] * 4


def test_a_target_without_labels_refuses_to_label(llama):
    target = load_target(llama[0], "cpu", dtype=torch.float32, layer_ids=[1])
    with pytest.raises(ValueError, match="predict_labels"):
        target.capture_with_labels(*pad_batch(random_seqs([5], 512, seed=11), pad_id=0))
