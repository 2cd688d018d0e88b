"""Rounding up to a multiple, and the two padding rules built on it: the length of stage one's
target batches and the token and anchor axes of stage two's packed micro-batches.
"""


def round_up(n: int, multiple: int) -> int:
    """The smallest multiple of `multiple` that is >= n."""
    if multiple < 1:
        raise ValueError(f"round_up: the multiple must be >= 1, got {multiple}")
    return -(-n // multiple) * multiple


def target_batch_multiple(device) -> int:
    """Stage one's batch lengths round up to 16 on CUDA: Triton specialises integer arguments on
    divisibility by 16, so one compiled variant serves every length (fla's autotune keys hold no
    length); the CPU needs none."""
    return 16 if device.type == "cuda" else 1


def micro_batch_multiple(backend: str) -> int:
    """Stage two's token and anchor axes: flex attention compiles per shape, so pad to 128 (a few
    shapes bound the recompiles; the same for the blockwise kernels' compiled layers); the dense backend
    needs no padding beyond 16."""
    return 128 if backend in ("flex", "blockwise") else 16
