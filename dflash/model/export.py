"""The inference export format of a DFlash drafter, and reading it back.

An export is a directory with `config.json` (a Qwen3 config plus DFlash fields, the layout
inference engines load as `DFlashDraftModel`), `model.safetensors` holding exactly the
drafter keys of docs/ARCHITECTURE.md, and `modeling_dflash.py` beside them (a copy of
`dflash/model/modeling_dflash.py`, named by the config's `auto_map`), so that
`AutoModel.from_pretrained(dir, trust_remote_code=True)` returns the drafter with its
speculative-decoding loop. The frozen embedding and LM head are the target's and are not
part of it. `load_exported` reads such a directory back into `DrafterArgs` and a state
dict, which is how a new run starts from a published drafter.
"""

import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dflash.errors import DflashError
from dflash.outputs import atomic_dir, require_finite
from dflash.recipe import BLOCK_SIZE, MASK_TOKEN_ID

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
MODELING_NAME = "modeling_dflash.py"
EXPORT_FILES = (CONFIG_NAME, WEIGHTS_NAME, MODELING_NAME)
AUTO_MAP = {"AutoModel": "modeling_dflash.DFlashDraftModel"}
DEFAULT_MAX_POSITION_EMBEDDINGS = 262_144  # the Qwen3.5/3.6 targets' context length
DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


class ExportFormatError(DflashError, ValueError):
    """An export's config or weights do not match the drafter layout; the message names the key."""


class ExportDirectoryError(DflashError, FileExistsError):
    """The export's directory holds files that are not an export's, which replacing it would remove."""


def expected_shapes(args) -> dict[str, tuple[int, ...]]:
    """Every drafter weight key and its shape, derived from `DrafterArgs` alone."""
    hidden, head_dim = args.hidden_size, args.head_dim
    q_width = args.num_attention_heads * head_dim
    kv_width = args.num_key_value_heads * head_dim
    per_layer = {
        "self_attn.q_proj.weight": (q_width, hidden),
        "self_attn.k_proj.weight": (kv_width, hidden),
        "self_attn.v_proj.weight": (kv_width, hidden),
        "self_attn.o_proj.weight": (hidden, q_width),
        "self_attn.q_norm.weight": (head_dim,),
        "self_attn.k_norm.weight": (head_dim,),
        "mlp.gate_proj.weight": (args.intermediate_size, hidden),
        "mlp.up_proj.weight": (args.intermediate_size, hidden),
        "mlp.down_proj.weight": (hidden, args.intermediate_size),
        "input_layernorm.weight": (hidden,),
        "post_attention_layernorm.weight": (hidden,),
    }
    shapes = {
        f"layers.{i}.{name}": shape for i in range(args.num_layers) for name, shape in per_layer.items()
    }
    shapes["norm.weight"] = (hidden,)
    shapes["fc.weight"] = (hidden, len(args.target_layer_ids) * hidden)
    shapes["hidden_norm.weight"] = (hidden,)
    return shapes


def match_drafter_keys(state: dict[str, torch.Tensor], args, source: str) -> dict[str, torch.Tensor]:
    """Validate `state` against the drafter layout; return it with canonical keys.

    A prefix shared by every key ("model.", "module.", "_orig_mod.") is stripped when the
    stripped keys are exactly the expected ones; anything else missing, extra or misshapen
    raises, naming the key and `source`.
    """
    shapes = expected_shapes(args)
    state = strip_common_prefix(state, set(shapes))
    missing = sorted(set(shapes) - set(state))
    extra = sorted(set(state) - set(shapes))
    if missing or extra:
        raise ExportFormatError(
            f"{source}: keys do not match the drafter layout; "
            f"missing: {missing[:8]}{' ...' if len(missing) > 8 else ''}, "
            f"unexpected: {extra[:8]}{' ...' if len(extra) > 8 else ''}"
        )
    for key, shape in shapes.items():
        if tuple(state[key].shape) != shape:
            raise ExportFormatError(f"{source}: {key} has shape {tuple(state[key].shape)}, expected {shape}")
    return state


