"""Compare `dflash eval`'s speculative loop with the reference inference code of z-lab/dflash.

The reference (`dflash/model.py` of a z-lab/dflash checkout, given by --reference; not part of
this repository) is loaded from that path and runs its own `dflash_generate` loop with its own
`DFlashDraftModel` on our export. Per prompt, this prints the acceptance lengths and outputs of
both loops and whether they agree.

`--reference-attention` chooses how the reference's drafter attends:
- `sdpa`: as its README loads it. transformers' SDPA path ignores the `sliding_window` it is
  given and the module is non-causal, so every layer is bidirectional over all context.
- `engine`: the reference's attention call with the mask vLLM and SGLang apply by default and
  dflash trains with: full layers bidirectional in the block, sliding layers causal in the block
  and windowed (`query_pos - key_pos < sliding_window`).
With a drafter of full-attention layers only, both modes are the trained semantics.

Adaptations, none of them in the loop: its stats timer runs without CUDA on a CPU machine, and
two for transformers 5: `DynamicCache.crop(n)` with n > 0
(keep n tokens) is done through the negative form, and a target forward gets `cache` where the
installed transformers renamed `past_key_values`.

    python tools/compare_reference.py --reference /path/to/z-lab-dflash -c configs/smollm2-135m.toml \
        --drafter runs/smollm2/export --num-prompts 8 --max-new-tokens 64 --out compare.json
"""

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash.config import load_config  # noqa: E402
from dflash.data.tokenizer import load_target_tokenizer  # noqa: E402
from dflash.dist import resolve_device  # noqa: E402
from dflash.extract.target import load_causal_lm, prepare_checkpoint, stop_token_ids, target_dtype  # noqa: E402
from dflash.model.modeling_dflash import speculative_generate  # noqa: E402
from dflash.serve import evaluation  # noqa: E402


def load_reference(checkout: Path, attention: str):
    module_path = checkout / "dflash" / "model.py"
    if not module_path.is_file():
        raise FileNotFoundError(f"--reference {checkout}: no dflash/model.py (a z-lab/dflash checkout is expected)")
    spec = importlib.util.spec_from_file_location("zlab_dflash_model", module_path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    class KeepingCache(module.DynamicCache):
        def crop(self, length: int) -> None:
            remove = self.get_seq_length() - length if length >= 0 else -length
            if remove > 0:
                super().crop(-remove)

    module.DynamicCache = KeepingCache
    if not torch.cuda.is_available():
        module._cuda_time = time.perf_counter  # its stats timer synchronises CUDA unconditionally
    if attention == "engine":
        module.eager_attention_forward = engine_attention
    return module


def engine_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, sliding_window=None, **_):
    """Attention of the block queries (the last keys) with the engines' default DFlash mask."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    num_queries, num_keys = query.shape[2], key.shape[2]
    mask = None
    if sliding_window is not None:
        slot = torch.arange(num_queries, device=query.device)[:, None]
        key_index = torch.arange(num_keys, device=query.device)[None, :]
        query_pos = num_keys - num_queries + slot
        context = key_index < num_keys - num_queries
        mask = torch.where(context, query_pos - key_index < sliding_window, key_index <= query_pos)
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def cache_renaming(target):
    """A callable target that takes `past_key_values` and hands it to a forward that calls it `cache`."""
    from dflash.model.modeling_dflash import cache_keyword

    if cache_keyword(target) == "past_key_values":
        return target
    original = target.forward

    def forward(*args, past_key_values=None, **kwargs):
        return original(*args, cache=past_key_values, **kwargs)

    target.forward = forward
    return target


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reference", required=True, type=Path, help="a z-lab/dflash checkout")
    parser.add_argument("-c", "--config", default=None, help="dflash config naming the target (and store)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--drafter", required=True, help="an export directory")
    parser.add_argument("--prompts", default=evaluation.HELDOUT)
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--reference-attention", choices=("sdpa", "engine"), default="engine")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)

    config = load_config(args.config, args.overrides)
    device = resolve_device(args.device)
    dtype = target_dtype(config.target.dtype, device)
    checkpoint = prepare_checkpoint(config.target.path, config.data.cache_dir)
    tokenizer = load_target_tokenizer(checkpoint, config.target.chat_template)
    target = load_causal_lm(str(checkpoint), dtype, device)
    ours = evaluation.load_drafter(args.drafter, target, dtype, device)
    reference = load_reference(args.reference, args.reference_attention)
    theirs = reference.DFlashDraftModel.from_pretrained(args.drafter, dtype=dtype).to(device).eval()
    theirs.config._attn_implementation = "eager" if args.reference_attention == "engine" else "sdpa"
    prompts = evaluation.load_prompts(config, args.prompts, args.num_prompts, tokenizer)
    stops = stop_token_ids(tokenizer, target)
    rows, same_lengths, same_outputs = [], 0, 0
    for prompt_id, prompt_ids, _ in prompts:
        input_ids = torch.as_tensor(prompt_ids, device=device)[None]
        mine = speculative_generate(ours, target, input_ids, args.max_new_tokens, stops, 0.0)
        with torch.inference_mode():
            ref = reference.dflash_generate(theirs, cache_renaming(target), input_ids, args.max_new_tokens, stops,
                                            0.0, return_stats=True)
        ref_generated = ref.output_ids[0, input_ids.shape[1]:].tolist()
        row = {"prompt": prompt_id, "ours": mine.acceptance_lengths, "reference": list(ref.acceptance_lengths),
               "same_acceptance": mine.acceptance_lengths == list(ref.acceptance_lengths),
               "same_output": mine.generated == ref_generated}
        same_lengths += row["same_acceptance"]
        same_outputs += row["same_output"]
        rows.append(row)
        print(f"{prompt_id}: tau ours {sum(row['ours']) / len(row['ours']):.3f}, reference "
              f"{sum(row['reference']) / len(row['reference']):.3f}; acceptance lengths "
              f"{'equal' if row['same_acceptance'] else 'differ'}, outputs {'equal' if row['same_output'] else 'differ'}")
    tau = {key: sum(sum(r[key]) for r in rows) / sum(len(r[key]) for r in rows) for key in ("ours", "reference")}
    print(f"\n{len(rows)} prompts, reference attention {args.reference_attention}: acceptance lengths equal on "
          f"{same_lengths}, outputs equal on {same_outputs}; tau ours {tau['ours']:.3f}, reference {tau['reference']:.3f}")
    if args.out:
        Path(args.out).write_text(json.dumps({"reference_attention": args.reference_attention, "tau": tau,
                                              "prompts": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
