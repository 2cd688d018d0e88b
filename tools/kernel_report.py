"""dflash's own Triton kernels compiled for a GPU on any machine, no GPU needed: each kernel's compile seconds and
what the compiler made of it (registers a thread, spilled bytes, shared memory, machine instructions) and, for
each loop of its machine code, the instructions, spill loads and stores and tensor-core instructions of one trip.

The kernels are those stage two compiles at its start (dflash/train/warm_kernels.py), compiled through the same
code: `block_attention.warm_kernels` per head shape, `ce_kernel.warm` per vocabulary, `TritonAdamW.warm`, each
Triton's `warmup` of the arguments its launch passes, so each kernel specializes as in training (alignment,
integers divisible by 16, constants, warps, stages). A stand-in for Triton's CUDA driver names the target
(`--arch`, default 90: H100 and H200) and launches nothing; the binaries are read with the cuobjdump and nvdisasm
Triton ships. Each run compiles into an empty Triton cache, one kernel at a time, so the seconds are a cold
start's compile on this machine's CPU (stage two's warm-up runs them in threads beside torch.compile).

A loop's trip is what one pass of a kernel's inner loop issues (the dK/dV kernel: one row tile of one query head
into a key tile): with the binaries of a changed kernel beside the committed one's, a change can be read before
a GPU times it (fewer instructions a trip, no spills in the loop), never instead of the timing.

    python tools/kernel_report.py --out kernels.json
    python tools/kernel_report.py --heads 32:8:128 --only dkdv --configs dkdv=64,64,8,2
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchlib import print_table, run_metadata, write_results  # noqa: E402

HEAD_SHAPES = "9:3:64,32:8:128"  # query heads : key heads : head dims (the SmolLM2-sized drafter, the peers' 27B)
VOCABS = "49152,248320"  # SmolLM2's and Qwen3.6's vocabularies: the loss pass's rows
_ADDRESS = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s*(.*?)\s*;")
_LABEL = re.compile(r"^\s*(\.L_x_\d+):")
_BRANCH = re.compile(r"\bBRA\b.*?(\.L_x_\d+)")
_PREDICATE = re.compile(r"^@!?U?P\w+\s+")
MMA_OPS = ("HGMMA", "HMMA")  # tensor-core instructions: sm_90's warpgroup ones, and those before it


def opcode(instruction: str) -> str:
    """`@P0 LDG.E.U16 R2, desc[...]` -> `LDG`."""
    return _PREDICATE.sub("", instruction).split(" ")[0].split(".")[0]


def parse_sass(text: str) -> tuple[list[tuple[int, str]], dict[str, int]]:
    """nvdisasm's listing as (address, instruction) in order, and each label's address."""
    instructions, labels, pending = [], {}, []
    for line in text.splitlines():
        if label := _LABEL.match(line):
            pending.append(label.group(1))
            continue
        if found := _ADDRESS.match(line):
            address = int(found.group(1), 16)
            instructions.append((address, found.group(2)))
            for name in pending:
                labels[name] = address
            pending = []
    return instructions, labels


def loops(text: str) -> list[dict]:
    """Each loop of an nvdisasm listing (a branch back to an earlier label): its span, the instructions of one
    trip, the spill loads and stores (LDL, STL) and tensor-core instructions (HGMMA, HMMA) among them, and
    whether it holds another loop (`inner`: False) or not."""
    instructions, labels = parse_sass(text)
    spans = []
    for address, instruction in instructions:
        branch = _BRANCH.search(instruction)
        if branch and labels.get(branch.group(1), address + 1) <= address:
            spans.append((labels[branch.group(1)], address))
    found = []
    spans = [(start, end) for start, end in spans if end > start]  # not the trap's branch to itself
    for start, end in spans:
        body = [opcode(text) for address, text in instructions if start <= address <= end]
        holds_another = any(start <= first and last <= end and (first, last) != (start, end) for first, last in spans)
        found.append({"start": hex(start), "end": hex(end), "instructions": len(body),
                      "spill_ops": sum(op in ("LDL", "STL") for op in body),
                      "mma_ops": sum(op in MMA_OPS for op in body),
                      "inner": not holds_another})
    return found


def sass_tool(name: str) -> str:
    """Triton's own copy of an NVIDIA binary tool (`triton/backends/nvidia/bin`), else the one on PATH."""
    import triton

    shipped = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
    found = str(shipped) if shipped.exists() else shutil.which(name)
    if not found:
        raise SystemExit(f"kernel_report: no {name} (neither Triton's backends/nvidia/bin nor PATH has it)")
    return found


