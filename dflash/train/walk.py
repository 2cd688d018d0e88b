"""Stage two's held-out tau as served, on exactly the prompts `dflash eval --prompts heldout` served.

`dflash eval` serves the first N held-out prompts; stage two's `eval/served_tau` walks a few hundred
held-out greedy answers (`train.eval_batches` micro-batches). To put the two side by side on the same
prompts, `walk_evals` reads an eval's JSON, finds each served prompt's greedy answer in the store (the answer
of that prompt whose tokens are the target's labels, `dflash.train.served.GREEDY_SHARE`), and walks it
from the stored features through the training checkpoint's drafter as the temperature-0 serving loop
walks it (`dflash.train.step.evaluate_served`, one answer per micro-batch), over the eval's
`max_new_tokens`. Every drafter of the eval JSON is matched to its checkpoint: `.../export-<step>` or
`.../step-<step>` to `<checkpoints>/step-<step>`, any other to the last complete checkpoint.

    python -m dflash.train.walk -c configs/smollm2-recipe.toml --set store.path=... \\
        --checkpoints runs/recipe/drafter/checkpoints --eval runs/recipe/results/eval-heldout.json \\
        --out runs/recipe/results/walk.json

Prints, per drafter, the served tau, the teacher-forced walk's tau over the same prompts and their
ratio, and per prompt both; writes them to `--out` (`dflash recipe`'s walk part).
"""


import argparse
import functools
import json
import re
import sys
from pathlib import Path

import numpy as np
import torch

from dflash.config import ConfigError, load_config
from dflash.dist import init_distributed
from dflash.model.drafter import DFlashDrafter
from dflash.outputs import write_text_atomic
from dflash.store.reader import StoreReader
from dflash.train import mix, served
from dflash.train.batch import StoreDataset, collate_options, collate_packed
from dflash.train.checkpoint import checkpoint_drafter_args, complete_checkpoints, load_checkpoint, step_dir_name
from dflash.train.sampler import holdout_groups
from dflash.train.step import build_context, evaluate_served

SAMPLE_ID = re.compile(r"\(sample (\d+)\)$")  # dflash.serve.evaluation.heldout_prompts' prompt ids


def served_samples(eval_result: dict) -> list[int]:
    """The store sample index behind each prompt of an eval result (`--prompts heldout` only)."""
    indices = []
    for prompt in eval_result["per_prompt"]:
        found = SAMPLE_ID.search(prompt["prompt_id"])
        if not found:
            raise ValueError(f"prompt {prompt['prompt_id']!r} is not a held-out sample of the store: "
                             f"walk the evals of `dflash eval --prompts heldout` only")
        indices.append(int(found.group(1)))
    return indices


def held_out_split(config, reader) -> tuple[np.ndarray | None, np.ndarray]:
    """Stage two's prompt groups and held-out sample indices under `config` (as the trainer splits)."""
    groups = holdout_groups(config, reader)
    return groups, mix.held_out_split(config, reader, groups)[1]


def greedy_answers(reader, split, samples: list[int], tokens: int, block_size: int) -> list[int | None]:
    """For each served sample, the held-out sample of its prompt whose answer is the target's greedy one
    (None: that prompt has no greedy answer in the store); `split`: `held_out_split`'s."""
    groups, eval_indices = split
    answers = []
    for sample in samples:
        same_prompt = eval_indices[groups[eval_indices] == groups[sample]] if groups is not None else np.array([sample])
        if sample not in set(same_prompt.tolist()):
            raise ValueError(f"sample {sample} is not held out under this config (train.holdout_fraction, "
                             f"train.seed, train.holdout_by): the eval read another split")
        greedy = served.greedy_held_out(reader, same_prompt, tokens, block_size)
        answers.append(int(greedy[0]) if greedy.size else None)
    return answers


def checkpoint_for(drafter: str, checkpoints: Path) -> Path:
    """`.../export-<step>` -> `<checkpoints>/step-<step>`; anything else -> the last complete checkpoint."""
    tail = Path(drafter.rstrip("/")).name.rsplit("-", 1)[-1]
    if tail.isdigit():
        path = checkpoints / step_dir_name(int(tail))
        if not path.is_dir():
            raise FileNotFoundError(f"drafter {drafter}: no checkpoint {path}")
        return path
    found = complete_checkpoints(checkpoints)
    if not found:
        raise FileNotFoundError(f"no complete checkpoint under {checkpoints}")
    return found[-1]


@functools.cache
def load_drafter(checkpoint: Path, device: torch.device) -> DFlashDrafter:
    """A checkpoint's drafter on `device`, once per checkpoint (several evals serve the last one)."""
    loaded = load_checkpoint(checkpoint)
    model = DFlashDrafter(checkpoint_drafter_args(loaded))
    model.load_state_dict(loaded.model_state)
    return model.to(device)


