"""A training mix (`data.mix`): the store's sources sampled by weight, and the held-out split per source.

Stage one writes every source of the mix into one store (each shard's `source_ids`, the root
attribute `sources`). The weights are not part of the store: they say how stage two samples it, so
they can change between runs of one store. A source's weight is its share of each epoch's tokens:
with `T` the epoch's training tokens (every training sample once, as without a mix) and `T_s` those
of source `s`, source `s` gets `D_s = T * w_s / sum(w)` tokens: every one of its samples
`floor(D_s / T_s)` times, then the prefix of a permutation of its samples (rng from `(seed, epoch,
source)`) whose tokens come closest to the rest. Those sample indices, repeats included, are the
epoch's samples; `dflash.train.sampler` packs and mixes their lengths in every optimizer step as
before, so the data cursor and `--resume` work unchanged (the epoch is rebuilt from seed and epoch).

The held-out split is drawn per source (`held_out_split`), each source its own `train.holdout_fraction`,
its prompts grouped within the source: `dflash eval --prompts heldout:NAME` serves one source's.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np

from dflash.config import ConfigError, training_sources
from dflash.train.sampler import holdout_groups, split_holdout

_MIX_STREAM = 0x4D495853  # "MIXS": the fractional draw's rng, apart from every other stream


@dataclass(frozen=True)
class SourceMix:
    """The weight of each of a store's sources, in the store's order (`StoreReader.source_names`)."""

    names: tuple[str, ...]
    weights: tuple[float, ...]

    def shares(self) -> np.ndarray:
        weights = np.asarray(self.weights, dtype=np.float64)
        return weights / weights.sum()


def resolve_mix(config, reader) -> SourceMix | None:
    """data.mix's weights for the store's sources, matched by name; None when every training sample
    goes once per epoch (no data.mix, or a store of one source)."""
    if not config.data.mix:
        return None
    weights = {name: weight for name, _, weight in training_sources(config.data)}
    stored = list(reader.source_names)
    if not reader.has_sources:
        if len(weights) == 1:
            return None
        raise ConfigError(f"data.mix names {len(weights)} sources ({', '.join(weights)}), but store {reader.path} "
                          f"holds one (written from data.source): run stage one with this config into a new "
                          f"store.path")
    if set(weights) != set(stored):
        raise ConfigError(f"data.mix names the sources {sorted(weights)}, store {reader.path} holds "
                          f"{sorted(stored)}: weights may change without a new store, the sources may not")
    return SourceMix(tuple(stored), tuple(float(weights[name]) for name in stored))


def refuse_follow(config) -> None:
    """A run that follows a store still being written (train.follow) trains every sample once in the
    first epoch, as it arrives: it cannot give the sources of a mix their weights' token shares."""
    if len(config.data.mix) > 1:
        raise ConfigError(f"train.follow (--follow) with data.mix of {len(config.data.mix)} sources: a following "
                          f"run trains each sample once as stage one writes it, so the weights' token shares "
                          f"cannot be honoured; train once stage one has finished (without --follow)")


def weighted_epoch(indices: np.ndarray, sources: np.ndarray, lengths: np.ndarray, shares: np.ndarray,
                   seed: int, epoch: int) -> np.ndarray:
    """The samples of `epoch` (sorted, repeats included) that give source `s` the token share `shares[s]`
    of the tokens of `indices` (see the module docstring). `sources[i]`, `lengths[i]`: sample i's source
    number and tokens. Raises ValueError naming a source with a share but no sample."""
    indices = np.asarray(indices, dtype=np.int64)
    total = float(lengths[indices].sum())
    parts = []
    for source, share in enumerate(np.asarray(shares, dtype=np.float64).tolist()):
        members = indices[sources[indices] == source]
        if not members.size:
            raise ValueError(f"source {source} has a weight but no training sample")
        repeats, rest = divmod(share * total, float(lengths[members].sum()))
        order = np.random.default_rng([seed, _MIX_STREAM, epoch, source]).permutation(members)
        taken = np.concatenate([[0], np.cumsum(lengths[order])])
        parts += [np.repeat(members, int(repeats)), order[:int(np.argmin(np.abs(taken - rest)))]]
    return np.sort(np.concatenate(parts)).astype(np.int64)


def epoch_samples(mix: SourceMix | None, reader, train_indices: np.ndarray, seed: int, epoch: int) -> np.ndarray:
    """The training samples of `epoch` under `mix` (None: every training sample once)."""
    if mix is None:
        return train_indices
    counts = np.bincount(reader.sample_source[train_indices], minlength=len(mix.names))
    empty = [name for name, count in zip(mix.names, counts.tolist()) if not count]
    if empty:
        raise ConfigError(f"data.mix: source(s) {', '.join(empty)} have a weight but no training sample in "
                          f"store {reader.path}")
    return weighted_epoch(train_indices, reader.sample_source, reader.sample_length, mix.shares(), seed, epoch)


def describe_mix(mix: SourceMix, reader, train_indices: np.ndarray, epoch_indices: np.ndarray) -> str:
    """One line per source: its weight's share, its share of the store's training tokens, and how many
    times over the epoch draws its tokens."""
    lengths, sources = reader.sample_length, reader.sample_source
    natural, drawn = lengths[train_indices], lengths[epoch_indices]
    lines = []
    for number, (name, share) in enumerate(zip(mix.names, mix.shares().tolist())):
        own, taken = natural[sources[train_indices] == number].sum(), drawn[sources[epoch_indices] == number].sum()
        lines.append(f"  source {name}: weight {share:.1%} of each epoch's tokens (its samples are "
                     f"{own / max(natural.sum(), 1):.1%} of the store's training tokens: each drawn "
                     f"{taken / max(own, 1):.2f} times an epoch)")
    return "\n".join(lines)


def held_out_split(config, reader, groups: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """`(train_indices, eval_indices)` of the store under train.holdout_fraction, train.seed and
    train.holdout_by (`groups`: `holdout_groups`' when None), as stage two trains and `dflash eval
    --prompts heldout` serves. A store of several sources is split per source, keyed by (source,
    prompt): each source holds its fraction out. A store of one source splits as it always did."""
    if groups is None:
        groups = holdout_groups(config, reader)
    fraction, seed = config.train.holdout_fraction, config.train.seed
    if len(reader.source_names) < 2:
        return split_holdout(len(reader), fraction, seed, groups)
    train, held = [np.zeros(0, np.int64)], [np.zeros(0, np.int64)]
    for number, name in enumerate(reader.source_names):
        members = np.flatnonzero(reader.sample_source == number)
        if not members.size:
            continue
        own_groups = None if groups is None else np.unique(groups[members], return_inverse=True)[1]
        kept, out = split_holdout(members.size, fraction, seed, own_groups, stream=(zlib.crc32(name.encode()),))
        train.append(members[kept])
        held.append(members[out])
    return np.sort(np.concatenate(train)), np.sort(np.concatenate(held))


def source_number(reader, name: str) -> int:
    """The number of the store's source `name` (`--prompts heldout:NAME`); ConfigError naming the others."""
    if name not in reader.source_names:
        raise ConfigError(f"--prompts heldout:{name}: store {reader.path} has no source {name!r}; its sources: "
                          f"{', '.join(reader.source_names)}")
    return reader.source_names.index(name)
