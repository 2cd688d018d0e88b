"""`dflash eval`: the served acceptance of an exported drafter, by real speculative decoding.

`run(config, options)` loads the target (`target.path`: a checkpoint directory, a GGUF file or
the embedded tiny target) and one or more exports, takes prompts (the held-out split of the
config's store, or any data source), and for each prompt decodes plainly once (greedy, the
baseline) and then speculatively with each drafter through `dflash.modeling_dflash` (the class
and loop an export serves). Several drafters (checkpoints of one run, or rival runs) share the
prompts and the baseline. For each it reports the acceptance
length tau (tokens committed per verifying target forward), its histogram over 1..B, the
acceptance of each block slot, the wall-clock speedup over the baseline (every loop decodes the
first prompt once untimed first), and, at temperature 0, whether the speculative output equals
the baseline token for token, telling rounding near-ties of a bf16 target apart from real
mismatches. The decoding, results and report are `dflash.evaluation`'s.

Prompts end where the answer starts: a held-out sample's tokens before its first supervised
token (the chat template's generation prompt included), or a row's conversation before its
last assistant turn rendered with `add_generation_prompt=True`. Nothing here was trained on:
the held-out split is the one stage two holds out (`train.holdout_fraction`, `train.seed`).
"""

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from dflash import data
from dflash.config import Config, ConfigError
from dflash.data import row_label
from dflash.evaluation import (EvalResult, decode_prompt, plot, print_report, summarize, timed, warm_up,
                               write_json)
from dflash.modeling_dflash import DFlashDraftModel, greedy_generate
from dflash.target import (find_decoder_layers, load_causal_lm, prepare_checkpoint, stop_token_ids,
                           target_dtype)
from dflash.tokenizer import load_target_tokenizer, tokenizer_identity

HELDOUT = "heldout"


@dataclass(frozen=True)
class EvalOptions:
    drafters: tuple[str, ...]  # export directories
    prompts: str = HELDOUT  # "heldout" or a data source
    num_prompts: int = 32
    max_new_tokens: int = 256
    temperature: float = 0.0
    seed: int = 0
    device: str = "auto"
    out: str = ""  # JSON path
    plot: str = ""  # PNG path


def run(config: Config, options: EvalOptions) -> list[EvalResult]:
    device = resolve_device(options.device)
    dtype = target_dtype(config.target.dtype, device)
    checkpoint = prepare_checkpoint(config.target.path, config.data.cache_dir)
    tokenizer = load_target_tokenizer(checkpoint, config.target.chat_template)
    target = load_causal_lm(str(checkpoint), dtype, device)
    drafts = [load_drafter(path, target, dtype, device) for path in options.drafters]
    prompts = load_prompts(config, options, tokenizer)
    results = [EvalResult(drafter=path, target=config.target.path, prompts_source=options.prompts, device=str(device),
                          dtype=str(dtype).removeprefix("torch."), block_size=draft.block_size,
                          temperature=options.temperature, max_new_tokens=options.max_new_tokens)
               for path, draft in zip(options.drafters, drafts)]
    stops = stop_token_ids(tokenizer, target)
    generator = torch.Generator(device=device).manual_seed(options.seed)
    warm_up(drafts, target, prompts[0][1], options.max_new_tokens, stops, device)
    bar = tqdm(prompts, unit="prompt", desc="eval", dynamic_ncols=True)
    for prompt_id, prompt_ids in bar:
        input_ids = torch.as_tensor(prompt_ids, dtype=torch.long, device=device)[None]
        baseline = timed(device, lambda: greedy_generate(target, input_ids, options.max_new_tokens, stops))
        for draft, result in zip(drafts, results):
            result.per_prompt.append(decode_prompt(draft, target, prompt_id, input_ids, baseline,
                                                   options.max_new_tokens, options.temperature, stops, generator,
                                                   device))
        bar.set_postfix(tau="/".join(f"{summarize(result).tau:.2f}" for result in results))
    bar.close()
    for result in results:
        summarize(result)
    print_report(results)
    if options.out:
        write_json(results, options.out)
    if options.plot:
        plot(results, options.plot)
    return results


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def load_drafter(export_dir: str, target, dtype: torch.dtype, device: torch.device) -> DFlashDraftModel:
    """The export as served, checked against the target it drafts for."""
    if not (Path(export_dir) / "config.json").is_file():
        raise FileNotFoundError(f"--drafter {export_dir}: not a drafter export (no config.json); make one with "
                                f"`dflash export CHECKPOINT DIR`")
    draft = DFlashDraftModel.from_pretrained(export_dir, dtype=dtype).to(device).eval()
    _, _, layers = find_decoder_layers(target)
    vocab, hidden = target.get_input_embeddings().weight.shape
    problems = []
    if draft.config.hidden_size != hidden:
        problems.append(f"hidden size {draft.config.hidden_size}, target {hidden}")
    if max(draft.target_layer_ids) >= len(layers):
        problems.append(f"target_layer_ids {draft.target_layer_ids}, target has {len(layers)} layers")
    if not 0 <= draft.mask_token_id < vocab:
        problems.append(f"mask_token_id {draft.mask_token_id} outside the target vocabulary ({vocab})")
    if problems:
        raise ValueError(f"--drafter {export_dir} does not fit the target: {'; '.join(problems)}")
    return draft


