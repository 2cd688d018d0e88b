"""Configuration: one frozen dataclass per section, loaded from TOML, overridden with `--set`.

`load_config(path, overrides)` reads a TOML file (or the embedded tiny default when no path
is given), applies `section.key=value` overrides, and validates everything once, raising
`ConfigError` with the offending key. The dataclass defaults describe a real run on the
reference machine (paths under /data/dflash, the 27B-sized drafter).
"""

import dataclasses
import difflib
import tomllib
import typing
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from dflash.data.chat import training_sources
from dflash.data.samples import OVERLONG_POLICIES
from dflash.errors import DflashError
from dflash.model.loss import CE_KERNELS, DISTILL_KINDS
from dflash.model.masks import BACKENDS as ATTENTION_BACKENDS
from dflash.recipe import BLOCK_SIZE
from dflash.store.codecs import CODECS
from dflash.store.schema import LABEL_CHOICES

DEFAULT_ROOT = "/data/dflash"
WANDB_MODES = ("offline", "online", "disabled")  # train.wandb; dflash.train.metrics opens the run
HOLDOUT_UNITS = ("prompt", "sample")  # train.holdout_by; dflash.train.sampler.split_holdout splits by them


class ConfigError(DflashError, ValueError):
    """A config value is missing, unknown or invalid; the message names the key."""


def setting(default, meaning: str, *, choices: tuple = (), positive: bool = False, minimum=None, maximum=None,
            below=None):
    """A config key: its default and its meaning (the line `dflash config show` prints), the values
    it may take, whether it must be positive, and its bounds: at least `minimum`, at most `maximum`,
    less than `below` (all checked by `validate` at load, so `config show` refuses a bad value too)."""
    return field(default=default, metadata={"meaning": meaning, "choices": tuple(choices), "positive": positive,
                                            "minimum": minimum, "maximum": maximum, "below": below})


def allowed_range(metadata) -> str:
    """The bounds of a numeric key in words, e.g. '> 0', '>= 0', 'in [0, 1)'."""
    low = "(0" if metadata["positive"] else (f"[{metadata['minimum']}" if metadata["minimum"] is not None else "")
    high = (f"{metadata['maximum']}]" if metadata["maximum"] is not None
            else f"{metadata['below']})" if metadata["below"] is not None else "")
    if low and high:
        return f"in {low}, {high}"
    if low:
        return "> 0" if metadata["positive"] else f">= {metadata['minimum']}"
    return f"<= {metadata['maximum']}" if metadata["maximum"] is not None else f"< {metadata['below']}"


def within_bounds(metadata, value) -> bool:
    return not ((metadata["positive"] and value <= 0)
                or (metadata["minimum"] is not None and value < metadata["minimum"])
                or (metadata["maximum"] is not None and value > metadata["maximum"])
                or (metadata["below"] is not None and value >= metadata["below"]))


@dataclass(frozen=True)
class TargetConfig:
    path: str = setting(f"{DEFAULT_ROOT}/target",
                        "the frozen target: a checkpoint directory, a .gguf file, or embedded:tiny")
    layer_ids: tuple[int, ...] = setting(
        (), "decoder layers whose outputs are cached (empty: evenly spaced from 1 to L-3, docs/ARCHITECTURE.md)",
        minimum=0)
    num_layer_ids: int = setting(5, "how many evenly spaced layers when target.layer_ids is empty", positive=True)
    dtype: str = setting("auto", "dtype the target runs in: auto (bfloat16 on CUDA, float32 on CPU), bfloat16, "
                         "float16, float32", choices=("auto", "bfloat16", "float16", "float32"))
    chat_template: str = setting("", "a Jinja chat template, or a file holding one, replacing the target's own")
    compile: bool = setting(False, "stage one on CUDA: compile each decoder layer (fuses its elementwise work; the "
                            "first batches wait for the compile); ignored on the CPU")


