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
mismatches. At temperature > 0 the baseline samples at that temperature, and every proposal policy
listed (`argmax`, `sample`, `sample:F`: how a block's drafts come from the drafter's per-slot
distributions; `tree:N`: N drafts as a tree verified in one forward; docs/eval.md) is served on the
same prompts and baseline; at temperature 0 every chain policy is greedy verification, so the first
of them is served, beside each tree size. Prompt rows with a `kind` field get tau per kind.
The decoding, results and report are `dflash.serve.evaluation`'s.

Prompts end where the answer starts: a held-out sample's tokens before its first supervised
token (the chat template's generation prompt included), or a row's conversation before its
last assistant turn rendered with `add_generation_prompt=True`. Nothing here was trained on:
the held-out split is the one stage two holds out (`train.holdout_fraction`, `train.seed`).
"""

from dataclasses import dataclass

import torch
from tqdm import tqdm

from dflash.config import Config, ConfigError
from dflash.data.tokenizer import load_target_tokenizer
from dflash.dist import resolve_device
from dflash.extract.target import load_causal_lm, prepare_checkpoint, stop_token_ids, target_dtype
from dflash.model.modeling_dflash import Proposal, parse_proposal, plain_generate
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
    proposals: tuple[str, ...] = ("sample",)  # proposal policies, each a result (at T = 0 one chain policy)
    seed: int = 0
    device: str = "auto"
    out: str = ""  # JSON path
    plot: str = ""  # PNG path


def served_proposals(options: EvalOptions) -> list[Proposal]:
    """The policies to serve, parsed (a bad one is a ConfigError naming it). At temperature 0 every chain
    policy (argmax, sample, sample:F) is the same greedy verification, so the first of them stands for all;
    each tree size serves its own tokens' tree and stays."""
    try:
        proposals = list(dict.fromkeys(parse_proposal(text) for text in options.proposals))
    except ValueError as error:
        raise ConfigError(f"--proposal: {error}") from None
    if not proposals:
        raise ConfigError("--proposal: no policy given (argmax, sample, sample:F or tree:N)")
    if options.temperature > 0:
        return proposals
    first_of_key = {}
    for proposal in proposals:
        first_of_key.setdefault(proposal.greedy_key(), proposal)
    served = list(first_of_key.values())
    if len(served) < len(proposals):
        dropped = ", ".join(proposal.name for proposal in proposals if proposal not in served)
        print(f"temperature 0: every chain policy is greedy verification; serving {', '.join(p.name for p in served)} "
              f"(not {dropped})")
    return served


def run(config: Config, options: EvalOptions) -> list[EvalResult]:
    for path in options.drafters:
        check_drafter_export(path)
    proposals = served_proposals(options)
    device = resolve_device(options.device)
    dtype = target_dtype(config.target.dtype, device)
    checkpoint = prepare_checkpoint(config.target.path, config.data.cache_dir)
    tokenizer = load_target_tokenizer(checkpoint, config.target.chat_template)
    target = load_causal_lm(str(checkpoint), dtype, device)
    drafts = [load_drafter(path, target, dtype, device) for path in options.drafters]
    prompts = load_prompts(config, options.prompts, options.num_prompts, tokenizer, options.match, options.exclude)
    source = options.prompts + "".join(f" ({flag} {pattern!r})" for flag, pattern in
                                       (("--match", options.match), ("--exclude", options.exclude)) if pattern)
    # one result, and one random stream, per drafter and policy
    served = [(draft, proposal, torch.Generator(device=device).manual_seed(options.seed))
              for draft in drafts for proposal in proposals]
    results = [EvalResult(drafter=path, target=config.target.path, prompts_source=source, device=str(device),
                          dtype=str(dtype).removeprefix("torch."), block_size=draft.block_size,
                          temperature=options.temperature, max_new_tokens=options.max_new_tokens,
                          proposal=proposal.name)
               for path, draft in zip(options.drafters, drafts) for proposal in proposals]
    stops = stop_token_ids(tokenizer, target)
    baseline_generator = torch.Generator(device=device).manual_seed(options.seed)
    warm_up(drafts, target, prompts[0].ids, options.max_new_tokens, stops, device)
    bar = tqdm(prompts, unit="prompt", desc="eval", dynamic_ncols=True)
    for prompt in bar:
        input_ids = torch.as_tensor(prompt.ids, dtype=torch.long, device=device)[None]
        baseline = timed(device, lambda: plain_generate(target, input_ids, options.max_new_tokens, stops,
                                                        options.temperature, baseline_generator))
        for (draft, proposal, generator), result in zip(served, results):
            decoded = decode_prompt(draft, target, prompt.label, input_ids, baseline, options.max_new_tokens,
                                    options.temperature, stops, generator, device, proposal)
            decoded.kind = prompt.kind
            result.per_prompt.append(mark_code(decoded, tokenizer))
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
