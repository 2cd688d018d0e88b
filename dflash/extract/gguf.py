"""GGUF targets: dequantize a `.gguf` file once into a plain checkpoint directory, cached by its hash.

transformers reads a GGUF with `from_pretrained(dir, gguf_file=name)` (needs the `gguf` package)
and dequantizes every tensor into plain floats, but refuses to `save_pretrained` the result
("quantized with gguf and is not serializable") although its weights are ordinary tensors.
Clearing the quantizer marks first saves a normal safetensors checkpoint; with it go the
tokenizer and chat template read from the GGUF. Stage one, stage two's store and `dflash eval`
then load that directory like any other checkpoint, and the 20-30 s conversion is paid once.

The directory is `<cache_dir>/target-gguf-<sha256[:16]>`, written to a temporary sibling and
renamed into place, so a crash never leaves a half checkpoint that looks complete.
"""

import hashlib
import importlib.util
import json
from pathlib import Path

from dflash.outputs import atomic_dir

GGUF_SUFFIX = ".gguf"
SOURCE_NAME = "dflash-gguf-source.json"  # written last: the completion mark
HASH_BLOCK = 8 << 20


def is_gguf(path: str | Path) -> bool:
    return str(path).lower().endswith(GGUF_SUFFIX)


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(HASH_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def converted_dir(gguf_path: str | Path, cache_dir: str | Path) -> Path:
    """The checkpoint directory of a GGUF file, converting it first if it is not cached yet."""
    gguf_path = Path(gguf_path)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"target.path: GGUF file not found: {gguf_path}")
    for package in ("gguf", "accelerate"):
        if importlib.util.find_spec(package) is None:
            raise ModuleNotFoundError(f"target.path names a GGUF file, which needs the '{package}' package "
                                      f"(pip install {package})")
    sha256 = file_sha256(gguf_path)
    out_dir = Path(cache_dir) / f"target-gguf-{sha256[:16]}"
    if (out_dir / SOURCE_NAME).is_file():
        return out_dir
    try:
        with atomic_dir(out_dir) as staging:  # replaces an incomplete earlier attempt (no completion mark)
            write_checkpoint(gguf_path, staging)
            (staging / SOURCE_NAME).write_text(json.dumps({"gguf": str(gguf_path.resolve()), "sha256": sha256})
                                               + "\n")
    except OSError:
        # Processes started side by side (`dflash recipe`'s generates) convert at once; the first to
        # finish renames its copy into place, and the others' renames then fail: theirs is not needed.
        if not (out_dir / SOURCE_NAME).is_file():
            raise
    return out_dir


def write_checkpoint(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize the GGUF's weights to bfloat16 safetensors and save its tokenizer beside them."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"target: converting {gguf_path.name} to a safetensors checkpoint (once; cached in {out_dir.parent})")
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.bfloat16)
    # The weights are plain tensors already; these marks only make save_pretrained refuse.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    tokenizer.save_pretrained(out_dir)
