"""Configuration: one frozen dataclass per section, loaded from TOML, overridden with `--set`.

`load_config(path, overrides)` reads a TOML file (or the embedded tiny default when no path
is given), applies `section.key=value` overrides, and validates everything once, raising
`ConfigError` with the offending key. The dataclass defaults describe a real run on the
reference machine (paths under /data/dflash, the 27B-sized drafter).
"""

import dataclasses
import difflib
import hashlib
import json
import tomllib
import typing
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from dflash.errors import DflashError

DEFAULT_ROOT = "/data/dflash"


class ConfigError(DflashError, ValueError):
    """A config value is missing, unknown or invalid; the message names the key."""


@dataclass(frozen=True)
class TargetConfig:
    path: str = f"{DEFAULT_ROOT}/target"  # checkpoint directory, a .gguf file, or "embedded:tiny"
    layer_ids: tuple[int, ...] = ()  # empty: evenly spaced default (ARCHITECTURE.md)
    num_layer_ids: int = 5
    dtype: str = "auto"  # "auto": bfloat16 on CUDA, float32 on CPU
    chat_template: str = ""  # a Jinja template or a file holding one; empty: the target's own
    compile: bool = False  # stage one on CUDA: torch.compile each decoder layer (dflash.target.compile_decoder_layers)


@dataclass(frozen=True)
class DataConfig:
    source: str = f"{DEFAULT_ROOT}/data"  # file, directory, "embedded:code-chat" or hub name
    split: str = "train"
    max_length: int = 4096
    overlong: str = "truncate"  # or "drop"
    strict: bool = False  # a bad row raises instead of being counted
    num_workers: int = 8
    cache_dir: str = f"{DEFAULT_ROOT}/cache"


@dataclass(frozen=True)
class StoreConfig:
    path: str = f"{DEFAULT_ROOT}/store"
    codec: str = "fp8"  # or "bf16" (lossless)
    bucket_edges: tuple[int, ...] = (64, 256, 512, 1024, 2048, 3296, 8192)
    shard_tokens: int = 262_144
    labels: str = "data"  # "data": train against the data tokens; "target": against the target's greedy tokens
    overwrite: bool = False


@dataclass(frozen=True)
class ExtractConfig:
    batch_tokens: int = 32_768  # padded tokens per target forward
    rows_per_chunk: int = 64  # feature rows per compressed chunk
    chunks_per_file: int = 64  # chunks per zarr shard file (one file per 4096 rows by default)
    writer_processes: int = 4  # shards compressed and written in parallel, per rank
    device: str = "auto"  # "auto": cuda:<local rank> when available, else cpu


@dataclass(frozen=True)
class DrafterConfig:
    size: str = "auto"  # "auto": sized from the target (hidden, heads, MLP, vocab, RoPE); or "tiny", "qwen3.6-27b"
    init_from: str = ""  # an exported drafter directory to start from (fine-tuning)
    block_size: int = 16
    mask_token_id: int = -1  # -1: the store's choice, an unused special token of the target's tokenizer
    # Overrides of the size (0 / empty: the size's own; "auto" uses 5 layers, window 2048).
    num_layers: int = 0
    layer_types: tuple[str, ...] = ()  # e.g. ["sliding_attention", "full_attention"]; empty: sliding except the last
    sliding_window: int = 0
    intermediate_size: int = 0


@dataclass(frozen=True)
class TrainConfig:
    out_dir: str = f"{DEFAULT_ROOT}/runs/drafter"
    epochs: int = 6
    max_steps: int = 0  # 0: run all epochs
    lr: float = 6e-4
    min_lr_ratio: float = 0.0
    warmup_ratio: float = 0.04
    decay: str = "cosine"  # or "linear"
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    clip: float = 1.0
    token_budget: int = 16_384  # real (unpadded) context tokens per micro-batch
    accum_steps: int = 4  # micro-batches per rank per optimizer step
    max_anchors: int = 512
    anchor_budget: int = 1024  # anchors per micro-batch (x block size = drafter rows); bounds short-sequence packs
    gamma: float = 0.0  # 0: the default for the block size (7 for 16)
    loss_chunk: int = 2048  # block rows per LM-head chunk
    seed: int = 0
    holdout_fraction: float = 0.01
    eval_every: int = 500
    eval_batches: int = 16
    log_every: int = 10
    save_every: int = 1000
    keep_last: int = 3
    num_workers: int = 4
    attention: str = "auto"  # "flex" on CUDA, "dense" (SDPA) on CPU
    # torch.compile the drafter layers on CUDA (ignored on the CPU): faster steps (BENCHMARKS.md),
    # minutes added to the first step on a cold compile cache.
    compile: bool = True
    activation_checkpointing: bool = False
    skip_corrupt_shards: bool = False
    log_grad_norm: bool = False
    # Follow a store that stage one is still writing (dflash/follow.py): new shards join at fixed points.
    follow: bool = False
    follow_every: int = 50  # optimizer steps between looks for new shards (and at each segment's end)
    follow_poll_s: float = 10.0  # seconds between looks while waiting for shards
    follow_timeout_s: float = 1800.0  # stop (with a checkpoint) when no shard completes for this long
    wandb: str = "offline"  # "online", "offline" or "disabled"
    wandb_project: str = "dflash"


