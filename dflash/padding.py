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
    shapes bound the recompiles); the dense backend needs no padding beyond 16."""
    return 128 if backend == "flex" else 16


GRAPH_STEPS_PER_OCTAVE = 8  # sizes a CUDA-graphed step pads an axis to: 8 per doubling, at most 1/8 padding


def graph_size(n: int, multiple: int, steps_per_octave: int = GRAPH_STEPS_PER_OCTAVE) -> int:
    """`n` rounded up to a multiple of `multiple` and then to a ladder of `steps_per_octave` sizes per
    doubling (`2^k * (1 + j / steps_per_octave)`), so that a CUDA-graphed step (train.cuda_graphs) sees
    a few shapes: at most 1/steps_per_octave of an axis is padding. Never below `multiple`."""
    if steps_per_octave < 1 or steps_per_octave & (steps_per_octave - 1):
        raise ValueError(f"graph_size: steps_per_octave must be a power of two, got {steps_per_octave}")
    size = round_up(max(n, 1), multiple)
    step = (1 << (size.bit_length() - 1)) // steps_per_octave
    return round_up(size, multiple * max(1, -(-step // multiple)))