def describe(kernel, seconds: float) -> dict:
    """What the compiler made of one compiled kernel (Triton's CompiledKernel)."""
    with tempfile.TemporaryDirectory(prefix="dflash-sass-") as folder:
        cubin = Path(folder) / "kernel.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        usage = subprocess.run([sass_tool("cuobjdump"), "-res-usage", str(cubin)], capture_output=True, text=True,
                               check=True).stdout
        listing = subprocess.run([sass_tool("nvdisasm"), "-c", str(cubin)], capture_output=True, text=True,
                                 check=True).stdout

    def resource(name: str) -> int:
        found = re.search(rf"\b{name}:(\d+)", usage)
        return int(found.group(1)) if found else 0

    instructions, _ = parse_sass(listing)
    ops = collections.Counter(opcode(text) for _, text in instructions)
    metadata = kernel.metadata
    names = kernel.src.fn.arg_names
    constants = {names[path[0]]: value for path, value in kernel.src.constants.items()
                 if len(path) == 1 and names[path[0]].isupper()}  # the kernel's own constexprs (GROUP, D, BM...)
    return {"kernel": kernel.name, "compile_s": round(seconds, 3), "num_warps": metadata.num_warps,
            "num_stages": metadata.num_stages, "registers": resource("REG"), "spill_stack_bytes": resource("STACK"),
            "local_bytes": resource("LOCAL"), "shared_bytes": metadata.shared, "instructions": len(instructions),
            "spill_ops": ops["LDL"] + ops["STL"], "mma_ops": sum(ops[op] for op in MMA_OPS),
            "constants": constants, "loops": loops(listing)}


class CompileOnlyDriver:
    """Triton's driver as `warmup` asks it: a target to compile for, a device and stream to key its caches by.
    Nothing is launched, so nothing else is asked."""

    def __init__(self, arch: int):
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", arch, 32)

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0


class CompileClock:
    """Each compile's seconds, from Triton's hooks around it (the cache hook runs just before a compile, the
    post-compile hook just after), in the order they ran."""

    def __init__(self):
        self.seconds: list[float] = []
        self._started = None

    def __enter__(self):
        from triton import knobs

        self._saved = knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook
        knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = self._before, self._after
        return self

    def _before(self, *args, **kwargs):
        self._started = time.perf_counter()
        return False  # compile it

    def _after(self, *args, **kwargs):
        self.seconds.append(time.perf_counter() - self._started)

    def __exit__(self, *exc):
        from triton import knobs

        knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = self._saved


def compile_jobs(head_shapes: list[tuple[int, int, int]], vocabs: list[int], dtype: torch.dtype) -> list:
    """(label, job) for every kernel stage two warms, each job returning its compiled kernels."""
    from dflash.model import block_attention, ce_kernel
    from dflash.train.adamw_kernel import TritonAdamW

    cpu = torch.device("cpu")
    jobs = [(f"attention {heads}:{key_heads}:{dim}",
             lambda heads=heads, key_heads=key_heads, dim=dim: block_attention.warm_kernels(heads, key_heads, dim,
                                                                                            dtype, cpu))
            for heads, key_heads, dim in head_shapes]
    jobs += [(f"cross entropy, {vocab:,} logits a row", lambda vocab=vocab: [ce_kernel.warm(vocab, dtype, cpu)])
             for vocab in vocabs]
    parameter = torch.nn.Parameter(torch.zeros(4096))
    jobs.append(("AdamW", lambda: TritonAdamW([parameter], lr=1e-4).warm()))
    return jobs


def parse_head_shapes(text: str) -> list[tuple[int, int, int]]:
    shapes = []
    for item in filter(None, text.split(",")):
        try:
            heads, key_heads, dim = (int(x) for x in item.split(":"))
        except ValueError:
            raise SystemExit(f"kernel_report: --heads takes HEADS:KEY_HEADS:DIM,..., got {item!r}") from None
        shapes.append((heads, key_heads, dim))
    return shapes


def parse_configs(text: str) -> dict:
    """`dkdv=64,64,8,2;forward=...` -> block_attention.KernelConfig per kernel (rows, keys, warps, stages)."""
    from dflash.model.block_attention import KernelConfig

    configs = {}
    for item in filter(None, text.split(";")):
        name, _, values = item.partition("=")
        if name not in ("forward", "dq", "dkdv"):
            raise SystemExit(f"kernel_report: --configs names forward, dq or dkdv, got {name!r}")
        try:
            rows, keys, warps, stages = (int(x) for x in values.split(","))
        except ValueError:
            raise SystemExit(f"kernel_report: --configs {name}=ROWS,KEYS,WARPS,STAGES, got {values!r}") from None
        configs[name] = KernelConfig(rows, keys, warps, stages)
    return configs


def constants(row: dict) -> str:
    """A kernel's constants that tell its compiles apart (not the interpreter's switch or the dots' precision)."""
    return " ".join(f"{name}={value}" for name, value in row["constants"].items() if name not in ("WHILE", "P"))


def inner_loops(row: dict) -> str:
    """The inner loops as `instructions/spill ops/MMA ops` a trip, the longest first."""
    inner = sorted((loop for loop in row["loops"] if loop["inner"]), key=lambda loop: -loop["instructions"])
    return ", ".join(f"{loop['instructions']}/{loop['spill_ops']}/{loop['mma_ops']}" for loop in inner) or "-"


