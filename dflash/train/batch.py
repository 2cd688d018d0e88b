"""Stage-two data: a map-style dataset over the store and the collate that packs micro-batches.

`StoreDataset[(epoch, i)]` reads sample i and draws its anchors for that epoch;
`collate_packed` concatenates a micro-batch's samples into one packed row laid out as in
docs/INTERNALS.md "Stage-two tensors"; `epoch_loader` is the DataLoader over one rank's part of
an epoch's schedule. Context features stay encoded (bf16 bits as uint16,
or fp8 bits as uint8 plus per-token-per-layer scales): they are decoded on the GPU, which
halves (bf16) or quarters (fp8) the bytes that cross the host-device link compared to float32.

Padding: the token axis T and the anchor axis A are padded up to a multiple of
`pad_multiple` (a few fixed shapes bound flex-attention recompiles). Padded tokens and
padded anchors carry doc id -1, which the mask rule (dflash/model/masks.py) never lets a real
query see nor a padded query see any context; padded anchors are also `anchor_valid=False`
so they carry no loss.
"""

from __future__ import annotations

from functools import partial

import numpy as np
import torch
import torch.utils.data

from dflash.data.chat import row_label
from dflash.model.anchors import anchor_rng, sample_anchors
from dflash.model.loss import label_rows
from dflash.model.masks import layer_windows, mask_tile
from dflash.model.tiles import (PADDING_DOC, TILE, gather_context_keys, keys_key, tile_layout, tiles_key,
                                transpose_layout, transposed_key)
from dflash.padding import micro_batch_multiple, round_up
from dflash.store.schema import CorruptShardError, bits_to_probs
from dflash.train.served import window_anchors


class StoreDataset(torch.utils.data.Dataset):
    """Map-style dataset: `dataset[(epoch, i)]` is sample i of the store with its anchors.

    Anchors come from `anchor_rng(seed, epoch, row_id, source)`: keyed by the sample's source row id,
    not its store index, so a sample keeps its anchors when the store is re-planned (other
    bucket edges or shard sizes reorder the index but not the row ids), and the draw does not
    depend on the worker or the order of reads.

    With `served_tokens` (the held-out tau as served, dflash.train.served), a sample's anchors are
    every position of its answer's first `served_tokens` tokens instead.
    """

    def __init__(self, reader, max_anchors: int, seed: int, skip_corrupt: bool = False, served_tokens: int = 0):
        self.reader = reader
        self.max_anchors = max_anchors
        self.served_tokens = served_tokens
        self.seed = seed
        self.skip_corrupt = skip_corrupt

    def __len__(self) -> int:
        return len(self.reader)

    def __getitem__(self, key: tuple[int, ...]) -> dict:
        """`(epoch, index)`, or `(epoch, index, group)`: the sample's micro-batch within a fused step
        (`train.fuse_accum`), carried to the collate."""
        epoch, index, *group = key
        try:
            sample = self.reader.read_sample(index)
        except CorruptShardError as error:
            if not self.skip_corrupt:
                raise
            # Counted and reported by the trainer (`skipped` of the micro-batch), never trained on.
            return {"corrupt": str(error), "sample_index": int(index), "epoch": int(epoch)}
        num_tokens = len(sample["input_ids"])
        if sample["hidden"].shape[0] != num_tokens or len(sample["loss_mask"]) != num_tokens:
            raise ValueError(
                f"sample {index} ({row_label(sample['row_id'])}): hidden has {sample['hidden'].shape[0]} rows, "
                f"input_ids {num_tokens}, loss_mask {len(sample['loss_mask'])}"
            )
        if self.served_tokens:
            anchors = window_anchors(sample["loss_mask"], self.served_tokens)
        else:
            anchors = sample_anchors(sample["loss_mask"], self.max_anchors, anchor_rng(self.seed, epoch,
                                                                                      int(sample["row_id"]),
                                                                                      int(sample.get("source", 0))))
        item = {
            **sample,
            "anchors": anchors,
            "sample_index": int(index),
            "epoch": int(epoch),
            "bucket": int(self.reader.index["bucket"][index]),
        }
        if group:
            item["group"] = int(group[0])
        return item


