"""Stage one: run the frozen target over the dataset and write the context-feature store.

`run(config)` wires the library together: tokenize (cached) -> plan buckets and shards ->
create or check the store -> per rank, run the target over each missing shard in
right-padded batches and commit the shard atomically (dflash/extract/capture.py, whose writer
processes in dflash/extract/writers.py compress and write while the target runs).
"""

import time
from dataclasses import dataclass, field, fields
from pathlib import Path

import numpy as np

from dflash.config import Config, training_sources
from dflash.data import samples
from dflash.data.chat import BadRowError
from dflash.data.tokenizer import choose_mask_token, load_target_tokenizer
from dflash.dist import DistState, all_reduce_sum, init_distributed, shutdown
from dflash.extract.capture import write_shards
from dflash.extract.target import compile_decoder_layers, load_target, prepare_checkpoint_in_order, target_dtype
from dflash.store import codecs, plan
from dflash.store import schema as store_format
from dflash.store import writer as store_writer


@dataclass
class ExtractResult:
    store_path: str
    num_samples: int = 0
    num_tokens: int = 0
    padded_tokens: int = 0
    stored_bytes: int = 0
    seconds: float = 0.0
    shards_written: int = 0
    shards_skipped: int = 0
    bad_rows: dict = field(default_factory=dict)
    writer_wait_seconds: float = 0.0  # the target's thread blocked on full writer queues (back-pressure)
    drain_seconds: float = 0.0  # after the last forward, waiting for the writers to finish
    handoff: dict = field(default_factory=dict)  # the writer hand-off threads' seconds (WriterPool.handoff)


def run(config: Config) -> ExtractResult:
    dist = init_distributed(config.extract.device)
    try:
        return extract(config, dist)
    finally:
        shutdown(dist)


def extract(config: Config, dist: DistState) -> ExtractResult:
    target_path = prepare_checkpoint_in_order(config.target.path, config.data.cache_dir, dist)
    tokenizer = load_target_tokenizer(target_path, config.target.chat_template)
    per_source = tokenize_in_order(config, tokenizer, dist)
    for (name, data), (_, source, _) in zip(per_source, training_sources(config.data)):
        samples.require_samples(data, source)  # before the store exists: never an empty one
    tokenized, source_ids = join_sources(per_source)
    lengths = np.array([len(s.input_ids) for s in tokenized.samples], dtype=np.int64)
    row_ids = np.array([s.row_id for s in tokenized.samples], dtype=np.int64)
    shards = plan.plan_shards(lengths, row_ids, list(config.store.bucket_edges), config.store.shard_tokens)
    attrs = root_attrs(config, target_path, tokenizer, shards, tokenized.samples)
    group = open_store_in_order(config, attrs, dist)
    done = store_format.completed_shards(group)
    mine = plan.write_order([s for s in plan.assign_ranks(shards, dist.world_size)[dist.rank] if s.name not in done])
    result = ExtractResult(store_path=config.store.path, bad_rows=dict(tokenized.bad_rows),
                           shards_skipped=sum(s.name in done for s in shards))
    if dist.is_main:
        report_data(per_source, len(shards), len(done), config.data.max_length)
    needs_weights = dist.is_main and not store_format.frozen_weights_complete(group)
    if not mine and not needs_weights:
        if dist.is_main and len(done) == len(shards):
            print(f"store {config.store.path} is complete ({len(shards)} shards); nothing to do")
        dist.barrier()
        return result
    target = load_target(str(target_path), dist.device, dtype=target_dtype(config.target.dtype, dist.device),
                         layer_ids=attrs["target_layer_ids"], predict_labels=config.store.labels == "target", topk=config.store.topk)
    if needs_weights:
        store_writer.write_frozen_weights(group, target.embedding_weight(), target.lm_head_weight())
    if config.target.compile and dist.device.type == "cuda":
        compile_decoder_layers(target)
    start = time.perf_counter()
    written = write_shards(config, dist, target, tokenized.samples, lengths, row_ids, mine,
                           source_ids=source_ids if config.data.mix else None)
    result.seconds = time.perf_counter() - start
    for name in (f.name for f in fields(written)):  # ExtractResult holds every WriteStats field
        setattr(result, name, getattr(written, name))
    dist.barrier()
    summarize(dist, attrs, result)
    return result


def tokenize_source(config: Config, tokenizer, source: str) -> samples.TokenizedData:
    """One training source tokenized and cached; with data.strict a bad row stops it, named with its file."""
    try:
        return samples.tokenize_rows(
            source, tokenizer, split=config.data.split,
            max_length=config.data.max_length, overlong=config.data.overlong,
            min_supervised=config.drafter.block_size, strict=config.data.strict,
            num_workers=config.data.num_workers, cache_dir=config.data.cache_dir)
    except BadRowError as bad:  # data.strict: name the file that holds the row
        raise bad.located(source, "fix the row, or set data.strict=false to skip and count bad rows") from None


