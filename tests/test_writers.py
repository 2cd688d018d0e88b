"""Stage one's writer processes (dflash/extract/writers.py): what they write equals the input, errors surface."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from support import EDGES, HIDDEN, N_LAYERS, root_attrs

from dflash.extract.capture import CapturedBatch
from dflash.extract.writers import WriterError, WriterPool
from dflash.store.plan import plan_shards
from dflash.store.reader import StoreReader
from dflash.store.schema import bf16_to_bits
from dflash.store.writer import create_or_open_store

OPTIONS = {"codec": "bf16", "num_layers": N_LAYERS, "hidden_size": HIDDEN, "rows_per_chunk": 8,
           "rows_per_zarr_shard": 32}


def padded_batch(rng, lengths):
    """A right-padded (B, T, n*H) bf16-bits batch as capture_batch returns it, and its samples."""
    longest = max(lengths)
    values = torch.from_numpy(rng.normal(size=(len(lengths), longest, N_LAYERS * HIDDEN)).astype(np.float32))
    bits = torch.from_numpy(bf16_to_bits(values).astype(np.int16)).view(torch.uint16)
    samples = [SimpleNamespace(input_ids=rng.integers(0, 50, n).astype(np.int32),
                               loss_mask=rng.integers(0, 2, n).astype(np.uint8)) for n in lengths]
    return CapturedBatch(parts={"hidden": bits}, ready=None), samples


ROW_BYTES = N_LAYERS * HIDDEN * 2  # bf16 bits per token


def write_store(path, rng, lengths, row_ids, processes, poison=None, batch_bytes=0, shard_tokens=120,
                options=OPTIONS):
    plans = plan_shards(lengths, row_ids, EDGES, shard_tokens=shard_tokens)
    create_or_open_store(str(path), root_attrs("bf16", plans), overwrite=False)
    expected = {}
    pool = WriterPool(processes, str(path), lengths, row_ids, options, batch_bytes=batch_bytes)
    try:
        for key, plan in enumerate(plans):
            pool.open_shard(key, plan)
            indices = list(plan.sample_indices)
            for start in range(0, len(indices), 3):
                chunk = indices[start:start + 3]
                captured, samples = padded_batch(rng, [int(lengths[i]) for i in chunk])
                if poison is not None and poison in chunk:
                    row = chunk.index(poison)
                    captured.parts["hidden"].view(torch.bfloat16)[row, 0, 0] = float("nan")
                for row, (i, sample) in enumerate(zip(chunk, samples)):
                    expected[int(row_ids[i])] = (captured.parts["hidden"][row, : lengths[i]].numpy().copy(),
                                                 sample.input_ids, sample.loss_mask)
                pool.write(key, plan.name, chunk, samples, captured)
            pool.commit(key, plan.name)
        committed = pool.close()
    except BaseException:
        pool.terminate()
        raise
    return plans, committed, expected


@pytest.mark.parametrize("slot_rows", [0, 64, 4096], ids=["no-slots", "some-batches-too-big", "slots"])
def test_writer_processes_write_what_they_are_given(tmp_path, monkeypatch, slot_rows):
    """Batches travel in reused shared-memory slots, or in fresh shared tensors when larger than a
    slot (batches here hold 3 to 189 rows); either way every row lands as given."""
    import dflash.extract.writers as writers

    fresh = []
    monkeypatch.setattr(writers, "to_shared_memory",
                        lambda captured, original=writers.to_shared_memory: fresh.append(1) or original(captured))
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 64, size=30)
    row_ids = np.arange(30) * 3 + 7
    plans, committed, expected = write_store(tmp_path / "store", rng, lengths, row_ids, processes=2,
                                             batch_bytes=slot_rows * ROW_BYTES)
    num_batches = sum(-(-len(plan.sample_indices) // 3) for plan in plans)
    assert len(fresh) == {0: num_batches, 4096: 0}.get(slot_rows, len(fresh))
    if slot_rows == 64:
        assert 0 < len(fresh) < num_batches
    assert len(committed) == len(plans) >= 3
    reader = StoreReader(str(tmp_path / "store"))
    assert len(reader) == 30
    for index in range(len(reader)):
        sample = reader.read_sample(index)
        hidden, ids, mask = expected[int(sample["row_id"])]
        np.testing.assert_array_equal(sample["hidden"], hidden)
        np.testing.assert_array_equal(sample["input_ids"], ids)
        np.testing.assert_array_equal(sample["loss_mask"], mask)


def test_slots_are_reused_only_after_their_rows_are_copied(tmp_path):
    """A shard writer holds rows until a whole zarr shard file is full: with files far larger than
    a shard, nothing is written before the commit, while every slot is reused many times over."""
    rng = np.random.default_rng(2)
    lengths = rng.integers(1, 64, size=60)
    row_ids = np.arange(60)
    options = dict(OPTIONS, rows_per_zarr_shard=4096)
    plans, committed, expected = write_store(tmp_path / "store", rng, lengths, row_ids, processes=1,
                                             batch_bytes=256 * ROW_BYTES, shard_tokens=10_000, options=options)
    assert len(plans) < 10 < sum(-(-len(plan.sample_indices) // 3) for plan in plans)
    reader = StoreReader(str(tmp_path / "store"))
    for index in range(len(reader)):
        sample = reader.read_sample(index)
        np.testing.assert_array_equal(sample["hidden"], expected[int(sample["row_id"])][0])


def test_writer_process_error_names_the_row(tmp_path):
    rng = np.random.default_rng(1)
    lengths = rng.integers(1, 64, size=12)
    row_ids = np.arange(12) + 100
    with pytest.raises(WriterError, match=r"row 106: 1 non-finite"):
        write_store(tmp_path / "store", rng, lengths, row_ids, processes=2, poison=5, batch_bytes=4096 * ROW_BYTES)


def test_shared_memory_shortfall_is_announced(tmp_path):
    from dflash.extract.writers import check_shared_memory

    assert check_shared_memory(4, 1 << 20, where=str(tmp_path))  # 16 MiB fits any test disk
    with pytest.warns(UserWarning, match=r"extract.writer_processes or extract.batch_tokens"):
        assert not check_shared_memory(4, 1 << 60, where=str(tmp_path))


def test_a_killed_writer_process_is_an_error_not_a_hang(tmp_path):
    """A writer killed from outside (say, by the out-of-memory killer) holds no queue or slot
    hostage: the next submits raise WriterError naming the process."""
    import os
    import signal
    import threading
    import time

    rng = np.random.default_rng(3)
    lengths = rng.integers(8, 64, size=40)
    row_ids = np.arange(40)
    plans = plan_shards(lengths, row_ids, EDGES, shard_tokens=10_000)
    create_or_open_store(str(tmp_path / "store"), root_attrs("bf16", plans), overwrite=False)
    pool = WriterPool(1, str(tmp_path / "store"), lengths, row_ids, OPTIONS, batch_bytes=256 * ROW_BYTES)
    outcome = []

    def run():
        try:
            plan = plans[0]
            pool.open_shard(0, plan)
            os.kill(pool.processes[0].pid, signal.SIGKILL)
            pool.processes[0].join()
            indices = list(plan.sample_indices)
            for start in range(0, len(indices), 2):  # more batches than the queues and slots hold
                chunk = indices[start:start + 2]
                captured, samples = padded_batch(rng, [int(lengths[i]) for i in chunk])
                pool.write(0, plan.name, chunk, samples, captured)
            pool.commit(0, plan.name)
            pool.close()
            outcome.append("no error")
        except WriterError as error:
            outcome.append(str(error))
        finally:
            pool.terminate()

    thread = threading.Thread(target=run, daemon=True)
    start = time.perf_counter()
    thread.start()
    thread.join(timeout=120)
    assert not thread.is_alive(), "stage one hung on a dead writer process"
    assert len(outcome) == 1 and "dflash-writer-0 died (exit code -9" in outcome[0], outcome
    assert time.perf_counter() - start < 60