@dataclass(frozen=True)
class Config:
    target: TargetConfig = field(default_factory=TargetConfig)
    data: DataConfig = field(default_factory=DataConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    extract: ExtractConfig = field(default_factory=ExtractConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def section_hash(self, *sections: str) -> str:
        """sha256 of the named sections, stable across processes (for stores and caches)."""
        chosen = {name: dataclasses.asdict(getattr(self, name)) for name in sections}
        return hashlib.sha256(json.dumps(chosen, sort_keys=True).encode()).hexdigest()


# One line per key for `dflash config show` (tests check that every key has one).
HELP = {
    "target.path": "the frozen target: a checkpoint directory, a .gguf file, or embedded:tiny",
    "target.layer_ids": "decoder layers whose outputs are cached (empty: evenly spaced from 1 to L-3)",
    "target.num_layer_ids": "how many evenly spaced layers when target.layer_ids is empty",
    "target.dtype": "dtype the target runs in: auto (bfloat16 on CUDA, float32 on CPU), bfloat16, float16, float32",
    "target.chat_template": "a Jinja chat template, or a file holding one, replacing the target's own",
    "target.compile": "stage one on CUDA: compile each decoder layer (fuses its elementwise work; the first "
                      "batches wait for the compile); ignored on the CPU",
    "data.source": "JSONL/JSON/Parquet file or directory, embedded:NAME, or a datasets hub name",
    "data.split": "split of a hub dataset",
    "data.max_length": "tokens per sample at most; longer ones are cut (or dropped, see data.overlong)",
    "data.overlong": "what happens to a sample longer than data.max_length: truncate or drop",
    "data.strict": "stop at the first bad row (in file order) instead of counting bad rows",
    "data.num_workers": "tokenizer processes",
    "data.cache_dir": "where tokenization results, the embedded target and converted GGUF targets are cached",
    "store.path": "the zarr store stage one writes and stage two reads",
    "store.codec": "how features are stored: fp8 (e4m3, per-token-per-layer scales) or bf16 (lossless)",
    "store.bucket_edges": "sequence-length bucket edges; every optimizer step mixes several buckets",
    "store.shard_tokens": "tokens per shard (the unit written by one process and committed atomically)",
    "store.labels": "what stage two trains against: data (the dataset's tokens) or target (the target's "
                    "greedy next token at every position, computed and stored by stage one)",
    "store.overwrite": "replace an existing store that holds different content (--overwrite)",
    "extract.batch_tokens": "padded tokens per target forward in stage one",
    "extract.rows_per_chunk": "feature rows per compressed chunk",
    "extract.chunks_per_file": "chunks per zarr shard file",
    "extract.writer_processes": "processes per rank that compress and write shards",
    "extract.device": "auto (cuda:<local rank> when there is one, else cpu), or a device name",
    "drafter.size": "auto (sized from the target), or a named size: tiny, qwen3.6-27b",
    "drafter.init_from": "an exported drafter to start from",
    "drafter.block_size": "tokens per block: the anchor and block_size-1 drafted tokens",
    "drafter.mask_token_id": "token id of the block's mask slots (-1: the store's choice, an unused special token)",
    "drafter.num_layers": "drafter layers (0: the size's own; auto: 5)",
    "drafter.layer_types": "per-layer sliding_attention / full_attention (empty: sliding except the last)",
    "drafter.sliding_window": "window of the sliding layers in positions (0: the size's own; auto: 2048)",
    "drafter.intermediate_size": "MLP width (0: the size's own; auto: the target's)",
    "train.out_dir": "run directory: metrics.jsonl, checkpoints/, W&B files",
    "train.epochs": "passes over the training samples",
    "train.max_steps": "stop after this many optimizer steps (0: all epochs); also the LR schedule's length",
    "train.lr": "peak learning rate (AdamW)",
    "train.min_lr_ratio": "final learning rate as a fraction of train.lr",
    "train.warmup_ratio": "fraction of the steps spent warming the learning rate up",
    "train.decay": "learning-rate decay after warm-up: cosine or linear",
    "train.weight_decay": "AdamW weight decay",
    "train.betas": "AdamW betas",
    "train.clip": "gradient-norm clipping",
    "train.token_budget": "real context tokens per micro-batch at most",
    "train.accum_steps": "micro-batches per rank per optimizer step",
    "train.max_anchors": "anchors (blocks) sampled per sequence at most, fresh every epoch",
    "train.anchor_budget": "anchors per micro-batch at most (x block size = drafter rows)",
    "train.gamma": "decay of the slot loss weights exp(-(k-1)/gamma) (0: 7 for block 16, 5 for 10, 4 for 8)",
    "train.loss_chunk": "block rows per LM-head and loss chunk (bounds the logits' memory)",
    "train.seed": "seed of the data order, anchors, held-out split and initialisation",
    "train.holdout_fraction": "fraction of the store's samples held out of training (eval batches, dflash eval prompts)",
    "train.eval_every": "steps between held-out evaluations",
    "train.eval_batches": "held-out micro-batches per evaluation",
    "train.log_every": "steps between metric lines (the only steps that move numbers to the host)",
    "train.save_every": "steps between checkpoints",
    "train.follow": "train on a store that stage one is still writing: new shards join the first epoch at fixed "
                    "points, every step still mixes lengths (waiting for shards when it cannot), later epochs "
                    "start once the store is finished (stage2-train --follow)",
    "train.follow_every": "with train.follow: optimizer steps between looks for newly completed shards",
    "train.follow_poll_s": "with train.follow: seconds between looks while waiting for shards",
    "train.follow_timeout_s": "with train.follow: stop with a checkpoint when no shard completes for this many seconds",
    "train.keep_last": "checkpoints kept",
    "train.num_workers": "DataLoader worker processes per rank",
    "train.attention": "attention backend: auto (flex on CUDA, dense SDPA on CPU), flex or dense",
    "train.compile": "torch.compile the drafter layers on CUDA (a cold compile costs minutes once)",
    "train.activation_checkpointing": "recompute layer activations in backward to save memory",
    "train.skip_corrupt_shards": "skip (and count) shards and samples that cannot be read instead of stopping",
    "train.log_grad_norm": "log the gradient norm (one more reduction per logging step)",
    "train.wandb": "W&B mode: offline, online or disabled",
    "train.wandb_project": "W&B project name",
}

CHOICES = {
    "data.overlong": ("truncate", "drop"),
    "store.codec": ("bf16", "fp8"),
    "store.labels": ("data", "target"),
    "target.dtype": ("auto", "bfloat16", "float16", "float32"),
    "train.decay": ("cosine", "linear"),
    "train.attention": ("auto", "flex", "dense"),
    "train.wandb": ("online", "offline", "disabled"),
}


def default_config_text() -> str:
    """The embedded tiny default: configs/tiny.toml, installed as dflash.configs, or read from
    the source tree when dflash runs uninstalled (PYTHONPATH=repo)."""
    try:
        return resources.files("dflash.configs").joinpath("tiny.toml").read_text()
    except ModuleNotFoundError:
        return (Path(__file__).resolve().parents[1] / "configs" / "tiny.toml").read_text()


def load_config(path: str | Path | None = None, overrides: typing.Sequence[str] = ()) -> Config:
    """Load TOML (the tiny default when path is None), apply overrides, validate."""
    if path is None:
        raw = tomllib.loads(default_config_text())
    else:
        try:
            raw = tomllib.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {path}") from None
        except tomllib.TOMLDecodeError as err:
            raise ConfigError(f"{path}: invalid TOML: {err}") from None
    for item in overrides:
        section, key, value = parse_override(item)
        raw.setdefault(section, {})[key] = value
    return build_config(raw)


def parse_override(item: str) -> tuple[str, str, object]:
    """'train.lr=3e-4' -> ('train', 'lr', 0.0003); values are TOML, bare words are strings."""
    name, sep, text = item.partition("=")
    section, dot, key = name.strip().partition(".")
    if not sep or not dot or not key:
        raise ConfigError(f"--set {item!r}: expected section.key=value, e.g. train.lr=3e-4")
    try:
        value = tomllib.loads(f"v = {text.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = text.strip()
    return section, key, value


def build_config(raw: dict) -> Config:
    sections = {}
    for section_field in dataclasses.fields(Config):
        values = raw.pop(section_field.name, {})
        if not isinstance(values, dict):
            raise ConfigError(f"[{section_field.name}] must be a table")
        sections[section_field.name] = build_section(section_field.name, section_field.default_factory, values)
    if raw:
        known = {section.name for section in dataclasses.fields(Config)}
        raise ConfigError("unknown config section(s): " + ", ".join(
            f"{section}{did_you_mean(section, known)}" for section in sorted(raw)))
    config = Config(**sections)
    validate(config)
    return config


def build_section(name: str, cls, values: dict):
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError("unknown config key(s): " + ", ".join(
            f"{name}.{key}{did_you_mean(key, known, f'{name}.')}" for key in unknown))
    coerced = {key: coerce(f"{name}.{key}", hints[key], value) for key, value in values.items()}
    return cls(**coerced)


def did_you_mean(name: str, known, prefix: str = "") -> str:
    close = difflib.get_close_matches(name, sorted(known), n=1)
    return f" (did you mean {prefix}{close[0]}?)" if close else ""


def describe(config: Config) -> list[tuple[str, object, object, str]]:
    """Every key as `(section.key, value, default, meaning)`, for `dflash config show`."""
    rows = []
    for section_field in dataclasses.fields(Config):
        section = getattr(config, section_field.name)
        defaults = section_field.default_factory()
        for key_field in dataclasses.fields(section):
            key = f"{section_field.name}.{key_field.name}"
            rows.append((key, getattr(section, key_field.name), getattr(defaults, key_field.name), HELP[key]))
    return rows


def coerce(key: str, hint, value):
    """Check a TOML value against the field's type; ints widen to floats, lists to tuples."""
    if typing.get_origin(hint) is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key} must be a list, got {value!r}")
        item_type = typing.get_args(hint)[0]
        return tuple(coerce(key, item_type, item) for item in value)
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is bool and not isinstance(value, bool):
        raise ConfigError(f"{key} must be true or false, got {value!r}")
    if isinstance(hint, type) and not isinstance(value, hint) or (hint is int and isinstance(value, bool)):
        raise ConfigError(f"{key} must be {hint.__name__}, got {value!r}")
    return value


def validate(config: Config) -> None:
    for key, allowed in CHOICES.items():
        value = lookup(config, key)
        if value not in allowed:
            raise ConfigError(f"{key} must be one of {', '.join(allowed)}, got {value!r}")
    positive = ["data.max_length", "store.shard_tokens", "extract.batch_tokens", "extract.rows_per_chunk",
                "extract.chunks_per_file", "extract.writer_processes",
                "train.epochs", "train.token_budget", "train.accum_steps", "train.max_anchors", "train.anchor_budget",
                "train.loss_chunk", "train.log_every", "train.save_every", "train.keep_last", "train.follow_every",
                "train.eval_every", "drafter.block_size", "target.num_layer_ids"]
    for key in positive:
        if lookup(config, key) <= 0:
            raise ConfigError(f"{key} must be positive, got {lookup(config, key)}")
    edges = config.store.bucket_edges
    if len(edges) < 2 or any(a >= b for a, b in zip(edges, edges[1:])):
        raise ConfigError(f"store.bucket_edges must be at least two increasing lengths, got {list(edges)}")
    if config.data.max_length > edges[-1]:
        raise ConfigError(f"data.max_length ({config.data.max_length}) must not exceed the last "
                          f"store.bucket_edges value ({edges[-1]})")
    if config.data.max_length > config.extract.batch_tokens:
        raise ConfigError(f"extract.batch_tokens ({config.extract.batch_tokens}) must hold one "
                          f"sequence of data.max_length ({config.data.max_length})")
    if config.data.max_length > config.train.token_budget:
        raise ConfigError(f"train.token_budget ({config.train.token_budget}) must hold one "
                          f"sequence of data.max_length ({config.data.max_length})")
    for key in ("drafter.num_layers", "drafter.sliding_window", "drafter.intermediate_size"):
        if lookup(config, key) < 0:
            raise ConfigError(f"{key} must be 0 (the size's own) or positive, got {lookup(config, key)}")
    if config.drafter.mask_token_id < -1:
        raise ConfigError(f"drafter.mask_token_id must be a token id or -1 (the store's choice), "
                          f"got {config.drafter.mask_token_id}")
    if config.train.max_anchors > config.train.anchor_budget:
        raise ConfigError(f"train.anchor_budget ({config.train.anchor_budget}) must hold one "
                          f"sequence's train.max_anchors ({config.train.max_anchors})")
    for key in ("train.follow_poll_s", "train.follow_timeout_s"):
        if lookup(config, key) < 0:
            raise ConfigError(f"{key} must be 0 or more seconds, got {lookup(config, key)}")
    if not 0.0 <= config.train.holdout_fraction < 1.0:
        raise ConfigError(f"train.holdout_fraction must be in [0, 1), got {config.train.holdout_fraction}")
    if not 0.0 <= config.train.warmup_ratio < 1.0:
        raise ConfigError(f"train.warmup_ratio must be in [0, 1), got {config.train.warmup_ratio}")


def lookup(config: Config, key: str):
    section, _, name = key.partition(".")
    return getattr(getattr(config, section), name)


def replace(config: Config, **sections: dict) -> Config:
    """A copy with some section fields changed: replace(cfg, train={"lr": 1e-3})."""
    changed = {name: dataclasses.replace(getattr(config, name), **values) for name, values in sections.items()}
    result = dataclasses.replace(config, **changed)
    validate(result)
    return result
