"""Write a random-weight Qwen3.5/3.6-27B-shaped checkpoint directory (no download).

For runs of the real pipeline at the real shape without the real weights: the directory
holds config.json, safetensors weights and the offline Qwen3.5/3.6 tokenizer, so
`dflash stage1-extract --set target.path=DIR` treats it like a downloaded checkpoint.
`--layers` keeps the 27B widths with fewer layers (small-but-real-shape runs).

    python tools/make_random_target.py --out /data/dflash/random-27b            # all 64 layers, ~54 GB
    python tools/make_random_target.py --out /tmp/random-27b-8l --layers 8     # 8 layers, ~12 GB
"""

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchlib import build_random_target, qwen35_27b_config  # noqa: E402

from dflash.data.tokenizer import build_qwen_tokenizer  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="checkpoint directory to write")
    parser.add_argument("--layers", type=int, default=64, help="decoder layers (multiple of 4 keeps the pattern)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    start = time.perf_counter()
    config = qwen35_27b_config()
    config.num_hidden_layers = args.layers
    config.layer_types = config.layer_types[:args.layers]
    torch.manual_seed(args.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = build_random_target(config, device, torch.bfloat16)
    out = Path(args.out)
    model.save_pretrained(out, max_shard_size="5GB")
    build_qwen_tokenizer().save_pretrained(out)
    params = sum(p.numel() for p in model.parameters())
    print(f"wrote {out}: {args.layers} layers, {params / 1e9:.2f}B parameters, {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