def forget_compiles() -> None:
    """Empty the in-process caches of dflash's Triton kernels: each keeps its compiles and its target by device
    index, and a launch on a real GPU after this tool must compile for that GPU, not find the stand-in's."""
    from triton.runtime.jit import JITFunction

    from dflash.model import block_attention_kernels, ce_kernel
    from dflash.train import adamw_kernel

    for module in (block_attention_kernels, ce_kernel, adamw_kernel):
        for value in vars(module).values():
            if isinstance(value, JITFunction):
                value.device_caches.clear()


def compile_job(label: str, job, described: set) -> list[dict]:
    """Run one job's compiles and describe each kernel it compiled (`described`: the kernels seen so far; a kernel an
    earlier job compiled for the same specialization comes back from Triton's cache, not compiled again)."""
    with CompileClock() as clock:
        kernels = [kernel for kernel in job() if kernel is not None]
    compiled = [kernel for kernel in kernels if id(kernel) not in described]
    if len(compiled) != len(clock.seconds):
        raise SystemExit(f"kernel_report: {label}: {len(clock.seconds)} compiles for {len(compiled)} kernels")
    for kernel in kernels:
        if id(kernel) in described:
            print(f"{label}: {kernel.name} as compiled above (the same specialization)", flush=True)
    rows = []
    for kernel, seconds in zip(compiled, clock.seconds):
        described.add(id(kernel))
        rows.append({"job": label, **describe(kernel, seconds)})
        print(f"{label}: {kernel.name} compiled in {seconds:.2f} s, {rows[-1]['registers']} registers, "
              f"{rows[-1]['spill_stack_bytes']} B spilled, inner loops {inner_loops(rows[-1])}", flush=True)
    return rows


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", type=int, default=90, help="the GPU architecture compiled for (90: H100, H200)")
    parser.add_argument("--heads", default=HEAD_SHAPES,
                        help="the attention's head shapes, HEADS:KEY_HEADS:DIM,... (empty: no attention kernels)")
    parser.add_argument("--vocabs", default=VOCABS, help="the loss pass's row lengths (empty: no cross entropy)")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"),
                        help="the activations' dtype (stage two's autocast: bfloat16)")
    parser.add_argument("--configs", default="",
                        help="the attention kernels' launches in place of block_attention's, "
                             "KERNEL=ROWS,KEYS,WARPS,STAGES;... (KERNEL: forward, dq, dkdv)")
    parser.add_argument("--only", default="", help="report only the kernels whose name contains one of these, "
                                                   "comma-separated (forward, dq, dkdv, ce, adamw); all compile")
    parser.add_argument("--out", help="JSON results")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise SystemExit("kernel_report: unset TRITON_INTERPRET (the interpreter compiles nothing)")
    try:
        import triton
        from triton.runtime.driver import driver
    except ImportError:
        raise SystemExit("kernel_report: needs Triton (`pip install triton`; a GPU install has it)") from None

    from dflash.model import block_attention

    overrides, cache_dir = dict(block_attention.CONFIGS_OVERRIDE), os.environ.get("TRITON_CACHE_DIR")
    block_attention.CONFIGS_OVERRIDE.update(parse_configs(args.configs))
    cache = tempfile.mkdtemp(prefix="dflash-kernel-report-")
    os.environ["TRITON_CACHE_DIR"] = cache  # empty: every kernel compiles, as on a new machine
    rows, described, previous = [], set(), getattr(driver, "_active", None)
    driver.set_active(CompileOnlyDriver(args.arch))
    try:
        for label, job in compile_jobs(parse_head_shapes(args.heads), [int(v) for v in args.vocabs.split(",") if v],
                                       getattr(torch, args.dtype)):
            rows += compile_job(label, job, described)
    finally:  # this process's Triton, launches and caches as they were
        driver.set_active(previous)  # None: Triton finds the real driver again at its next use
        forget_compiles()
        block_attention.CONFIGS_OVERRIDE.clear()
        block_attention.CONFIGS_OVERRIDE.update(overrides)
        if cache_dir is None:
            os.environ.pop("TRITON_CACHE_DIR", None)
        else:
            os.environ["TRITON_CACHE_DIR"] = cache_dir
        shutil.rmtree(cache, ignore_errors=True)
    wanted = [name for name in args.only.split(",") if name]
    shown = [row for row in rows if not wanted or any(name in row["kernel"].lower() for name in wanted)]
    print_table(f"dflash's Triton kernels compiled for sm_{args.arch} (Triton {triton.__version__}), "
                f"one at a time on this CPU",
                ["job", "kernel", "constants", "warps, stages", "compile s", "registers", "spilled B", "shared KiB",
                 "instructions", "inner loops: instructions / spill ops / MMA a trip"],
                [[row["job"], row["kernel"], constants(row), f"{row['num_warps']}, {row['num_stages']}",
                  row["compile_s"], row["registers"], row["spill_stack_bytes"], round(row["shared_bytes"] / 1024, 1),
                  row["instructions"], inner_loops(row)] for row in shown])
    print(f"\ncompile seconds, all {len(rows)} kernels one after another: {sum(r['compile_s'] for r in rows):.2f}")
    if args.out:
        write_results(args.out, {**run_metadata([__file__.split('/')[-1], *argv]), "arch": args.arch,
                                 "triton": triton.__version__, "kernels": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
