"""The inference export: config.json fields, the exact key set, and a lossless round trip."""

import json
import math

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoConfig, Qwen3Config

from dflash.model.drafter import DFlashDrafter, block_positions, count_parameters, drafter_args
from dflash.model.export import ExportFormatError, drafter_config_dict, expected_shapes, export_drafter, load_exported
from dflash.model.masks import build_masks


def tiny_drafter(seed: int = 0) -> DFlashDrafter:
    torch.manual_seed(seed)
    model = DFlashDrafter(drafter_args("tiny"))
    with torch.no_grad():  # norms start at ones; randomise them so a dropped norm would show
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(torch.randn_like(param) * 0.1)
    return model


def drafter_forward(model: DFlashDrafter, seed: int = 1) -> torch.Tensor:
    """Block hidden states for one random 40-token sequence with three anchors."""
    args = model.args
    generator = torch.Generator().manual_seed(seed)
    num_tokens = 40
    anchor_pos_A = torch.tensor([3, 17, 30])
    meta = {
        "doc_ids": torch.zeros(num_tokens, dtype=torch.long),
        "position_ids": torch.arange(num_tokens),
        "anchor_doc": torch.zeros(3, dtype=torch.long),
        "anchor_pos": anchor_pos_A,
    }
    masks = build_masks(meta, args.layer_types, args.sliding_window, block_size=args.block_size, backend="dense")
    context_TF = torch.randn(num_tokens, args.context_feature_size, generator=generator)
    block_QH = torch.randn(3 * args.block_size, args.hidden_size, generator=generator)
    with torch.no_grad():
        return model(context_TF, block_QH, meta["position_ids"], block_positions(anchor_pos_A, args.block_size), masks)


def test_config_json_has_the_fields_engines_read():
    # checked on the 27B recipe without building its 1.7B weights
    args = drafter_args("qwen3.6-27b")
    config = drafter_config_dict(args, torch.bfloat16, 262_144)
    assert config["model_type"] == "qwen3" and config["architectures"] == ["DFlashDraftModel"]
    assert config["num_hidden_layers"] == 5 and config["hidden_size"] == 5120
    assert config["intermediate_size"] == 17408 and config["head_dim"] == 128
    assert config["num_attention_heads"] == 32 and config["num_key_value_heads"] == 8
    assert config["layer_types"] == ["sliding_attention"] * 4 + ["full_attention"]
    assert config["sliding_window"] == 2048 and config["use_sliding_window"] is True
    assert config["rope_theta"] == 1e7 and config["rope_scaling"] is None
    assert config["rope_parameters"] == {"rope_type": "default", "rope_theta": 1e7}
    assert config["tie_word_embeddings"] is False
    assert config["dflash_config"] == {"target_layer_ids": [1, 16, 31, 46, 61], "block_size": 16,
                                       "mask_token_id": 248070, "num_target_layers": 64}
    assert config["auto_map"] == {"AutoModel": "modeling_dflash.DFlashDraftModel"}
    # num_target_layers is the target's depth (the reference code builds default ids from it).
    assert config["block_size"] == 16 and config["num_target_layers"] == 64
    assert config["torch_dtype"] == "bfloat16" and config["vocab_size"] == 248320
    json.dumps(config, allow_nan=False)
    shapes = expected_shapes(args)
    assert sum(math.prod(shape) for shape in shapes.values()) == count_parameters(args) == 1_730_213_120


def test_export_writes_exact_keys_and_a_config_transformers_reads(tmp_path):
    model = tiny_drafter()
    out = export_drafter(model.state_dict(), model.args, tmp_path / "export")
    with safe_open(str(out / "model.safetensors"), framework="pt") as reader:
        keys = set(reader.keys())
        assert {reader.get_tensor(key).dtype for key in keys} == {torch.bfloat16}
    assert keys == set(model.state_dict()) == set(expected_shapes(model.args))
    assert "fc.weight" in keys and "hidden_norm.weight" in keys and "layers.1.self_attn.k_norm.weight" in keys
    hf_config = AutoConfig.from_pretrained(str(out))  # what a transformers-based engine does
    assert isinstance(hf_config, Qwen3Config)
    assert hf_config.layer_types == ["sliding_attention", "full_attention"]
    assert hf_config.sliding_window == 64
    assert hf_config.rope_parameters["rope_type"] == "default"
    assert hf_config.rope_parameters["rope_theta"] == 1e7


def test_round_trip_gives_identical_outputs(tmp_path):
    model = tiny_drafter()
    expected_QH = drafter_forward(model)
    out = export_drafter(model.state_dict(), model.args, tmp_path / "export", dtype=torch.float32)
    args, state = load_exported(out)
    assert args == model.args
    reloaded = DFlashDrafter(args)
    reloaded.load_state_dict(state)
    assert torch.equal(drafter_forward(reloaded), expected_QH)


def test_bf16_export_holds_the_rounded_weights(tmp_path):
    model = tiny_drafter()
    _, state = load_exported(export_drafter(model.state_dict(), model.args, tmp_path / "export"))
    for key, value in model.state_dict().items():
        assert torch.equal(state[key], value.to(torch.bfloat16)), key


def test_load_accepts_a_model_prefix(tmp_path):
    model = tiny_drafter()
    out = export_drafter(model.state_dict(), model.args, tmp_path / "export", dtype=torch.float32)
    prefixed = {f"model.{key}": value for key, value in model.state_dict().items()}
    save_file(prefixed, str(out / "model.safetensors"))
    _, state = load_exported(out)
    assert set(state) == set(model.state_dict())
    assert torch.equal(state["fc.weight"], model.state_dict()["fc.weight"])


def test_load_names_the_bad_key(tmp_path):
    model = tiny_drafter()
    out = export_drafter(model.state_dict(), model.args, tmp_path / "export")
    state = {key: value.to(torch.bfloat16) for key, value in model.state_dict().items()}
    state["layers.0.mlp.up_proj.weight"] = torch.zeros(3, 3, dtype=torch.bfloat16)
    save_file(state, str(out / "model.safetensors"))
    with pytest.raises(ExportFormatError, match=r"layers\.0\.mlp\.up_proj\.weight has shape \(3, 3\)"):
        load_exported(out)
    del state["layers.0.mlp.up_proj.weight"]
    save_file(state, str(out / "model.safetensors"))
    with pytest.raises(ExportFormatError, match=r"missing: \['layers\.0\.mlp\.up_proj\.weight'\]"):
        load_exported(out)


def test_export_refuses_a_state_that_does_not_fit_the_args(tmp_path):
    model = tiny_drafter()
    other_args = drafter_args("tiny", target_layer_ids=(1, 3))
    with pytest.raises(ExportFormatError, match=r"fc\.weight has shape \(64, 192\), expected \(64, 128\)"):
        export_drafter(model.state_dict(), other_args, tmp_path / "export")


def test_load_reads_an_older_config_and_refuses_scaled_rope(tmp_path):
    model = tiny_drafter()
    out = export_drafter(model.state_dict(), model.args, tmp_path / "export")
    config = json.loads((out / "config.json").read_text())
    for key in ("layer_types", "rope_parameters", "block_size"):
        del config[key]
    config["use_sliding_window"], config["max_window_layers"] = True, 1  # layer 1 slides
    (out / "config.json").write_text(json.dumps(config))
    args, _ = load_exported(out)
    assert args.layer_types == ("full_attention", "sliding_attention") and args.rope_theta == 1e7
    config["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0}
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ExportFormatError, match="only plain RoPE"):
        load_exported(out)