# ----------------------------------------------------------------------------- prompts


def load_prompts(config: Config, options: EvalOptions, tokenizer) -> list[tuple[str, np.ndarray]]:
    if options.num_prompts < 1:
        raise ConfigError(f"--num-prompts must be positive, got {options.num_prompts}")
    if options.prompts == HELDOUT:
        prompts = heldout_prompts(config, tokenizer, options.num_prompts)
    else:
        prompts = source_prompts(options.prompts, config.data.split, tokenizer, options.num_prompts)
    if not prompts:
        raise ValueError(f"--prompts {options.prompts}: no usable prompt")
    return prompts


def heldout_prompts(config: Config, tokenizer, num_prompts: int) -> list[tuple[str, np.ndarray]]:
    """Prompts of the samples stage two holds out of training (same store, fraction and seed)."""
    from dflash.sampler import split_holdout
    from dflash.store import StoreReader

    reader = StoreReader(config.store.path)
    stored = reader.attrs["tokenizer"]["hash"]
    if stored != tokenizer_identity(tokenizer)["hash"]:
        raise ValueError(f"store {config.store.path} was tokenized with another tokenizer or chat template than "
                         f"target {config.target.path} has now; its prompts would not be what the target reads")
    _, eval_indices = split_holdout(len(reader), config.train.holdout_fraction, config.train.seed)
    if not eval_indices.size:
        raise ConfigError("--prompts heldout: train.holdout_fraction is 0, so no sample was held out; "
                          "pass --prompts SOURCE")
    prompts = []
    for index in eval_indices[:num_prompts]:
        sample = reader.read_sample(int(index))
        first_answer = int(np.argmax(sample["loss_mask"]))
        if first_answer > 0:
            prompts.append((f"{row_label(sample['row_id'])} (sample {int(index)})", sample["input_ids"][:first_answer]))
    return prompts


def source_prompts(source: str, split: str, tokenizer, num_prompts: int) -> list[tuple[str, np.ndarray]]:
    """The first `num_prompts` usable rows of a data source, rendered up to their last answer."""
    prompts, skipped = [], 0
    for row_id, row in data.read_rows(source, split):
        try:
            messages = data.prompt_messages(row)
        except data.RowProblem:
            skipped += 1
            continue
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        prompts.append((row_label(row_id), np.asarray(ids, dtype=np.int64)))
        if len(prompts) == num_prompts:
            break
    if skipped:
        print(f"prompts: skipped {skipped} row(s) of {source} with no usable conversation")
    return prompts
