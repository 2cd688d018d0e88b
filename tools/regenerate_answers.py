"""Regenerate the answers of a chat source with the target (greedy), for the labels experiment.

A drafter is accepted where it predicts the target, so DFlash's recipe trains on the target's
own answers. This one-off tool (the experiment of BENCHMARKS.md's real-target section; the
product command is issue 13's `dflash generate`) takes the rows of a source, optionally only
those a store's run trains on (`--train-split-of CONFIG`: the samples `split_holdout` leaves
for training at `--holdout-fraction`), renders each conversation up to its last answer with
the target's chat template, generates the answer with transformers `generate` in
length-sorted, left-padded batches, and writes JSONL rows `{"messages": [..., answer]}` that
`data.source` reads. Answers cut at `--max-new-tokens` are kept and counted.

    python tools/regenerate_answers.py -c configs/smollm2-135m.toml --set data.source=embedded:code-docs \\
        --train-split-of CONFIG --holdout-fraction 0.5 --out regenerated.jsonl
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash import data  # noqa: E402
from dflash.config import load_config  # noqa: E402
from dflash.target import load_causal_lm, prepare_checkpoint, stop_token_ids, target_dtype  # noqa: E402
from dflash.tokenizer import load_target_tokenizer  # noqa: E402
from stages import evaluate  # noqa: E402


def training_row_ids(config_path: str, overrides, fraction: float) -> set[int]:
    """Row ids of the samples a run on that config's store trains on at holdout `fraction`."""
    from dflash.sampler import split_holdout
    from dflash.store import StoreReader

    config = load_config(config_path, overrides)
    reader = StoreReader(config.store.path)
    train_indices, _ = split_holdout(len(reader), fraction, config.train.seed)
    return {int(reader.sample_row_id[i]) for i in train_indices}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-c", "--config", default=None, help="dflash config: target and data.source")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--train-split-of", default=None, help="only rows this config's store trains on")
    parser.add_argument("--holdout-fraction", type=float, default=None)
    parser.add_argument("--max-new-tokens", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--limit", type=int, default=0, help="only the first N rows (0: all)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)

    config = load_config(args.config, args.overrides)
    device = evaluate.resolve_device("auto")
    checkpoint = prepare_checkpoint(config.target.path, config.data.cache_dir)
    tokenizer = load_target_tokenizer(checkpoint, config.target.chat_template)
    target = load_causal_lm(str(checkpoint), target_dtype(config.target.dtype, device), device)
    keep = None
    if args.train_split_of:
        fraction = config.train.holdout_fraction if args.holdout_fraction is None else args.holdout_fraction
        keep = training_row_ids(args.train_split_of, args.overrides, fraction)
    prompts = []
    for row_id, row in data.read_rows(config.data.source, config.data.split):
        if keep is not None and row_id not in keep:
            continue
        try:
            messages = data.prompt_messages(row)
        except data.RowProblem:
            continue
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        prompts.append((messages, tokenizer(text, add_special_tokens=False)["input_ids"]))
        if len(prompts) == args.limit:
            break
    prompts.sort(key=lambda item: len(item[1]))
    stops = stop_token_ids(tokenizer, target)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stops[0]
    written, cut, tokens, start = 0, 0, 0, time.perf_counter()
    bar = tqdm(total=len(prompts), unit="prompt", desc="regenerate")
    with open(args.out, "w") as out:
        for first in range(0, len(prompts), args.batch_size):
            batch = prompts[first:first + args.batch_size]
            width = max(len(ids) for _, ids in batch)
            input_ids = torch.full((len(batch), width), pad, dtype=torch.long)
            attention = torch.zeros((len(batch), width), dtype=torch.long)
            for row, (_, ids) in enumerate(batch):  # left padding: every answer starts at column `width`
                input_ids[row, width - len(ids):] = torch.tensor(ids)
                attention[row, width - len(ids):] = 1
            with torch.inference_mode():
                generated = target.generate(input_ids=input_ids.to(device), attention_mask=attention.to(device),
                                            max_new_tokens=args.max_new_tokens, do_sample=False,
                                            eos_token_id=stops, pad_token_id=pad)
            for (messages, _), answer_ids in zip(batch, generated[:, width:].tolist()):
                ended = next((i for i, token in enumerate(answer_ids) if token in stops), None)
                cut += ended is None
                answer_ids = answer_ids if ended is None else answer_ids[:ended]
                tokens += len(answer_ids)
                answer = tokenizer.decode(answer_ids, skip_special_tokens=True)
                out.write(json.dumps({"messages": messages + [{"role": "assistant", "content": answer}]}) + "\n")
                written += 1
            bar.update(len(batch))
            bar.set_postfix(tokens_per_s=f"{tokens / (time.perf_counter() - start):,.0f}")
    bar.close()
    seconds = time.perf_counter() - start
    print(f"regenerated {written} answers, {tokens:,} tokens in {seconds:.0f} s ({tokens / seconds:,.0f} tokens/s); "
          f"{cut} cut at {args.max_new_tokens} tokens -> {args.out}")


if __name__ == "__main__":
    main()
