"""Test-only helpers shared by several test files: plain statements of rules the library
implements fast, a batch sampler, a tiny trained drafter with packed batches (train-vs-inference
and eval tests), and a small store's root attributes (store and writer tests).

Imported by tests as `from support import ...` (pytest puts tests/ on sys.path); test files
never import each other.
"""

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from dflash.model.drafter import DFlashDrafter, block_embeddings, block_positions, drafter_args
from dflash.model import modeling_dflash
from dflash.model.loss import block_labels, dflash_loss, gamma_weights
from dflash.model.masks import build_masks
from dflash.model.tiles import PADDING_DOC, TILE
from dflash.store.plan import ShardPlan
from dflash.train.sampler import DataCursor, EpochSchedule, build_epoch_schedule


def reference_dense_mask(ctx_doc, ctx_pos, anchor_doc, anchor_pos, block_size: int, window: int | None) -> torch.Tensor:
    """The rule of docs/ARCHITECTURE.md spelled out with Python loops: boolean `(A*B, T + A*B)`.

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


def rank_token_counts(assignment: list[list[ShardPlan]]) -> list[int]:
    """Tokens each rank writes under an assignment."""
    return [sum(s.num_tokens for s in shards) for shards in assignment]


def bucket_counts(schedule: EpochSchedule) -> dict[int, int]:
    """Micro-batches of each bucket in an epoch's schedule."""
    buckets, counts = np.unique(schedule.micro_batch_buckets, return_counts=True)
    return {int(b): int(c) for b, c in zip(buckets, counts)}


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


# A tiny drafter and packed batches: tests/test_inference_equivalence.py, tests/test_eval.py.
VOCAB = 512
WINDOW = 20  # smaller than the sequences, so sliding layers really cut the context


def tiny_setup(seed: int):
    """A tiny drafter trained for a few steps (so no weight sits at its init value)."""
    torch.manual_seed(seed)
    args = drafter_args("tiny", vocab_size=VOCAB, mask_token_id=VOCAB - 1, sliding_window=WINDOW)
    model = DFlashDrafter(args)
    embed = torch.randn(VOCAB, args.hidden_size)
    lm_head = torch.randn(VOCAB, args.hidden_size)
    train_a_few_steps(args, model, embed, lm_head, random_packed_batch(seed + 100, args.context_feature_size,
                                                                       args.block_size))
    return args, model.eval(), embed, lm_head


def train_a_few_steps(args, model, embed, lm_head, batch, steps: int = 5) -> None:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loss_mask = torch.ones_like(batch["input_ids"])
    labels, valid = block_labels(batch["input_ids"], loss_mask, batch["doc_ids"], batch["anchor_index"],
                                 batch["anchor_doc"] >= 0, args.block_size)
    masks = build_masks(batch, args.layer_types, args.sliding_window, block_size=args.block_size, backend="dense")
    block = block_embeddings(embed, batch["input_ids"], batch["anchor_index"], args.block_size, args.mask_token_id)
    positions = block_positions(batch["anchor_pos"], args.block_size)
    for _ in range(steps):
        hidden = model(batch["hidden"], block, batch["position_ids"], positions, masks)
        dflash_loss(hidden, lm_head, labels, valid, gamma_weights(args.block_size, 7.0)).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    assert not torch.equal(model.norm.weight, torch.ones_like(model.norm.weight))


def random_packed_batch(seed: int, feature_size: int, block_size: int) -> dict:
    """2-3 sequences packed in one row with sorted anchors, plus padded context and a padded anchor."""
    rng = np.random.default_rng(seed)
    doc_ids, position_ids, anchor_doc, anchor_pos, anchor_index = [], [], [], [], []
    for doc in range(int(rng.integers(2, 4))):
        length = int(rng.integers(25, 60))
        chosen = np.sort(rng.choice(length, size=5, replace=False))
        chosen[0] = 0  # an anchor with no context at all
        anchor_index += (len(doc_ids) + chosen).tolist()
        anchor_doc += [doc] * len(chosen)
        anchor_pos += chosen.tolist()
        doc_ids += [doc] * length
        position_ids += list(range(length))
    anchor_index.append(0)  # padded anchor: points anywhere, doc -1
    anchor_doc.append(-1)
    anchor_pos.append(0)
    doc_ids += [-1] * 7
    position_ids += [0] * 7
    num_tokens = len(doc_ids)
    return {
        "doc_ids": torch.tensor(doc_ids), "position_ids": torch.tensor(position_ids),
        "anchor_doc": torch.tensor(anchor_doc), "anchor_pos": torch.tensor(anchor_pos),
        "anchor_index": torch.tensor(anchor_index),
        "input_ids": torch.from_numpy(rng.integers(0, VOCAB - 1, num_tokens)),
        "hidden": torch.from_numpy(rng.standard_normal((num_tokens, feature_size)).astype(np.float32)),
    }