@dataclass(frozen=True)
class MixSource:
    """One source of a training mix (`data.mix`): where its rows are and its share of the tokens."""
    source: str = setting("", "JSONL/JSON/Parquet file or directory, embedded:NAME, or a datasets hub name")
    weight: float = setting(1.0, "its share of each epoch's tokens (the weights of a mix are normalised)",
                            positive=True)
    name: str = setting("", "the name results and `--prompts heldout:NAME` use (empty: the source's last path part)")


@dataclass(frozen=True)
class DataConfig:
    source: str = setting(f"{DEFAULT_ROOT}/data",
                          "JSONL/JSON/Parquet file or directory, embedded:NAME, or a datasets hub name")
    mix: tuple[MixSource, ...] = setting(
        (), "several sources with a weight each; when set, data.source is not read: a list of tables "
        "{source = ..., weight = ..., name = ...} (weights are shares of each epoch's tokens)")
    split: str = setting("train", "split of a hub dataset")
    max_length: int = setting(4096, "tokens per sample at most; longer ones are cut (or dropped, see data.overlong)",
                              positive=True)
    overlong: str = setting("truncate", "what happens to a sample longer than data.max_length: truncate or drop",
                            choices=OVERLONG_POLICIES)
    strict: bool = setting(False, "stop at the first bad row (in file order) instead of counting bad rows")
    num_workers: int = setting(8, "tokenizer processes (0 or 1: in this process)", minimum=0)
    cache_dir: str = setting(f"{DEFAULT_ROOT}/cache",
                             "where tokenization results, the embedded target and converted GGUF targets are cached")


def validate_mix(data: DataConfig) -> None:
    """data.mix: every table names a source, and the names (given or defaulted) are unique."""
    seen = {}
    for index, (name, source, _) in enumerate(training_sources(data) if data.mix else []):
        if not source.strip():
            raise ConfigError(f"data.mix[{index}].source is empty: give the source's path or name")
        if not name:
            raise ConfigError(f"data.mix[{index}].name: the source {source!r} has no default name; set one")
        if name in seen:
            raise ConfigError(f"data.mix[{index}].name: {name!r} is also the name of data.mix[{seen[name]}]; "
                              f"names must be unique (set name = \"...\" on one of them)")
        seen[name] = index


@dataclass(frozen=True)
class StoreConfig:
    path: str = setting(f"{DEFAULT_ROOT}/store", "the zarr store stage one writes and stage two reads")
    codec: str = setting("fp8", "how features are stored: fp8 (e4m3, per-token-per-layer scales) or bf16 (lossless)",
                         choices=CODECS)
    bucket_edges: tuple[int, ...] = setting((64, 256, 512, 1024, 2048, 3296, 8192),
                                            "sequence-length bucket edges; every optimizer step mixes several buckets",
                                            minimum=1)
    shard_tokens: int = setting(262_144, "tokens per shard (the unit written by one process and committed "
                                "atomically)", positive=True)
    labels: str = setting("data", "what stage two trains against: data (the dataset's tokens) or target (the "
                          "target's greedy next token at every position, computed and stored by stage one)",
                          choices=LABEL_CHOICES)
    topk: int = setting(0, "soft targets: stage one also stores the target's k most likely next tokens and their "
                        "probabilities at every supervised position, for train.distill_weight (0: off)", minimum=0)
    overwrite: bool = setting(False, "replace an existing store that holds different content (--overwrite)")


@dataclass(frozen=True)
class ExtractConfig:
    batch_tokens: int = setting(32_768, "padded tokens per target forward in stage one", positive=True)
    rows_per_chunk: int = setting(64, "feature rows per compressed chunk", positive=True)
    chunks_per_file: int = setting(64, "chunks per zarr shard file (one file per 4096 rows by default)",
                                   positive=True)
    writer_processes: int = setting(4, "processes per rank that compress and write shards", positive=True)
    device: str = setting("auto", "auto (cuda:<local rank> when there is one, else cpu), or a device name")


