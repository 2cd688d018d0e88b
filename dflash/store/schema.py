"""The store's format: its keys, schema version, root attributes and their content identity, the
encodings of its arrays (codec chains, bf16 bits, non-finite checks) and the layout queries that
writer and reader share (which shards exist, which are complete).

Layout and attributes follow docs/INTERNALS.md. A shard group `shards/<name>` is written by one
process (dflash/store/writer.py) and carries the group attribute `complete` last, so a crash
never leaves a shard that looks complete; dflash/store/reader.py reads the complete ones. Every
chunk carries a crc32c checksum (the codec chain's last step), and the sharding index carries
its own. Only public zarr API is used, so the modules run on zarr 3.1 and 3.4.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import torch
import zarr
from zarr.codecs import BloscCodec, Crc32cCodec, ZstdCodec

from dflash import __version__
from dflash.data.chat import content_fingerprint, training_sources
from dflash.errors import DflashError

SCHEMA_VERSION = 1
ATTRS_KEY = "dflash"
COMPLETE_KEY = "complete"
# Root attributes that define what the store holds; any difference means another store. The
# target's `path` is not compared (a moved checkpoint is the same target; its weights
# fingerprint and config hash are), nor paths and worker counts (`content` leaves them out).
CONTENT_KEYS = (
    "schema_version", "content", "target", "target_layer_ids", "hidden_size", "codec",
    "tokenizer", "max_length", "bucket_edges", "shards", "topk",
)
LOCATION_KEYS = {"target": ("path",)}
HIDDEN_DTYPES = {"bf16": np.dtype(np.uint16), "fp8": np.dtype(np.uint8)}
LABEL_CHOICES = ("data", "target")
# Soft targets (store.topk): the target's top-k next-token ids and probabilities, p stored as
# round(p * 65535) in a uint16.
TOPK_ARRAYS = ("topk_ids", "topk_probs")
PROB_SCALE = 65535
# bf16 compression: blosc (zstd-1, byte shuffle) by default; bit shuffle wins on trained activations
# and loses on random ones, so it waits for a trained target at the real shape (BENCHMARKS.md, Codecs).
DEFAULT_BF16_COMPRESSION = "blosc"




def root_attributes(config, target: dict, target_layer_ids: list[int], target_text_config: dict, tokenizer: dict,
                    mask_token_id: int, num_truncated: int, shards) -> dict:
    """The root attributes of a store that stage one writes with `config`: the target (`target`:
    its description and weights fingerprint), the cached layers, the tokenizer's identity, the
    mask token chosen for the data, the resolved config, the content identity and the plan's
    shards. Stage two reads them back and compares them (`diff_attrs`)."""
    attrs = {
        "schema_version": SCHEMA_VERSION,
        "package_version": __version__,
        "target": target,
        "target_layer_ids": list(target_layer_ids),
        "target_text_config": target_text_config,
        "hidden_size": target["hidden_size"],
        "codec": config.store.codec,
        "labels": config.store.labels,
        "tokenizer": tokenizer,
        "mask_token_id": mask_token_id,
        "num_truncated": num_truncated,
        "max_length": config.data.max_length,
        "bucket_edges": list(config.store.bucket_edges),
        "config": config.to_dict(),
        "content": content_identity(config),
        **({"sources": source_names(config)} if config.data.mix else {}),
        "shards": [{"name": s.name, "bucket": s.bucket, "num_samples": len(s.sample_indices),
                    "num_tokens": s.num_tokens} for s in shards],
    }
    if config.store.topk:  # only then: a store without soft targets keeps its identity
        attrs["topk"] = config.store.topk
    return attrs


def content_identity(config) -> dict:
    """The stage-one settings that change what the store holds. Paths, worker counts, batch sizes
    and the overwrite flag do not, so a moved store, another `data.num_workers` or a rerun after
    `--overwrite` continue it (the target and tokenizer are compared through their own keys)."""
    identity = {
        "target": {"layer_ids": list(config.target.layer_ids), "num_layer_ids": config.target.num_layer_ids,
                   "dtype": config.target.dtype},
        "data": {**data_sources_identity(config.data),
                 "split": config.data.split, "max_length": config.data.max_length,
                 "overlong": config.data.overlong, "min_supervised": config.drafter.block_size},
        "store": {"codec": config.store.codec, "bucket_edges": list(config.store.bucket_edges),
                  "shard_tokens": config.store.shard_tokens, "labels": config.store.labels},
    }
    if config.store.topk:  # only then, as the root key `topk` (compared even where a store predates it)
        identity["store"]["topk"] = config.store.topk
    return identity


def data_sources_identity(data) -> dict:
    """What the store's data is: `source`, one source's content hash, or with data.mix `sources`,
    `[name, content hash]` of every source in order (a list, so that an added source differs too).
    The weights are not content: they say how stage two samples the store, not what it holds."""
    if not data.mix:
        return {"source": content_fingerprint(data.source, data.split)}
    return {"sources": [[name, content_fingerprint(source, data.split)]
                        for name, source, _ in training_sources(data)]}


def source_names(config) -> list[str] | None:
    """The root attribute `sources`: the names of data.mix's sources in order (their number is each
    shard's `source_ids`), or None for a store of data.source alone."""
    if not config.data.mix:
        return None
    return [name for name, _, _ in training_sources(config.data)]