def _pack_tokens(items: list[dict], num_tokens: int) -> dict[str, np.ndarray]:
    """Token-axis arrays of the packed row, padded to `num_tokens`."""
    num_real = sum(len(item["input_ids"]) for item in items)
    hidden_first = items[0]["hidden"]
    # One copy per sample straight into place (the features are most of the bytes); only the
    # padding rows are zeroed.
    hidden_TF = np.empty((num_tokens, hidden_first.shape[1]), dtype=hidden_first.dtype)
    start = 0
    for item in items:
        hidden_TF[start:start + len(item["hidden"])] = item["hidden"]
        start += len(item["hidden"])
    hidden_TF[num_real:] = 0
    packed = {
        "hidden": hidden_TF,
        "input_ids": np.zeros(num_tokens, dtype=np.int64),
        "loss_mask": np.zeros(num_tokens, dtype=bool),
        "position_ids": np.zeros(num_tokens, dtype=np.int64),
        "doc_ids": np.full(num_tokens, PADDING_DOC, dtype=np.int64),
    }
    packed["input_ids"][:num_real] = np.concatenate([item["input_ids"] for item in items])
    packed["loss_mask"][:num_real] = np.concatenate([item["loss_mask"] for item in items])
    packed["position_ids"][:num_real] = np.concatenate([np.arange(len(item["input_ids"])) for item in items])
    packed["doc_ids"][:num_real] = np.repeat(np.arange(len(items)), [len(item["input_ids"]) for item in items])
    if items[0].get("labels") is not None:
        packed["labels"] = np.zeros(num_tokens, dtype=np.int64)
        packed["labels"][:num_real] = np.concatenate([item["labels"] for item in items])
    if items[0].get("topk_ids") is not None:  # soft targets, decoded here: ids int64, probabilities float32
        k = items[0]["topk_ids"].shape[1]
        packed["topk_ids"] = np.zeros((num_tokens, k), dtype=np.int64)
        packed["topk_ids"][:num_real] = np.concatenate([item["topk_ids"] for item in items])
        packed["topk_probs"] = np.zeros((num_tokens, k), dtype=np.float32)
        packed["topk_probs"][:num_real] = bits_to_probs(np.concatenate([item["topk_probs"] for item in items]))
    if items[0]["scale"] is not None:
        # pad rows decode to zero whatever the scale; 1.0 keeps them finite under any decode
        scale_TN = np.ones((num_tokens, items[0]["scale"].shape[1]), dtype=np.float32)
        scale_TN[:num_real] = np.concatenate([item["scale"] for item in items])
        packed["scale"] = scale_TN
    return packed


def _pack_anchors(items: list[dict], num_tokens: int, num_anchors: int) -> dict[str, np.ndarray]:
    """Anchor-axis arrays, sorted by flat index; padded anchors sit at the last token, doc -1."""
    offsets = np.cumsum([0] + [len(item["input_ids"]) for item in items])
    anchor_pos = [np.asarray(item["anchors"], dtype=np.int64) for item in items]
    num_real = sum(len(a) for a in anchor_pos)
    packed = {
        "anchor_pos": np.zeros(num_anchors, dtype=np.int64),
        "anchor_doc": np.full(num_anchors, PADDING_DOC, dtype=np.int64),
        "anchor_index": np.full(num_anchors, num_tokens - 1, dtype=np.int64),
        "anchor_valid": np.zeros(num_anchors, dtype=bool),
    }
    if num_real:
        packed["anchor_pos"][:num_real] = np.concatenate(anchor_pos)
        packed["anchor_doc"][:num_real] = np.repeat(np.arange(len(items)), [len(a) for a in anchor_pos])
        packed["anchor_index"][:num_real] = np.concatenate([offsets[d] + a for d, a in enumerate(anchor_pos)])
        packed["anchor_valid"][:num_real] = True
    return packed