def packed_training_logits(args, model, embed, lm_head, batch, masks=None, position_shift=0):
    block = block_embeddings(embed, batch["input_ids"], batch["anchor_index"], args.block_size, args.mask_token_id)
    positions = block_positions(batch["anchor_pos"], args.block_size) + position_shift
    if masks is None:
        masks = build_masks(batch, args.layer_types, args.sliding_window, block_size=args.block_size, backend="dense")
    with torch.no_grad():
        hidden = model(batch["hidden"], block, batch["position_ids"], positions, masks)
    return (hidden @ lm_head.T).view(-1, args.block_size, VOCAB)


# A small store: tests/test_store.py, tests/test_writers.py.
N_LAYERS, HIDDEN = 3, 16
EDGES = [0, 8, 32, 64]


def root_attrs(codec="bf16", plans=(), **changes):
    attrs = {
        "schema_version": 1, "package_version": "0.1.0",
        "target": {"path": "fake", "config_hash": "abc", "model_type": "qwen3_5_text",
                   "num_hidden_layers": 8, "hidden_size": HIDDEN, "vocab_size": 50},
        "target_layer_ids": [1, 3, 5], "hidden_size": HIDDEN, "codec": codec,
        "tokenizer": {"name_or_path": "fake", "vocab_size": 50, "hash": "t0"},
        "max_length": 63, "bucket_edges": EDGES, "config": {"seed": 0}, "config_hash": "c0",
        "shards": [{"name": p.name, "bucket": p.bucket, "num_samples": len(p.sample_indices),
                    "num_tokens": p.num_tokens} for p in plans],
    }
    attrs.update(changes)
    return attrs


def tiled_packed_meta(rng: np.random.Generator, block_size: int, tile: int = TILE,
                      length_range: tuple[int, int] = (1, 300), max_anchors: int = 40) -> dict:
    """A packed micro-batch as the collate lays it out for flex attention: sequences of random
    lengths in `[length_range)` (some longer than a tile), up to `max_anchors` sorted random anchors each, T and
    A * B padded to the tile."""
    lengths = rng.integers(*length_range, size=int(rng.integers(1, 6)))
    doc_ids = np.repeat(np.arange(len(lengths)), lengths)
    position_ids = np.concatenate([np.arange(n) for n in lengths])
    anchor_doc, anchor_pos = [], []
    for doc, length in enumerate(lengths):
        count = int(rng.integers(0, min(length, max_anchors) + 1))
        chosen = np.sort(rng.choice(length, size=count, replace=False))
        anchor_doc += [doc] * count
        anchor_pos += chosen.tolist()
    num_tokens = -(-len(doc_ids) // tile) * tile
    anchors_per_tile = tile // np.gcd(tile, block_size)
    num_anchors = max(anchors_per_tile, -(-len(anchor_doc) // anchors_per_tile) * anchors_per_tile)
    pad = num_tokens - len(doc_ids)
    return {"doc_ids": torch.tensor(np.r_[doc_ids, [-1] * pad]),
            "position_ids": torch.tensor(np.r_[position_ids, [0] * pad]),
            "anchor_doc": torch.tensor(anchor_doc + [-1] * (num_anchors - len(anchor_doc)), dtype=torch.long),
            "anchor_pos": torch.tensor(anchor_pos + [0] * (num_anchors - len(anchor_pos)), dtype=torch.long)}


def run_interpreted(code: str) -> None:
    """`code` in a fresh Python whose Triton runs kernels through its interpreter on the CPU (TRITON_INTERPRET=1
    from the process's start: Triton reads it when it is imported), tests/ and the project on its path."""
    tests = Path(__file__).parent
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join([str(tests), str(tests.parent), os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]


def sampled_tree_on_cuda(seed: int, size: int, width: int, vocab: int, slots: int = 16):
    """`(tree, q_KV, target_logits)`: a `drawn_tree` of `size` nodes (at most `width` children a node) over a random
    drafter's `slots` slots on CUDA, with target logits near the drafter's."""
    torch.manual_seed(seed)
    drafter_logits = torch.randn(slots, vocab, device="cuda") * 3
    tree, q_KV = modeling_dflash.drawn_tree(3, drafter_logits, size, 1.0, torch.Generator("cuda").manual_seed(seed),
                                            width=width)
    depths = torch.tensor(tree.depths, device="cuda").clamp(max=slots - 1)
    return tree, q_KV, drafter_logits[depths] + torch.randn(len(tree.tokens), vocab, device="cuda")


class PlainDescent(torch.optim.Optimizer):
    """Plain gradient descent (lr 1 unless given) that accepts `found_inf` as train_step sets it (SGD does
    not) and never reads `grad_scale`, as any optimizer but the fused ones: train_step clips its gradients
    in place (dflash.train.step.clip_into_step), so at lr 1 each update is the clipped gradient itself."""

    def __init__(self, params, lr: float = 1.0):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    param.sub_(group["lr"] * param.grad)