@dataclass(frozen=True)
class DrafterConfig:
    size: str = setting("auto", "auto (sized from the target: hidden, heads, MLP, vocab, RoPE), or a named size: "
                        "tiny, qwen3.6-27b")
    init_from: str = setting("", "an exported drafter directory to start from (fine-tuning)")
    block_size: int = setting(BLOCK_SIZE, "tokens per block: the anchor and block_size-1 drafted tokens",
                              minimum=2)
    mask_token_id: int = setting(-1, "token id of the block's mask slots (-1: the store's choice, an unused "
                                 "special token of the target's tokenizer)", minimum=-1)
    num_layers: int = setting(0, "drafter layers (0: the size's own; auto: 5)", minimum=0)
    layer_types: tuple[str, ...] = setting((), "per-layer sliding_attention / full_attention (empty: sliding "
                                           "except the last)")
    sliding_window: int = setting(0, "window of the sliding layers in positions (0: the size's own; auto: 2048)",
                                 minimum=0)
    intermediate_size: int = setting(0, "MLP width (0: the size's own; auto: the target's)", minimum=0)


@dataclass(frozen=True)
class TrainConfig:
    out_dir: str = setting(f"{DEFAULT_ROOT}/runs/drafter", "run directory: metrics.jsonl, checkpoints/, W&B files")
    epochs: int = setting(6, "passes over the training samples", positive=True)
    max_steps: int = setting(0, "stop after this many optimizer steps (0: all epochs); also the LR schedule's length",
                             minimum=0)
    max_minutes: float = setting(0.0, "stop (and save) at the first logging step after this many minutes of this "
                                 "process's training, compile included (0: no limit); the LR schedule still "
                                 "follows the steps, so a stop before them ends above train.min_lr_ratio", minimum=0)
    lr: float = setting(6e-4, "peak learning rate (AdamW)", positive=True)
    min_lr_ratio: float = setting(0.0, "final learning rate as a fraction of train.lr", minimum=0, maximum=1)
    warmup_ratio: float = setting(0.04, "fraction of the steps spent warming the learning rate up", minimum=0,
                                  below=1)
    decay: str = setting("cosine", "learning-rate decay after warm-up: cosine or linear", choices=("cosine", "linear"))
    weight_decay: float = setting(0.0, "AdamW weight decay", minimum=0)
    betas: tuple[float, float] = setting((0.9, 0.95), "AdamW betas", minimum=0, below=1)
    clip: float = setting(1.0, "gradient-norm clipping (the largest norm kept)", positive=True)
    optimizer: str = setting("auto", "AdamW's update: torch (torch's fused AdamW), triton (dflash's Triton kernel, "
                             "the same update and state, CUDA with Triton installed; dflash/train/adamw_kernel.py) "
                             "or auto (triton where it runs, else torch)", choices=("auto", "torch", "triton"))
    token_budget: int = setting(16_384, "real (unpadded) context tokens per micro-batch at most", positive=True)
    accum_steps: int = setting(4, "micro-batches per rank per optimizer step", positive=True)
    fuse_accum: bool = setting(False, "run each rank's accum_steps micro-batches of a step (different length buckets) "
                               "as one packed micro-batch: the same samples, anchors and loss (each micro-batch's "
                               "mean, averaged), one forward and backward instead of accum_steps; faster where a "
                               "micro-batch leaves the GPU underused (the small drafter), accum_steps times the "
                               "activation memory")
    gather_context_keys: bool = setting(False, "with flex attention, give each query tile its own copy of the "
                                        "context keys it reads, so no key tile is read by two query tiles in "
                                        "flex's backward (the loader's workers lay them out); not yet measured "
                                        "faster on a GPU, so off (on, train.attention = \"auto\" picks flex)")
    max_anchors: int = setting(512, "anchors (blocks) sampled per sequence at most, fresh every epoch", positive=True)
    anchor_budget: int = setting(1024, "anchors per micro-batch at most (x block size = drafter rows); bounds "
                                 "short-sequence packs", positive=True)
    gamma: float = setting(0.0, "decay of the slot loss weights exp(-(k-1)/gamma) (0: 7 for block 16, 5 for 10, "
                           "4 for 8)", minimum=0)
    distill_weight: float = setting(0.0, "weight of the distillation term added to the cross entropy (0: off; "
                                    "needs a store written with store.topk > 0)", minimum=0)
    distill: str = setting("kl", "distillation term: kl (forward KL from the target's top-k distribution) or tv "
                           "(total variation), over the stored k tokens and one bucket for the rest",
                           choices=DISTILL_KINDS)
    loss_chunk: int = setting(2048, "block rows per LM-head and loss chunk (bounds the logits' memory)", positive=True)
    loss_kernel: str = setting("auto", "the cross entropy's pass over each chunk's logits on CUDA: compiled "
                               "(inductor's), triton (dflash's kernel: dflash/model/ce_kernel.py) or auto (triton "
                               "where Triton runs, else compiled); the CPU runs it eagerly whatever the setting",
                               choices=("auto", *CE_KERNELS))
    cast_weights_once: bool = setting(False, "cast the fp32 master weights to bf16 once per optimizer step for all "
                                      "its micro-batches, and add each micro-batch's weight gradients into the fp32 "
                                      "gradients in one pass (CUDA; dflash.model.drafter.weights_cast_once): the "
                                      "same gradients, less memory traffic when train.accum_steps > 1; not yet "
                                      "timed, so off")
    warm_kernels: bool = setting(True, "compile dflash's own Triton kernels (blockwise attention, the loss pass, "
                                 "AdamW) in background threads at the start, beside the first step's tracing, so "
                                 "their first launch finds them compiled, and start inductor's compile workers "
                                 "before the store and model are set up (CUDA; dflash/train/warm_kernels.py)")
    seed: int = setting(0, "seed of the data order, anchors, held-out split and initialisation",
                        minimum=0)
    holdout_fraction: float = setting(0.01, "fraction of the store's samples held out of training (eval batches, "
                                      "dflash eval prompts)", minimum=0, below=1)
    holdout_by: str = setting("prompt", "what the held-out split keeps apart: 'prompt' holds out every answer to a "
                              "held-out prompt (several answers per prompt never reach both sides), 'sample' draws "
                              "samples alone; a following run (train.follow) draws samples per shard",
                              choices=HOLDOUT_UNITS)
    eval_every: int = setting(500, "steps between held-out evaluations", positive=True)
    eval_batches: int = setting(16, "held-out micro-batches per evaluation", minimum=0)
    eval_served_tokens: int = setting(0, "N > 0: each evaluation also logs eval/served_tau, the tau `dflash eval "
                                      "--max-new-tokens N` would serve at temperature 0, walked verification by "
                                      "verification over the first N tokens of the held-out answers that are the "
                                      "target's greedy ones (needs store.labels = 'target'; 0: off)", minimum=0)
    log_every: int = setting(10, "steps between metric lines (the only steps that move numbers to the host)",
                             positive=True)
    save_every: int = setting(1000, "steps between checkpoints", positive=True)
    keep_last: int = setting(3, "checkpoints kept", positive=True)
    num_workers: int = setting(4, "DataLoader worker processes per rank (0: in this process)", minimum=0)
    attention: str = setting("auto", "attention backend: auto (on an H100 or newer, capability 9.0, blockwise for "
                             "heads of 64 or 128 dims where Triton is installed and train.gather_context_keys is off, "
                             "else flex; dense SDPA on the CPU), flex, dense or blockwise (dflash's own Triton kernels "
                             "over each row's key ranges; CUDA; the SmolLM2-sized drafter's step 4% faster than flex "
                             "on an H100)",
                             choices=("auto", *ATTENTION_BACKENDS))
    compile: bool = setting(True, "torch.compile the drafter layers on CUDA, ignored on the CPU: faster steps "
                            "(BENCHMARKS.md), minutes added to the first step on a cold compile cache")
    activation_checkpointing: bool = setting(False, "recompute layer activations in backward to save memory")
    skip_corrupt_shards: bool = setting(False, "skip (and count) shards and samples that cannot be read instead "
                                        "of stopping")
    log_grad_norm: bool = setting(False, "log the gradient norm (one more reduction per logging step)")
    follow: bool = setting(False, "train on a store that stage one is still writing (dflash/train/follow.py): new shards "
                           "join the first epoch at fixed points, every step still mixes lengths (waiting for "
                           "shards when it cannot), later epochs start once the store is finished "
                           "(stage2-train --follow)")
    follow_every: int = setting(50, "with train.follow: optimizer steps between looks for newly completed shards "
                                "(and at each segment's end)", positive=True)
    follow_poll_s: float = setting(10.0, "with train.follow: seconds between looks while waiting for shards",
                                  minimum=0)
    follow_timeout_s: float = setting(1800.0, "with train.follow: stop with a checkpoint when no shard completes "
                                      "for this many seconds", minimum=0)
    wandb: str = setting("offline", "W&B mode: offline, online or disabled", choices=WANDB_MODES)
    wandb_project: str = setting("dflash", "W&B project name")