def fused_groups(items: list[dict], anchor_doc: np.ndarray) -> tuple[np.ndarray, list[int]] | None:
    """For the samples of a fused step (`train.fuse_accum`: items carry their micro-batch as `group`):
    each anchor's group `(A,)`, numbered 0..G-1 over the groups that have a readable sample (as the
    unfused step drops a micro-batch whose every sample was skipped; padded anchors get 0), and each
    group's bucket. None for an ordinary micro-batch."""
    if not items or "group" not in items[0]:
        return None
    present = sorted({item["group"] for item in items})
    number = {group: position for position, group in enumerate(present)}
    doc_group = np.array([number[item["group"]] for item in items], dtype=np.int64)
    anchor_group = np.where(anchor_doc >= 0, doc_group[np.maximum(anchor_doc, 0)], 0)
    buckets = {number[item["group"]]: item["bucket"] for item in items}
    return anchor_group.astype(np.int64), [int(buckets[g]) for g in range(len(present))]


def collate_options(backend: str, args, gather_keys: bool = False) -> dict:
    """What the trainer's collate takes for a drafter (`DrafterArgs`) and attention backend: the
    padding, the block size and, with flex attention, each layer type's window (the collate lays out the
    block masks' tiles, `masks.mask_tile` in size) and whether it gathers context keys
    (`train.gather_context_keys`)."""
    flex = backend == "flex"
    return {"pad_multiple": micro_batch_multiple(backend), "block_size": args.block_size,
            "mask_windows": layer_windows(args.layer_types, args.sliding_window) if flex else None,
            "gather_keys": flex and gather_keys, "mask_tile": mask_tile(args.head_dim) if flex else TILE}


