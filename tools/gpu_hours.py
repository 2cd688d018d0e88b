"""GPU-hours of a drafter training run, this design (offline cache) against the online one.

From measured rates (the JSON files of bench_stage1.py and bench_stage2.py):
  offline: stage one runs the target once over the data (full stage-one path, tokens/s per
           GPU over its forward span, plus the writer pool's start and final drain once), stage two
           trains `epochs` epochs from the store (tokens/s per GPU);
  online:  every epoch runs the target forward again (the bare forward's tokens/s per GPU;
           the online trainer needs the hidden states but not the store) and trains the drafter
           on the same GPUs at the same stage-two rate.
The drafter's work is the same in both designs, so the difference is the target forwards
(epochs - 1 of them saved) minus what writing the cache costs over a bare forward.

    python tools/gpu_hours.py --stage1 bench/stage1.json --stage2 bench/stage2.json
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchlib import print_table  # noqa: E402


def rates(stage1: dict, stage2: dict, codec: str, mode: str) -> dict:
    if codec not in stage1.get("full", {}):
        raise SystemExit(f"--stage1: no full stage-one result for codec {codec!r} (have {list(stage1.get('full', {}))})")
    if mode not in stage2.get("modes", {}):
        raise SystemExit(f"--stage2: no result for mode {mode!r} (have {list(stage2.get('modes', {}))})")
    train = stage2["modes"][mode]
    per_gpu = train["tokens_per_s"] / stage2.get("world_size", 1)
    full = stage1["full"][codec]
    # A long run pays the writer pool's start and final drain once: the rate over the forward
    # span plus those seconds (older results: the rate before the drain plus the drain).
    if "tokens_per_s_steady" in full:
        stage_one, fixed = full["tokens_per_s_steady"], full["fixed_seconds"]
    elif "tokens_per_s_before_drain" in full:
        stage_one, fixed = full["tokens_per_s_before_drain"], full.get("drain_seconds", 0.0)
    else:
        stage_one, fixed = full["tokens_per_s"], 0.0
    return {"bare_forward": stage1["bare"]["tokens_per_s"], "stage_one": stage_one,
            "stage_one_drain_seconds": fixed, "stage_two": per_gpu}


def gpu_hours(rate: dict, tokens: float, epochs: int) -> dict:
    hours = {
        "offline_stage_one": (tokens / rate["stage_one"] + rate.get("stage_one_drain_seconds", 0.0)) / 3600,
        "offline_stage_two": epochs * tokens / rate["stage_two"] / 3600,
        "online_target": epochs * tokens / rate["bare_forward"] / 3600,
        "online_drafter": epochs * tokens / rate["stage_two"] / 3600,
    }
    hours["offline"] = hours["offline_stage_one"] + hours["offline_stage_two"]
    hours["online"] = hours["online_target"] + hours["online_drafter"]
    hours["online_over_offline"] = hours["online"] / hours["offline"]
    return hours


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stage1", required=True, help="bench_stage1.py JSON")
    parser.add_argument("--stage2", required=True, help="bench_stage2.py JSON")
    parser.add_argument("--codec", default="fp8")
    parser.add_argument("--mode", default="default",
                        help="bench_stage2 mode whose tokens/s is used: default (the real length mix, anchor-dense "
                             "short sequences) or peer (one 8,192-token sequence, 512 anchors)")
    parser.add_argument("--tokens", type=float, default=1e9)
    parser.add_argument("--epochs", type=int, default=6)
    args = parser.parse_args(argv)
    rate = rates(json.loads(Path(args.stage1).read_text()), json.loads(Path(args.stage2).read_text()),
                 args.codec, args.mode)
    hours = gpu_hours(rate, args.tokens, args.epochs)
    print_table(f"{args.epochs} epochs over {args.tokens:,.0f} tokens (GPU-hours)",
                ["design", "target forwards", "drafter training", "total"],
                [["offline (dflash: stage one once, then stage two)", hours["offline_stage_one"],
                  hours["offline_stage_two"], hours["offline"]],
                 ["online (target recomputed every epoch)", hours["online_target"], hours["online_drafter"],
                  hours["online"]]])
    print(f"\nrates (tokens/s per GPU): bare forward {rate['bare_forward']:,.0f}, stage one {rate['stage_one']:,.0f}, "
          f"stage two {rate['stage_two']:,.0f}; online / offline = {hours['online_over_offline']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