def walk(config, reader, model: DFlashDrafter, ctx, answers: list[int | None], tokens: int,
         dist) -> list[list[int] | None]:
    """Each answer's acceptance lengths walked as served (None where the prompt had no greedy answer)."""
    dataset = StoreDataset(reader, config.train.max_anchors, config.train.seed, served_tokens=tokens)
    collate = functools.partial(collate_packed, **collate_options(ctx.backend, model.args))
    found = []  # (sample index, acceptance lengths): one micro-batch per answer, in one evaluation
    micro_batches = [np.array([answer]) for answer in answers if answer is not None]
    evaluate_served(dist, model, ctx, dataset, collate, micro_batches, tokens, walks=found)
    by_sample = dict(found)
    return [None if answer is None else by_sample.get(answer) for answer in answers]


def tau(lengths: list[list[int]]) -> float:
    """The mean over verifications, as `dflash eval` reports it."""
    flat = [length for walk in lengths for length in walk]
    return float(np.mean(flat)) if flat else float("nan")


def walk_evals(config, checkpoints: Path, eval_paths: list[str], device: str = "auto") -> list[dict]:
    """Every temperature-0 drafter of each eval JSON walked teacher-forced on its served prompts: one entry
    per (eval, drafter) with the served and teacher-forced taus and both per prompt."""
    dist = init_distributed(device)
    reader = StoreReader(config.store.path)
    if not reader.has_labels:
        raise ConfigError(f"store {config.store.path} holds the dataset's labels (store.labels), not the target's: "
                          f"the walk needs the target's greedy token at every position")
    split = held_out_split(config, reader)
    ctx = None
    report = []
    for eval_path in eval_paths:
        for result in json.loads(Path(eval_path).read_text())["results"]:
            if result["temperature"] != 0:
                print(f"{eval_path}: {result['drafter']} served at temperature {result['temperature']:g}; "
                      f"the walk is temperature 0's, left out")
                continue
            checkpoint = checkpoint_for(result["drafter"], checkpoints)
            model = load_drafter(checkpoint, dist.device)
            if ctx is None or ctx.args != model.args:  # the frozen embeddings and head: read once per drafter shape
                ctx = build_context(config, model.args, reader, dist)
            report.append(walk_result(config, reader, split, model, ctx, dist, eval_path, result, checkpoint))
    return report


def walk_result(config, reader, split, model, ctx, dist, eval_path: str, result: dict, checkpoint: Path) -> dict:
    """One eval result's prompts walked: its entry of `walk_evals`, printed."""
    tokens = result["max_new_tokens"]
    samples = served_samples(result)
    answers = greedy_answers(reader, split, samples, tokens, result["block_size"])
    walks = walk(config, reader, model, ctx, answers, tokens, dist)
    prompts = [{"prompt_id": prompt["prompt_id"], "greedy_sample": answer,
                "served_tau": float(np.mean(prompt["acceptance_lengths"])),
                "teacher_forced_tau": tau([lengths]) if lengths else None,
                "served_lengths": prompt["acceptance_lengths"], "teacher_forced_lengths": lengths}
               for prompt, answer, lengths in zip(result["per_prompt"], answers, walks)]
    both = [(prompt["served_lengths"], prompt["teacher_forced_lengths"]) for prompt in prompts
            if prompt["teacher_forced_lengths"]]
    entry = {"eval": eval_path, "drafter": result["drafter"], "checkpoint": str(checkpoint),
             "prompts_source": result["prompts_source"], "max_new_tokens": tokens,
             "served_tau": result["tau"], "served_tau_same_prompts": tau([pair[0] for pair in both]),
             "teacher_forced_tau": tau([pair[1] for pair in both]), "walked_prompts": len(both),
             "prompts": prompts}
    entry["ratio"] = entry["teacher_forced_tau"] / entry["served_tau_same_prompts"]
    print(f"{Path(eval_path).name} {result['drafter']} ({checkpoint.name}): served tau {result['tau']:.3f} "
          f"over {len(samples)} prompts; on the {len(both)} with a greedy answer in the store: served "
          f"{entry['served_tau_same_prompts']:.3f}, teacher-forced as served {entry['teacher_forced_tau']:.3f} "
          f"({100 * (entry['ratio'] - 1):+.1f}%)")
    for prompt in prompts:
        forced = prompt["teacher_forced_tau"]
        print(f"    {prompt['prompt_id']}: served {prompt['served_tau']:.2f}, teacher-forced "
              f"{'-' if forced is None else f'{forced:.2f}'}")
    return entry


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("-c", "--config", help="the config stage two trained with (store, split)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="config overrides, as the dflash commands take them")
    parser.add_argument("--checkpoints", required=True, help="stage two's checkpoints folder (train.out_dir/checkpoints)")
    parser.add_argument("--eval", dest="evals", action="append", required=True,
                        help="a `dflash eval --prompts heldout` JSON at temperature 0 (repeat for several)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--out", help="JSON of the served and teacher-forced walks, per drafter and prompt")
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config, args.overrides)
        report = walk_evals(config, Path(args.checkpoints), args.evals, args.device)
    except ConfigError as error:
        parser.error(str(error))
    if args.out:
        write_text_atomic(Path(args.out), json.dumps({"walks": report}, indent=1) + "\n")
        print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