def row_array_names(codec: str, labels: bool, topk: bool = False) -> list[str]:
    """The per-token arrays of a shard: features, ids, mask, and the fp8 scales, target labels and
    soft targets where the store has them."""
    return (["hidden", "input_ids", "loss_mask"] + (["scale"] if codec == "fp8" else [])
            + (["labels"] if labels else []) + (list(TOPK_ARRAYS) if topk else []))


def store_topk(attrs: dict) -> int:
    """k of a store's soft targets (root attribute `topk`), 0 when it has none."""
    return int(attrs.get("topk", 0))


def probs_to_bits(probs: torch.Tensor) -> torch.Tensor:
    """Probabilities in [0, 1] -> round(p * 65535) as int16 tensors holding the uint16 bits (torch
    narrows int32 -> int16 by wrapping, so the bits equal numpy's uint16 of the same value)."""
    return (probs.float().clamp(0, 1) * PROB_SCALE).round().to(torch.int32).to(torch.int16)


def bits_to_probs(bits: np.ndarray) -> np.ndarray:
    """Stored uint16 probabilities -> float32 in [0, 1]."""
    return np.asarray(bits, dtype=np.float32) / PROB_SCALE


def has_target_labels(attrs: dict) -> bool:
    """Whether a store's root attributes say it holds the target's labels (older stores: data)."""
    return attrs.get("labels", "data") == "target"


class StoreMismatchError(DflashError, RuntimeError):
    """An existing store holds different content than the current config asks for."""


class CorruptShardError(DflashError, RuntimeError):
    """A shard's arrays cannot be opened or decoded."""


# ---------------------------------------------------------------- root attributes


def json_normalized(value: Any) -> Any:
    """What a value looks like after a trip through zarr's JSON attributes (tuples -> lists)."""
    return json.loads(json.dumps(value))


def diff_attrs(old: dict, new: dict) -> dict[str, tuple[Any, Any]]:
    """Content differences between two `dflash` attribute dicts, as `dotted.key -> (old, new)`
    down to the leaves. Keys a store predates (`content`, `target.weights` before they existed)
    are not compared."""
    old, new = json_normalized(old), json_normalized(new)
    differences: dict[str, tuple[Any, Any]] = {}
    for key in CONTENT_KEYS:
        if key not in old and key == "content":
            continue
        mine, theirs = old.get(key), new.get(key)
        if key in LOCATION_KEYS and isinstance(mine, dict) and isinstance(theirs, dict):
            mine = {k: v for k, v in mine.items() if k not in LOCATION_KEYS[key]}
            theirs = {k: v for k, v in theirs.items() if k not in LOCATION_KEYS[key]}
        _diff_values(key, mine, theirs, differences)
    return differences


def _diff_values(key: str, old: Any, new: Any, out: dict) -> None:
    if isinstance(old, dict) and isinstance(new, dict):
        for name in sorted(old):  # a key the store predates (e.g. target.weights) is not compared
            _diff_values(f"{key}.{name}", old[name], new.get(name), out)
    elif old != new:
        out[key] = (old, new)