@dataclass(frozen=True)
class GenerateConfig:
    max_new_tokens: int = setting(1024, "`dflash recipe`: tokens per answer at most, for a source that sets no "
                                  "new_tokens", positive=True)
    rows_per_shard: int = setting(1024, "`dflash recipe`: prompts per answers shard (the unit a killed generate "
                                  "resumes by)", positive=True)


@dataclass(frozen=True)
class EvalConfig:
    num_prompts: int = setting(16, "`dflash recipe`: prompts per eval, for an eval set that sets no num_prompts",
                               positive=True)
    max_new_tokens: int = setting(128, "`dflash recipe`: tokens per prompt at most, for an eval set that sets no "
                                  "new_tokens", positive=True)
    seed: int = setting(0, "`dflash recipe`: the sampling seed of evals at temperature > 0")
    target_graphs: bool = setting(False, "`dflash recipe`: its evals served untimed (side by side, timed later) decode "
                                  "the target over a static cache, each forward a CUDA graph (`dflash eval "
                                  "--target-graphs`): the same outputs, about 6x faster a token (12-06, H100)")
    timed_target_graphs: bool = setting(False, "`dflash recipe`: the speed figures (the timed prompts) decode the "
                                        "target as CUDA graphs over a static cache too, as engines serve it; false: "
                                        "with transformers' forward, the baseline of the figures since 12-01")