def collate_packed(items: list[dict], pad_multiple: int, block_size: int | None = None,
                   mask_windows: dict[str, int | None] | None = None,
                   gather_keys: bool = False, mask_tile: int = TILE) -> dict[str, torch.Tensor]:
    """Pack `StoreDataset` items into one micro-batch of CPU tensors (see the module docstring).

    Keys: `hidden (T, n*H)` uint16|uint8, `scale (T, n)` float32 (fp8 stores only),
    `input_ids`, `loss_mask`, `position_ids`, `doc_ids` `(T,)`, `labels (T,)` (stores of target
    labels only), `topk_ids (T, k)` int64 and `topk_probs (T, k)` float32 (soft targets, when read);
    `anchor_pos`, `anchor_doc`,
    `anchor_index`, `anchor_valid` `(A,)`; per sample `lengths`, `row_ids`, `sample_indices`
    `(D,)`; scalars `bucket` (-1 if the samples' buckets differ), `epoch`, `num_tokens` (T),
    `num_real_tokens`, `num_real_anchors`; with `block_size`, `label_rows (L,)`: the block rows
    that carry a label (`dflash.model.loss.label_rows`, so the LM head skips the others); with
    `block_size` and `mask_windows` (`dflash.model.masks.layer_windows`, flex attention), each layer
    type's `tile_layout` (`mask_tile` x `mask_tile` tiles) under `tiles_key(layer_type)` and the same
    tiles per key tile under `transposed_key(layer_type)`, so the trainer builds its block masks from the
    tiles instead of evaluating the rule over every (query, key) pair
    (with `gather_keys`, over each query tile's own copies of its context keys, `keys_key(layer_type)`:
    `tiles.gather_context_keys`);
    for the samples of a fused step (items with a `group`), `anchor_group (A,)` and the host list
    `group_buckets` (`fused_groups`); and, when some samples
    could not be read (skipped at the user's request), `skipped`: their messages. A micro-batch
    whose every sample was skipped is `{"skipped": [...], "empty": True}`.
    """
    if not items:
        raise ValueError("collate_packed: empty micro-batch")
    skipped = [item["corrupt"] for item in items if "corrupt" in item]
    items = [item for item in items if "corrupt" not in item]
    if not items:
        return {"skipped": skipped, "empty": True}
    lengths = np.array([len(item["input_ids"]) for item in items], dtype=np.int64)
    num_real_anchors = sum(len(item["anchors"]) for item in items)
    num_tokens = max(pad_multiple, round_up(int(lengths.sum()), pad_multiple))  # never an empty axis
    num_anchors = max(pad_multiple, round_up(num_real_anchors, pad_multiple))
    tokens = _pack_tokens(items, num_tokens)
    anchors = _pack_anchors(items, num_tokens, num_anchors)
    buckets = {item["bucket"] for item in items}
    arrays = {
        **tokens,
        **anchors,
        "lengths": lengths,
        "row_ids": np.array([item["row_id"] for item in items], dtype=np.int64),
        "sample_indices": np.array([item["sample_index"] for item in items], dtype=np.int64),
    }
    groups = fused_groups(items, arrays["anchor_doc"])
    if groups is not None:
        arrays["anchor_group"], group_buckets = groups
    batch = {key: torch.from_numpy(np.ascontiguousarray(value)) for key, value in arrays.items()}
    if groups is not None:
        batch["group_buckets"] = group_buckets
    if block_size is not None:
        batch["label_rows"] = label_rows(batch["loss_mask"], batch["doc_ids"], batch["anchor_index"],
                                         batch["anchor_valid"], block_size)
        for layer_type, window in (mask_windows or {}).items():
            layout = tile_layout(arrays["doc_ids"], arrays["position_ids"], arrays["anchor_doc"],
                                 arrays["anchor_pos"], block_size, window, mask_tile)
            if layout is None:
                continue
            num_keys = len(arrays["doc_ids"]) + len(arrays["anchor_doc"]) * block_size
            if gather_keys:
                layout, keys = gather_context_keys(layout, len(arrays["doc_ids"]), mask_tile)
                batch[keys_key(layer_type)] = torch.from_numpy(keys)
                num_keys = keys.shape[1]
            batch[tiles_key(layer_type)] = torch.from_numpy(layout)
            batch[transposed_key(layer_type)] = torch.from_numpy(transpose_layout(layout, num_keys // mask_tile))
    scalars = {
        "bucket": buckets.pop() if len(buckets) == 1 else -1,
        "epoch": items[0]["epoch"],
        "num_tokens": num_tokens,
        "num_real_tokens": int(lengths.sum()),
        "num_real_anchors": num_real_anchors,
    }
    batch.update({key: torch.tensor(value, dtype=torch.int64) for key, value in scalars.items()})
    if skipped:
        batch["skipped"] = skipped
    return batch


def build_loader(
    dataset: StoreDataset,
    sampler: torch.utils.data.Sampler,
    *,
    pad_multiple: int,
    block_size: int | None = None,
    mask_windows: dict[str, int | None] | None = None,
    gather_keys: bool = False,
    mask_tile: int = TILE,
    num_workers: int = 0,
    pin_memory: bool = False,
    prefetch_factor: int | None = 2,
) -> torch.utils.data.DataLoader:
    """A DataLoader yielding packed micro-batches in `sampler` order (a batch sampler yielding, per
    micro-batch, its `(epoch, sample_index)` keys); workers persist across epochs when num_workers > 0."""
    workers_used = num_workers > 0
    return torch.utils.data.DataLoader(
        dataset,
        batch_sampler=sampler,
        collate_fn=partial(collate_packed, pad_multiple=pad_multiple, block_size=block_size,
                           mask_windows=mask_windows, gather_keys=gather_keys, mask_tile=mask_tile),
        num_workers=num_workers,
        pin_memory=pin_memory,
        prefetch_factor=prefetch_factor if workers_used else None,
        persistent_workers=workers_used,
    )


def epoch_loader(dataset: StoreDataset, schedule, rank: int, start_step: int, *, pad_multiple: int,
                 block_size: int | None, num_workers: int, pin_memory: bool,
                 mask_windows: dict[str, int | None] | None = None,
                 gather_keys: bool = False, mask_tile: int = TILE, fuse: bool = False) -> torch.utils.data.DataLoader:
    """Micro-batches of `rank` from `start_step` of the schedule on; skipped steps are never read. With
    `fuse`, one per step: the rank's accum_steps micro-batches packed together, each sample keyed with
    its micro-batch (`fused_groups`)."""
    if fuse:
        steps: dict[int, list] = {}
        for step, micro_step, samples in schedule.rank_batches(rank, start_step):
            steps.setdefault(step, []).extend((schedule.epoch, int(i), micro_step) for i in samples)
        batches = list(steps.values())
    else:
        batches = [[(schedule.epoch, int(i)) for i in samples]
                   for _, _, samples in schedule.rank_batches(rank, start_step)]
    return build_loader(dataset, batches, pad_multiple=pad_multiple, block_size=block_size, mask_windows=mask_windows,
                        gather_keys=gather_keys, mask_tile=mask_tile, num_workers=num_workers,
                        pin_memory=pin_memory)
