"""Test-only helpers: plain statements of rules the library implements fast, and a batch sampler.

Imported by tests as `from support import ...` (pytest puts tests/ on sys.path).
"""

from collections.abc import Iterator

import numpy as np
import torch

from dflash.masks import PADDING_DOC
from dflash.plan import ShardPlan, rank_token_counts
from dflash.sampler import DataCursor, EpochSchedule, build_epoch_schedule


def reference_dense_mask(ctx_doc, ctx_pos, anchor_doc, anchor_pos, block_size: int, window: int | None) -> torch.Tensor:
    """The rule of ARCHITECTURE.md spelled out with Python loops: boolean `(A*B, T + A*B)`.

    Written independently of `make_mask_mod`, for tests only (slow).
    """
    ctx_doc, ctx_pos = [int(x) for x in ctx_doc], [int(x) for x in ctx_pos]
    anchor_doc, anchor_pos = [int(x) for x in anchor_doc], [int(x) for x in anchor_pos]
    num_context, num_anchors = len(ctx_doc), len(anchor_doc)
    mask = torch.zeros(num_anchors * block_size, num_context + num_anchors * block_size, dtype=torch.bool)
    for anchor in range(num_anchors):
        for slot in range(block_size):
            query = anchor * block_size + slot
            query_pos = anchor_pos[anchor] + slot
            if anchor_doc[anchor] != PADDING_DOC:
                for key in range(num_context):
                    same_doc = ctx_doc[key] == anchor_doc[anchor]
                    before_anchor = ctx_pos[key] < anchor_pos[anchor]
                    in_window = window is None or query_pos - ctx_pos[key] < window
                    mask[query, key] = same_doc and before_anchor and in_window
            for other_slot in range(block_size):
                visible = window is None or other_slot <= slot
                mask[query, num_context + anchor * block_size + other_slot] = visible
    return mask


def rank_imbalance(assignment: list[list[ShardPlan]]) -> float:
    """max / mean of the per-rank token counts (1.0 is perfect balance)."""
    counts = rank_token_counts(assignment)
    mean = sum(counts) / len(counts)
    return max(counts) / mean if mean > 0 else 1.0


class MicroBatchSampler(torch.utils.data.Sampler):
    """Batch sampler for one rank: yields lists of `(epoch, sample_index)`, one per micro-batch.

    Starts at `cursor` (resume: the epoch's schedule is rebuilt and steps before
    `cursor.step` are skipped without being read) and runs `num_epochs` epochs in all
    (counted from epoch 0), or forever when `num_epochs` is None. Every rank yields exactly
    `accum_steps` micro-batches per optimizer step, so ranks stay in lock-step.
    """

    def __init__(
        self,
        lengths: np.ndarray,
        buckets: np.ndarray,
        *,
        token_budget: int,
        world_size: int,
        rank: int,
        accum_steps: int,
        seed: int,
        cursor: DataCursor | None = None,
        num_epochs: int | None = None,
        sample_indices: np.ndarray | None = None,
    ):
        super().__init__()
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} out of range for world_size {world_size}")
        self.lengths, self.buckets = np.asarray(lengths), np.asarray(buckets)
        self.token_budget, self.world_size, self.rank = token_budget, world_size, rank
        self.accum_steps, self.seed = accum_steps, seed
        self.cursor = cursor if cursor is not None else DataCursor()
        self.num_epochs = num_epochs
        self.sample_indices = sample_indices

    def schedule(self, epoch: int) -> EpochSchedule:
        return build_epoch_schedule(
            self.lengths, self.buckets, self.token_budget, self.world_size, self.accum_steps,
            self.seed, epoch, self.sample_indices,
        )

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        epoch = self.cursor.epoch
        start_step = self.cursor.step
        while self.num_epochs is None or epoch < self.num_epochs:
            for _, _, samples in self.schedule(epoch).rank_batches(self.rank, start_step):
                yield [(epoch, sample) for sample in samples]
            epoch, start_step = epoch + 1, 0