def strip_common_prefix(state: dict[str, torch.Tensor], expected: set[str]) -> dict[str, torch.Tensor]:
    """Drop a dotted prefix shared by all keys if that yields exactly `expected`; else unchanged."""
    if set(state) == expected or not state:
        return state
    first = next(iter(state))
    parts = first.split(".")
    for depth in range(1, len(parts)):
        prefix = ".".join(parts[:depth]) + "."
        if all(key.startswith(prefix) for key in state):
            stripped = {key[len(prefix):]: value for key, value in state.items()}
            if set(stripped) == expected:
                return stripped
    return state


def drafter_config_dict(args, dtype: torch.dtype, max_position_embeddings: int) -> dict:
    """The config.json of an export: a Qwen3 config plus the DFlash fields."""
    layer_types = list(args.layer_types)
    uses_sliding = "sliding_attention" in layer_types
    # Older Qwen2/3 loaders ignore layer_types and make layers i >= max_window_layers
    # sliding; the count of leading full layers is the closest that rule can express.
    # layer_types is authoritative for transformers >= 4.53 and current engines.
    leading_full = next((i for i, kind in enumerate(layer_types) if kind != "full_attention"), len(layer_types))
    # The target's depth; when unknown, the least that holds every id.
    num_target_layers = args.num_target_layers or max(args.target_layer_ids) + 1
    return {
        "architectures": ["DFlashDraftModel"],
        "auto_map": AUTO_MAP,
        "model_type": "qwen3",
        "hidden_size": args.hidden_size,
        "intermediate_size": args.intermediate_size,
        "num_hidden_layers": args.num_layers,
        "num_attention_heads": args.num_attention_heads,
        "num_key_value_heads": args.num_key_value_heads,
        "head_dim": args.head_dim,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "rms_norm_eps": args.rms_norm_eps,
        "vocab_size": args.vocab_size,
        # plain RoPE, written both the transformers 4 way and the transformers 5 way
        "rope_theta": args.rope_theta,
        "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": args.rope_theta},
        "max_position_embeddings": max_position_embeddings,
        "tie_word_embeddings": False,
        "layer_types": layer_types,
        "sliding_window": args.sliding_window,
        "use_sliding_window": uses_sliding,
        "max_window_layers": leading_full if uses_sliding else len(layer_types),
        "dflash_config": {
            "target_layer_ids": list(args.target_layer_ids),
            "block_size": args.block_size,
            "mask_token_id": args.mask_token_id,
            "num_target_layers": num_target_layers,
        },
        "block_size": args.block_size,
        "num_target_layers": num_target_layers,
        "torch_dtype": DTYPE_NAMES[dtype],
        "dtype": DTYPE_NAMES[dtype],
    }