def tokenize_in_order(config: Config, tokenizer, dist: DistState) -> list[tuple[str, samples.TokenizedData]]:
    """`(name, tokenized)` of every training source (data.mix's, or data.source), each read and
    cached on its own (`samples.tokenize_rows`: row ids stay the source's own). Rank 0 tokenizes
    (and fills the cache) first; the other ranks then read the cache."""
    def tokenize():
        return [(name, tokenize_source(config, tokenizer, source))
                for name, source, _ in training_sources(config.data)]

    result = tokenize() if dist.is_main else None
    dist.barrier()
    return result if dist.is_main else tokenize()


def join_sources(per_source: list[tuple[str, samples.TokenizedData]]) -> tuple[samples.TokenizedData, np.ndarray]:
    """Every source's samples in one list (source by source), and each one's source number (int32);
    the bad rows are counted over all sources (the report names them per source)."""
    joined = samples.TokenizedData(samples=[])
    source_ids = []
    for number, (_, tokenized) in enumerate(per_source):
        joined.samples += tokenized.samples
        joined.num_rows += tokenized.num_rows
        for reason, count in tokenized.bad_rows.items():
            joined.bad_rows[reason] = joined.bad_rows.get(reason, 0) + count
        source_ids.append(np.full(len(tokenized.samples), number, dtype=np.int32))
    return joined, np.concatenate(source_ids)


def open_store_in_order(config: Config, attrs: dict, dist: DistState):
    """Rank 0 creates or checks the store; the others open it after the barrier."""
    group = store_writer.create_or_open_store(config.store.path, attrs, config.store.overwrite) if dist.is_main else None
    dist.barrier()
    return group if dist.is_main else store_writer.create_or_open_store(config.store.path, attrs, overwrite=False)


def root_attrs(config: Config, target_path: Path, tokenizer, shards, samples) -> dict:
    """The store's root attributes: what stage one knows of the target and tokenizer, laid out by
    the store's format (dflash/store/schema.py)."""
    from transformers import AutoConfig

    from dflash.data.tokenizer import tokenizer_identity
    from dflash.extract.gguf import is_gguf
    from dflash.extract.target import (default_layer_ids, describe_target_config, text_config_summary,
                                       weights_fingerprint)

    target_config = AutoConfig.from_pretrained(str(target_path))
    target_info = describe_target_config(target_config, str(target_path))
    target_info["weights"] = weights_fingerprint(target_path)
    if is_gguf(config.target.path):
        target_info["path"] = config.target.path
    layer_ids = list(config.target.layer_ids) or default_layer_ids(
        target_info["num_hidden_layers"], config.target.num_layer_ids)
    return store_format.root_attributes(
        config, target_info, layer_ids, text_config_summary(target_config), tokenizer_identity(tokenizer),
        mask_token_id=choose_mask_token(tokenizer, (sample.input_ids for sample in samples)),
        num_truncated=sum(sample.truncated for sample in samples), shards=shards)


def report_data(per_source: list[tuple[str, samples.TokenizedData]], num_shards: int, num_done: int,
                max_length: int) -> None:
    for name, tokenized in per_source:
        kept = len(tokenized.samples)
        where = f"data (source {name})" if len(per_source) > 1 else "data"
        print(f"{where}: {tokenized.num_rows} rows, {kept} kept ({tokenized.num_tokens:,} tokens), "
              f"{tokenized.num_rows - kept} skipped, {tokenized.num_truncated} cut at data.max_length "
              f"({max_length} tokens)")
        for reason, count in sorted(tokenized.bad_rows.items()):
            examples = ", ".join(str(r + 1) for r in tokenized.examples.get(reason, [])[:5])
            print(f"  skipped {count} row(s): {reason} (e.g. rows {examples})")
    print(f"plan: {num_shards} shards, {num_done} already complete")


def summarize(dist: DistState, attrs: dict, result: ExtractResult) -> None:
    totals = all_reduce_sum(dist, [result.num_samples, result.num_tokens, result.stored_bytes,
                                   result.shards_written, result.seconds, result.writer_wait_seconds,
                                   result.drain_seconds, result.padded_tokens])
    if not dist.is_main:
        return
    samples, tokens, stored, written = (int(v) for v in totals[:4])
    seconds = totals[4] / dist.world_size
    raw_bytes = tokens * codecs.bytes_per_token_raw(len(attrs["target_layer_ids"]), attrs["hidden_size"])
    ratio = raw_bytes / stored if stored else 0.0
    print(f"stage one done: {written} shards, {samples} samples, {tokens:,} tokens, "
          f"{stored / 1e6:,.1f} MB stored ({stored / max(tokens, 1):,.0f} B/token, "
          f"{ratio:.2f}x smaller than bf16), {seconds:.1f} s, "
          f"{tokens / max(seconds, 1e-9):,.0f} tokens/s over {dist.world_size} rank(s)"
          + (f"; {tokens / totals[7]:.1%} of the rows the target ran were real (batch padding)" if totals[7] else ""))
    waited, drained = totals[5] / dist.world_size, totals[6] / dist.world_size
    print(f"  writers (mean per rank): the target waited {waited:.1f} s on full writer queues, then "
          f"{drained:.1f} s for the last shards after its last batch")
    if seconds > 0 and waited > 0.05 * seconds:
        print(f"  the writers held the target back for {waited / seconds:.0%} of the run: raise "
              f"extract.writer_processes if the host has idle cores")