def check_schema_version(attrs: dict, path: Any) -> None:
    """A store of another format version is refused by name, before any array is read."""
    version = attrs.get("schema_version")
    if version != SCHEMA_VERSION:
        raise StoreMismatchError(
            f"store {path} has schema version {version} (written by dflash {attrs.get('package_version', '?')}); "
            f"this dflash reads version {SCHEMA_VERSION}: rewrite it with this version's stage one "
            f"(--overwrite), or read it with the version that wrote it")


# ---------------------------------------------------------------- codecs and bit views


def hidden_compressors(codec: str, bf16_compression: str = DEFAULT_BF16_COMPRESSION) -> list:
    """Bytes-to-bytes codec chain of the `hidden` array, crc32c last."""
    if codec == "fp8":
        return [ZstdCodec(level=1), Crc32cCodec()]
    if codec != "bf16":
        raise ValueError(f"unknown codec {codec!r}; expected 'bf16' or 'fp8'")
    if bf16_compression == "zstd":
        return [ZstdCodec(level=1), Crc32cCodec()]
    if bf16_compression == "blosc":
        return [BloscCodec(cname="zstd", clevel=1, shuffle="shuffle", typesize=2), Crc32cCodec()]
    raise ValueError(f"unknown bf16_compression {bf16_compression!r}; expected 'blosc' or 'zstd'")


def plain_compressors() -> list:
    return [ZstdCodec(level=1), Crc32cCodec()]


def bf16_to_bits(tensor: torch.Tensor) -> np.ndarray:
    """bf16 tensor -> numpy uint16 with the same bits (CPU copy)."""
    as_bf16 = tensor.detach().to(device="cpu", dtype=torch.bfloat16).contiguous()
    return as_bf16.view(torch.int16).numpy().view(np.uint16)


def bits_to_bf16(bits: np.ndarray) -> torch.Tensor:
    """numpy uint16 bf16 bits -> bf16 tensor (bit-exact)."""
    return torch.from_numpy(np.ascontiguousarray(bits).view(np.int16)).view(torch.bfloat16)


def count_nonfinite(hidden: np.ndarray, codec: str) -> int:
    """NaN/Inf values of encoded hidden rows, read from the bits (no float conversion).

    bf16 (uint16): exponent bits all ones (0x7F80). float8_e4m3fn (uint8) has no Inf and one
    NaN pattern per sign, S.1111.111 (0x7F / 0xFF).
    """
    bits = np.ascontiguousarray(hidden)
    if codec == "bf16":
        return int(np.count_nonzero((bits.view(np.uint16) & 0x7F80) == 0x7F80))
    return int(np.count_nonzero((bits.view(np.uint8) & 0x7F) == 0x7F))


# ---------------------------------------------------------------- layout


FROZEN_WEIGHT_NAMES = ("embed_tokens", "lm_head")


def frozen_weights_complete(group: zarr.Group) -> bool:
    """Whether both frozen-weight arrays carry their completion mark."""
    return all(name in group and group[name].attrs.get(COMPLETE_KEY) for name in FROZEN_WEIGHT_NAMES)


def open_shard(root: zarr.Group, name: str) -> zarr.Group | None:
    """The shard group `shards/<name>`, or None when absent (raises if its metadata is corrupt)."""
    if "shards" not in root:
        return None
    try:
        return root["shards"][name]
    except KeyError:
        return None


def is_complete(group: zarr.Group, name: str) -> bool:
    """True when shard `name` exists and carries its completion mark."""
    try:
        shard = open_shard(group, name)
    except Exception:  # unreadable metadata: the shard is not complete and will be rewritten
        return False
    return shard is not None and COMPLETE_KEY in shard.attrs


def shard_names(root: zarr.Group) -> list[str]:
    """Planned shard names (root attribute `shards`) plus any other shard groups present."""
    planned = [entry["name"] for entry in root.attrs.get(ATTRS_KEY, {}).get("shards", [])]
    present: list[str] = []
    if "shards" in root:
        try:
            present = list(root["shards"].group_keys())
        except Exception:  # a member with corrupt metadata breaks the listing; plan still known
            present = []
    return sorted(set(planned) | set(present))


def completed_shards(group: zarr.Group) -> set[str]:
    """Names of all shards that carry their completion mark."""
    return {name for name in shard_names(group) if is_complete(group, name)}