@dataclass(frozen=True)
class RecipeSource:
    """One source of `dflash recipe`'s answers (`recipe.sources`): the target answers its prompts."""
    name: str = setting("", "the source's name: its answers folder (run_dir/answers/NAME), its data.mix name "
                        "and `--prompts heldout:NAME`")
    source: str = setting("", "the prompts: a data source (embedded:NAME, a file or folder)")
    weight: float = setting(1.0, "its share of each epoch's tokens in data.mix", positive=True)
    samples: int = setting(0, "sampled answers per prompt at `temperature` (0: the greedy answer alone)")
    temperature: float = setting(0.0, "the sampling temperature of the sampled answers")
    ask_temperature: float = setting(0.0, "> 0: the target first writes each prompt from the row's start "
                                     "(`dflash generate --ask-temperature`)")
    limit: int = setting(0, "only the first N prompts (0: all)")
    turns: int = setting(1, "conversation turns the target writes (`dflash generate --turns`; 1: one answer)",
                         positive=True)
    new_tokens: int = setting(0, "tokens per answer at most (0: generate.max_new_tokens)")


@dataclass(frozen=True)
class RecipeEval:
    """One eval set of `dflash recipe` (`recipe.evals`), served at each of its temperatures."""
    name: str = setting("", "the eval's name: its results file run_dir/results/eval-NAME-tT.json")
    prompts: str = setting("heldout", "`dflash eval --prompts`: heldout, heldout:SOURCE or a data source "
                           "(embedded:humaneval)")
    temperatures: tuple[float, ...] = setting((0.0,), "serving temperatures, one eval each")
    proposals: tuple[str, ...] = setting((), "`dflash eval --proposal`, several served side by side (empty: the "
                                         "eval's default, auto: where the target can verify a tree tree:64x16 at "
                                         "temperature 0 and stree:256x32 above it, else sample)")
    num_prompts: int = setting(0, "prompts served (0: eval.num_prompts)")
    new_tokens: int = setting(0, "tokens per prompt at most (0: eval.max_new_tokens)")
    curve: bool = setting(True, "with recipe.curve: serve every checkpoint at temperature 0, not the last alone")
    workers: int = setting(1, "`dflash eval --workers`: processes side by side, each serving a share of the prompts",
                           positive=True)