def export_drafter(
    model_state: dict[str, torch.Tensor],
    args,
    out_dir: str | Path,
    dtype: torch.dtype = torch.bfloat16,
    max_position_embeddings: int = DEFAULT_MAX_POSITION_EMBEDDINGS,
) -> Path:
    """Write `model_state` (a DFlashDrafter state dict) as an inference export; return the dir."""
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"export dtype must be one of {list(DTYPE_NAMES.values())}, got {dtype}")
    state = match_drafter_keys(model_state, args, source="export_drafter(model_state)")
    require_finite(state, f"export to {out_dir}", ExportFormatError)
    out_dir = Path(out_dir)
    existing = out_dir.iterdir() if out_dir.is_dir() else ()
    others = sorted(path.name for path in existing if path.name not in EXPORT_FILES)
    if others:
        raise ExportDirectoryError(f"export to {out_dir}: the directory holds other files ({', '.join(others)}), which "
                              f"replacing it would remove; export into a new or empty directory")
    tensors = {key: value.detach().to(device="cpu", dtype=dtype).contiguous() for key, value in state.items()}
    config = drafter_config_dict(args, dtype, max_position_embeddings)
    # Whole or nothing, with the umask's permissions (a serving process of another user reads it).
    with atomic_dir(out_dir) as staging:
        save_file(tensors, str(staging / WEIGHTS_NAME), metadata={"format": "pt"})
        (staging / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
        shutil.copyfile(Path(__file__).with_name(MODELING_NAME), staging / MODELING_NAME)
    return out_dir


def args_from_config(config: dict, source: str):
    """Build `DrafterArgs` from an export's config.json (ours or an older DFlash one)."""
    from dflash.model.drafter import DrafterArgs  # deferred: keeps export importable on its own

    def require(key: str):
        if key not in config:
            raise ExportFormatError(f"{source}: config.json lacks {key!r}")
        return config[key]

    dflash = config.get("dflash_config") or {}
    if "target_layer_ids" not in dflash:
        raise ExportFormatError(f"{source}: config.json lacks 'dflash_config.target_layer_ids'")
    num_layers = require("num_hidden_layers")
    rope = config.get("rope_parameters") or {}
    rope_theta = rope.get("rope_theta", config.get("rope_theta"))
    if rope_theta is None:
        raise ExportFormatError(f"{source}: config.json has neither rope_parameters.rope_theta nor rope_theta")
    scaling = config.get("rope_scaling") or {}
    for rope_fields in (rope, scaling):
        if rope_fields.get("rope_type", rope_fields.get("type", "default")) != "default":
            raise ExportFormatError(f"{source}: only plain RoPE is supported, config has {rope_fields}")
    layer_types = config.get("layer_types") or legacy_layer_types(config, num_layers)
    return DrafterArgs(
        hidden_size=require("hidden_size"),
        intermediate_size=require("intermediate_size"),
        num_layers=num_layers,
        num_attention_heads=require("num_attention_heads"),
        num_key_value_heads=config.get("num_key_value_heads") or config["num_attention_heads"],
        head_dim=config.get("head_dim") or require("hidden_size") // config["num_attention_heads"],
        layer_types=tuple(layer_types),
        sliding_window=config.get("sliding_window") or require("max_position_embeddings"),
        rope_theta=float(rope_theta),
        target_layer_ids=tuple(dflash["target_layer_ids"]),
        block_size=dflash.get("block_size", config.get("block_size", BLOCK_SIZE)),
        mask_token_id=dflash.get("mask_token_id", MASK_TOKEN_ID),
        vocab_size=require("vocab_size"),
        rms_norm_eps=config.get("rms_norm_eps", 1e-6),
        num_target_layers=target_depth(config, dflash),
    )


def target_depth(config: dict, dflash: dict) -> int:
    """The target's layer count an export names; 0 when it names none that holds the ids (exports
    written before it was the target's depth held the number of ids)."""
    depth = int(dflash.get("num_target_layers", config.get("num_target_layers", 0)) or 0)
    return depth if depth > max(dflash["target_layer_ids"]) else 0


def legacy_layer_types(config: dict, num_layers: int) -> list[str]:
    """layer_types for configs without them, by the transformers Qwen3 rule."""
    sliding = config.get("use_sliding_window") and config.get("sliding_window")
    first_sliding = config.get("max_window_layers", num_layers)
    return ["sliding_attention" if sliding and i >= first_sliding else "full_attention" for i in range(num_layers)]


def load_exported(export_dir: str | Path) -> tuple:
    """Read an export back: `(DrafterArgs, state_dict)` with tensors in the stored dtype."""
    export_dir = Path(export_dir)
    config_path, weights_path = export_dir / CONFIG_NAME, export_dir / WEIGHTS_NAME
    for path in (config_path, weights_path):
        if not path.is_file():
            raise FileNotFoundError(f"not a drafter export: {path} is missing")
    args = args_from_config(json.loads(config_path.read_text()), source=str(config_path))
    with safe_open(str(weights_path), framework="pt") as reader:
        state = {key: reader.get_tensor(key) for key in reader.keys()}
    return args, match_drafter_keys(state, args, source=str(weights_path))
