"""`dflash eval`: the served acceptance of an exported drafter, by real speculative decoding.

`run(config, options)` loads the target (`target.path`: a checkpoint directory, a GGUF file or
the embedded tiny target) and one or more exports, takes prompts (the held-out split of the
config's store, or any data source), and for each prompt decodes plainly once (greedy, the
baseline) and then speculatively with each drafter through `dflash.model.modeling_dflash` (the class
and loop an export serves). Several drafters (checkpoints of one run, or rival runs) share the
prompts and the baseline. For each it reports the acceptance
length tau (tokens committed per verifying target forward), its histogram over 1..B, the
acceptance of each block slot, the wall-clock speedup over the baseline (on CUDA every loop
decodes the first prompt once untimed first), and, at temperature 0, whether the speculative output equals
the baseline token for token, telling rounding near-ties of a bf16 target apart from real
mismatches. The decoding, results and report are `dflash.serve.evaluation`'s.

Prompts end where the answer starts: a held-out sample's tokens before its first supervised
token (the chat template's generation prompt included), or a row's conversation before its
last assistant turn rendered with `add_generation_prompt=True`. Nothing here was trained on:
the held-out split is the one stage two holds out (`train.holdout_fraction`, `train.seed`).
"""

from dataclasses import dataclass

import torch
from tqdm import tqdm

from dflash.config import Config
from dflash.data.tokenizer import load_target_tokenizer
from dflash.dist import resolve_device
from dflash.extract.target import load_causal_lm, prepare_checkpoint, stop_token_ids, target_dtype
from dflash.model.modeling_dflash import greedy_generate
from dflash.serve.evaluation import (HELDOUT, EvalResult, check_drafter_export, decode_prompt, load_drafter,
                                     load_prompts, mark_code, plot, print_report, summarize, timed, warm_up,
                                     write_json)


@dataclass(frozen=True)
class EvalOptions:
    drafters: tuple[str, ...]  # export directories
    prompts: str = HELDOUT  # "heldout", "heldout:NAME" (one source of the store's mix) or a data source
    num_prompts: int = 32
    match: str = ""  # regular expression the prompt's text must match ("" = any)
    exclude: str = ""  # regular expression the prompt's text must not match ("" = none)
    max_new_tokens: int = 256
    temperature: float = 0.0
    seed: int = 0
    device: str = "auto"
    out: str = ""  # JSON path
    plot: str = ""  # PNG path


def run(config: Config, options: EvalOptions) -> list[EvalResult]:
    for path in options.drafters:
        check_drafter_export(path)
    device = resolve_device(options.device)
    dtype = target_dtype(config.target.dtype, device)
    checkpoint = prepare_checkpoint(config.target.path, config.data.cache_dir)
    tokenizer = load_target_tokenizer(checkpoint, config.target.chat_template)
    target = load_causal_lm(str(checkpoint), dtype, device)
    drafts = [load_drafter(path, target, dtype, device) for path in options.drafters]
    prompts = load_prompts(config, options.prompts, options.num_prompts, tokenizer, options.match, options.exclude)
    source = options.prompts + "".join(f" ({flag} {pattern!r})" for flag, pattern in
                                       (("--match", options.match), ("--exclude", options.exclude)) if pattern)
    results = [EvalResult(drafter=path, target=config.target.path, prompts_source=source, device=str(device),
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
            result.per_prompt.append(mark_code(decode_prompt(draft, target, prompt_id, input_ids, baseline,
                                                             options.max_new_tokens, options.temperature, stops,
                                                             generator, device), tokenizer))
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