@dataclass(frozen=True)
class RecipeConfig:
    run_dir: str = setting("runs/recipe", "`dflash recipe`'s folder: answers, store, drafter, exports, results, "
                           "report")
    sources: tuple[RecipeSource, ...] = setting(
        (), "the sources the target answers, a list of tables [[recipe.sources]] (empty: data.source, greedy)")
    evals: tuple[RecipeEval, ...] = setting(
        (), "the eval sets, a list of tables [[recipe.evals]] (empty: the held-out prompts at temperature 0)")
    curve: bool = setting(True, "export and serve every saved checkpoint (the served curve), not the last alone")
    parallel_generates: bool = setting(True, "the sources' generates side by side on the one GPU (else in turn)")
    parallel_evals: bool = setting(True, "the evals side by side on the one GPU (else in turn); side by side, they "
                                   "serve untimed and `dflash time-evals` times timed_prompts of each alone at the end")
    timed_prompts: int = setting(4, "evals side by side (or with workers > 1): the prompts per eval, spread over "
                                 "its set, whose times make its speedup, decoded again in one process alone on the "
                                 "GPU once the evals have ended (0: every prompt, timed beside the others)",
                                 minimum=0)
    walk: bool = setting(True, "walk the temperature-0 held-out evals' prompts teacher-forced through their "
                         "checkpoints (needs store.labels = \"target\")")


