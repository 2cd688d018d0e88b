"""`drafter.size = "auto"`: a drafter sized from the target's config, as recorded in the store."""

import pytest
from transformers import LlamaConfig, Qwen3_5TextConfig

from dflash.config import ConfigError, load_config
from dflash.extract.target import default_layer_ids, text_config_summary
from dflash.extract.tiny_target import tiny_target_config
from dflash.model.drafter import DFlashDrafter, auto_drafter_args, count_parameters
from dflash.store.schema import StoreMismatchError
from dflash.train import sizing


def smollm2_config() -> LlamaConfig:
    """SmolLM2-135M-Instruct's shape (Llama)."""
    return LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                       num_attention_heads=9, num_key_value_heads=3, rms_norm_eps=1e-5, max_position_embeddings=8192,
                       rope_parameters={"rope_type": "default", "rope_theta": 100000.0}, tie_word_embeddings=True)


def qwen36_27b_config() -> Qwen3_5TextConfig:
    """Qwen3.6-27B's text shape: hidden 5120, 24 heads / 4 KV heads x 256, 64 layers."""
    return Qwen3_5TextConfig(vocab_size=248320, hidden_size=5120, intermediate_size=17408, num_hidden_layers=64,
                             num_attention_heads=24, num_key_value_heads=4, head_dim=256,
                             rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25})


def test_auto_size_of_a_llama_target():
    summary = text_config_summary(smollm2_config())
    layer_ids = default_layer_ids(summary["num_hidden_layers"])
    args = auto_drafter_args(summary, layer_ids, mask_token_id=4)
    assert layer_ids == [1, 8, 14, 20, 27]
    assert (args.hidden_size, args.num_attention_heads, args.num_key_value_heads, args.head_dim) == (576, 9, 3, 64)
    assert (args.intermediate_size, args.vocab_size, args.rope_theta, args.rms_norm_eps) == (1536, 49152, 1e5, 1e-5)
    assert args.layer_types == ("sliding_attention",) * 4 + ("full_attention",) and args.sliding_window == 2048
    assert args.num_target_layers == 30 and args.target_layer_ids == (1, 8, 14, 20, 27)
    model = DFlashDrafter(args)
    assert sum(p.numel() for p in model.parameters()) == count_parameters(args)


@pytest.mark.parametrize("config, heads, head_dim, theta", [
    (tiny_target_config(), 4, 16, 1e4),
    (qwen36_27b_config(), 24, 256, 1e7),
])
def test_auto_size_of_a_qwen35_target(config, heads, head_dim, theta):
    summary = text_config_summary(config)
    args = auto_drafter_args(summary, default_layer_ids(summary["num_hidden_layers"], 3), mask_token_id=248070)
    assert (args.hidden_size, args.num_attention_heads, args.head_dim) == (config.hidden_size, heads, head_dim)
    assert args.intermediate_size == config.intermediate_size and args.vocab_size == 248320
    # Qwen3.5's partial rotary and multimodal sections stay with the target: plain RoPE, same base.
    assert args.rope_theta == theta and args.num_target_layers == config.num_hidden_layers


def test_auto_size_overrides():
    summary = text_config_summary(smollm2_config())
    args = auto_drafter_args(summary, [1, 27], num_layers=3, sliding_window=512, intermediate_size=1024)
    assert args.layer_types == ("sliding_attention", "sliding_attention", "full_attention")
    assert (args.num_layers, args.sliding_window, args.intermediate_size) == (3, 512, 1024)
    args = auto_drafter_args(summary, [1, 27], num_layers=2, layer_types=["full_attention", "full_attention"])
    assert args.layer_types == ("full_attention", "full_attention")
    with pytest.raises(ValueError, match="layer_types has 1 entries"):
        auto_drafter_args(summary, [1, 27], num_layers=2, layer_types=["full_attention"])


def store_attrs(mask_token_id=None, tokenizer="HuggingFaceTB/SmolLM2"):
    summary = text_config_summary(smollm2_config())
    attrs = {"target": {"vocab_size": 49152, "num_hidden_layers": 30}, "target_layer_ids": [1, 8, 14, 20, 27],
             "hidden_size": 576, "target_text_config": summary, "tokenizer": {"name_or_path": tokenizer}}
    if mask_token_id is not None:
        attrs["mask_token_id"] = mask_token_id
    return attrs


def test_stage_two_sizes_the_drafter_from_the_store():
    config = load_config(None, ["drafter.size=auto", "drafter.num_layers=2"])
    args = sizing.build_drafter_args(config, store_attrs(mask_token_id=3))
    assert (args.hidden_size, args.num_layers, args.mask_token_id, args.target_layer_ids) == (576, 2, 3, (1, 8, 14, 20, 27))
    given = load_config(None, ["drafter.size=auto", "drafter.mask_token_id=7"])
    assert sizing.build_drafter_args(given, store_attrs(mask_token_id=3)).mask_token_id == 7


def test_stage_two_needs_a_mask_token_when_the_store_has_none():
    config = load_config(None, ["drafter.size=auto"])
    with pytest.raises(ConfigError, match="drafter.mask_token_id"):
        sizing.build_drafter_args(config, store_attrs())
    outside = load_config(None, ["drafter.size=auto", "drafter.mask_token_id=60000"])
    with pytest.raises(ConfigError, match="mask_token_id 60000 outside vocab_size 49152"):
        sizing.build_drafter_args(outside, store_attrs())


def test_named_size_that_does_not_fit_the_store_is_refused():
    config = load_config(None, ["drafter.size=tiny"])
    with pytest.raises(StoreMismatchError, match="hidden_size"):
        sizing.build_drafter_args(config, store_attrs(mask_token_id=3))