@dataclass(frozen=True)
class Config:
    target: TargetConfig = field(default_factory=TargetConfig)
    data: DataConfig = field(default_factory=DataConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    extract: ExtractConfig = field(default_factory=ExtractConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    generate: GenerateConfig = field(default_factory=GenerateConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    recipe: RecipeConfig = field(default_factory=RecipeConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


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
            f"{section}{did_you_mean(section, known)}" for section in sorted(raw)) + "; the sections are "
            + ", ".join(sorted(known)))
    config = Config(**sections)
    validate(config)
    return config


def build_section(name: str, cls, values: dict):
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError("unknown config key(s): " + ", ".join(
            f"{name}.{key}{did_you_mean(key, known, f'{name}.')}" for key in unknown) + "; `dflash config show` "
            "lists every key")
    coerced = {key: coerce(f"{name}.{key}", hints[key], value) for key, value in values.items()}
    return cls(**coerced)


def did_you_mean(name: str, known, prefix: str = "") -> str:
    close = difflib.get_close_matches(name, sorted(known), n=1)
    return f" (did you mean {prefix}{close[0]}?)" if close else ""


def key_fields(config: Config) -> typing.Iterator[tuple[str, dataclasses.Field]]:
    """Every key as `(section.key, its field)`, in the order of the sections."""
    for section_field in dataclasses.fields(Config):
        for key_field in dataclasses.fields(getattr(config, section_field.name)):
            yield f"{section_field.name}.{key_field.name}", key_field


def describe(config: Config) -> list[tuple[str, object, object, str]]:
    """Every key as `(section.key, value, default, meaning)`, for `dflash config show`."""
    return [(key, lookup(config, key), key_field.default, key_field.metadata["meaning"])
            for key, key_field in key_fields(config)]


def coerce(key: str, hint, value):
    """Check a TOML value against the field's type; ints widen to floats, lists to tuples, tables
    to the field's table dataclass (a list of tables: `data.mix`)."""
    if typing.get_origin(hint) is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key} must be a list, got {value!r}")
        item_type = typing.get_args(hint)[0]
        if dataclasses.is_dataclass(item_type):
            return tuple(coerce(f"{key}[{index}]", item_type, item) for index, item in enumerate(value))
        return tuple(coerce(key, item_type, item) for item in value)
    if dataclasses.is_dataclass(hint):
        if dataclasses.is_dataclass(value):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{key} must be a table {{key = value, ...}}, got {value!r}")
        return build_section(key, hint, dict(value))
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is bool and not isinstance(value, bool):
        raise ConfigError(f"{key} must be true or false, got {value!r}")
    if isinstance(hint, type) and not isinstance(value, hint) or (hint is int and isinstance(value, bool)):
        raise ConfigError(f"{key} must be {hint.__name__}, got {value!r}")
    return value


def validate(config: Config) -> None:
    for key, key_field in key_fields(config):
        validate_value(key, key_field, lookup(config, key))
    validate_mix(config.data)
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
    if config.train.max_anchors > config.train.anchor_budget:
        raise ConfigError(f"train.anchor_budget ({config.train.anchor_budget}) must hold one "
                          f"sequence's train.max_anchors ({config.train.max_anchors})")
    if config.train.eval_served_tokens and config.store.labels != "target":
        raise ConfigError(f"train.eval_served_tokens = {config.train.eval_served_tokens} finds the target's greedy "
                          f"answers by the target's labels: it needs store.labels = \"target\", got "
                          f"\"{config.store.labels}\"")
    if config.train.eval_served_tokens > config.train.max_anchors:
        raise ConfigError(f"train.max_anchors ({config.train.max_anchors}) must be at least "
                          f"train.eval_served_tokens ({config.train.eval_served_tokens}): the held-out micro-batches "
                          f"are packed by it and the walk reads an anchor at every one of those positions")


def validate_value(key: str, key_field: dataclasses.Field, value) -> None:
    """A key's own rules (its `setting`), and those of each table of a list of tables."""
    allowed = key_field.metadata["choices"]
    if allowed and value not in allowed:
        raise ConfigError(f"{key} must be one of {', '.join(allowed)}, got {value!r}")
    metadata = key_field.metadata
    bounded = metadata["positive"] or any(metadata[bound] is not None for bound in ("minimum", "maximum", "below"))
    if bounded:
        values = value if isinstance(value, tuple) else (value,)
        for item in values:
            if not within_bounds(metadata, item):
                raise ConfigError(f"{key} must be {allowed_range(metadata)}, got {value}")
    tables = value if isinstance(value, tuple) else ()
    for index, table in enumerate(tables):
        if dataclasses.is_dataclass(table):
            for table_field in dataclasses.fields(table):
                validate_value(f"{key}[{index}].{table_field.name}", table_field, getattr(table, table_field.name))


def show_value(value) -> str:
    """A value as `dflash config show` prints it: lists as lists, tables as TOML inline tables."""
    if dataclasses.is_dataclass(value):
        return "{" + ", ".join(f"{item.name} = {show_value(getattr(value, item.name))}"
                               for item in dataclasses.fields(value)) + "}"
    if isinstance(value, tuple):
        return "[" + ", ".join(show_value(item) for item in value) + "]"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value)


def lookup(config: Config, key: str):
    section, _, name = key.partition(".")
    return getattr(getattr(config, section), name)


def replace(config: Config, **sections: dict) -> Config:
    """A copy with some section fields changed: replace(cfg, train={"lr": 1e-3})."""
    changed = {name: dataclasses.replace(getattr(config, name), **values) for name, values in sections.items()}
    result = dataclasses.replace(config, **changed)
    validate(result)
    return result
