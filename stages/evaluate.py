"""`dflash eval`: the served acceptance of an exported drafter, by real speculative decoding.

`run(config, options)` loads the target (`target.path`: a checkpoint directory, a GGUF file or
the embedded tiny target) and one or more exports, takes prompts (the held-out split of the
config's store, or any data source), and for each prompt decodes plainly once (greedy, the
baseline) and then speculatively with each drafter through `dflash.modeling_dflash` (the class
and loop an export serves). Several drafters (checkpoints of one run, or rival runs) share the
prompts and the baseline. For each it reports the acceptance
length tau (tokens committed per verifying target forward), its histogram over 1..B, the
acceptance of each block slot, the wall-clock speedup over the baseline, and, at temperature
0, whether the speculative output equals the baseline token for token.

Prompts end where the answer starts: a held-out sample's tokens before its first supervised
token (the chat template's generation prompt included), or a row's conversation before its
last assistant turn rendered with `add_generation_prompt=True`. Nothing here was trained on:
the held-out split is the one stage two holds out (`train.holdout_fraction`, `train.seed`).
"""

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from dflash import data
from dflash.config import Config, ConfigError
from dflash.data import row_label
from dflash.modeling_dflash import DFlashDraftModel, greedy_generate, speculative_generate
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


@dataclass
class PromptResult:
    prompt_id: str  # "sample <i> (row <r>)" or "row <r>"
    prompt_tokens: int
    generated_tokens: int
    acceptance_lengths: list[int]
    target_forwards: int
    spec_seconds: float
    baseline_tokens: int = 0
    baseline_seconds: float = 0.0
    first_mismatch: int | None = None  # index into the generated tokens; None when identical


@dataclass
class EvalResult:
    drafter: str
    target: str
    prompts_source: str
    device: str
    dtype: str
    block_size: int
    temperature: float
    max_new_tokens: int
    num_prompts: int = 0
    generated_tokens: int = 0
    verifications: int = 0
    tau: float = 0.0
    histogram: list[int] = field(default_factory=list)  # index k-1: verifications that committed k tokens
    slot_acceptance: list[float] = field(default_factory=list)  # slot k (1..B-1): fraction accepting it
    spec_tokens_per_s: float = 0.0
    baseline_tokens_per_s: float = 0.0
    speedup: float = 0.0
    mismatched_prompts: int = 0
    per_prompt: list[PromptResult] = field(default_factory=list)


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
    warm_up(drafts[0], target, prompts[0][1], stops, device)
    bar = tqdm(prompts, unit="prompt", desc="eval", dynamic_ncols=True)
    for prompt_id, prompt_ids in bar:
        input_ids = torch.as_tensor(prompt_ids, dtype=torch.long, device=device)[None]
        baseline = timed(device, lambda: greedy_generate(target, input_ids, options.max_new_tokens, stops))
        for draft, result in zip(drafts, results):
            result.per_prompt.append(decode_prompt(draft, target, prompt_id, input_ids, baseline, options, stops,
                                                   generator, device))
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


# ----------------------------------------------------------------------------- decoding


def timed(device: torch.device, fn):
    """`(fn(), seconds)`; on CUDA the queue is drained before and after."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # sync: timing only, outside the decoding loops
    start = time.perf_counter()
    value = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # sync: timing only
    return value, time.perf_counter() - start


def warm_up(draft, target, prompt_ids: np.ndarray, stops, device: torch.device) -> None:
    """One short untimed run of both loops, so kernel selection and allocator growth are not timed."""
    input_ids = torch.as_tensor(prompt_ids[-64:], device=device)[None]
    greedy_generate(target, input_ids, 8, stops)
    speculative_generate(draft, target, input_ids, 2 * draft.block_size, stops, 0.0)


def decode_prompt(draft, target, prompt_id, input_ids, baseline, options: EvalOptions, stops, generator, device):
    """Speculative decoding of one prompt, compared with the baseline `(tokens, seconds)`."""
    spec, spec_seconds = timed(device, lambda: speculative_generate(
        draft, target, input_ids, options.max_new_tokens, stops, options.temperature, generator))
    baseline_tokens, baseline_seconds = baseline
    result = PromptResult(prompt_id=prompt_id, prompt_tokens=input_ids.shape[1], generated_tokens=len(spec.generated),
                          acceptance_lengths=spec.acceptance_lengths, target_forwards=spec.target_forwards,
                          spec_seconds=spec_seconds, baseline_tokens=len(baseline_tokens),
                          baseline_seconds=baseline_seconds)
    if options.temperature <= 0 and spec.generated != baseline_tokens:
        result.first_mismatch = next((i for i, (a, b) in enumerate(zip(spec.generated, baseline_tokens)) if a != b),
                                     min(len(spec.generated), len(baseline_tokens)))
    return result


# ----------------------------------------------------------------------------- reporting


def summarize(result: EvalResult) -> EvalResult:
    lengths = [length for prompt in result.per_prompt for length in prompt.acceptance_lengths]
    block = result.block_size
    result.num_prompts = len(result.per_prompt)
    result.generated_tokens = sum(prompt.generated_tokens for prompt in result.per_prompt)
    result.verifications = len(lengths)
    result.tau = float(np.mean(lengths)) if lengths else 0.0
    counts = np.bincount(np.asarray(lengths, dtype=np.int64), minlength=block + 1)
    result.histogram = counts[1:block + 1].tolist()
    result.slot_acceptance = [float(np.mean(np.asarray(lengths) > slot)) if lengths else 0.0
                              for slot in range(1, block)]
    spec_seconds = sum(prompt.spec_seconds for prompt in result.per_prompt)
    baseline_seconds = sum(prompt.baseline_seconds for prompt in result.per_prompt)
    baseline_tokens = sum(prompt.baseline_tokens for prompt in result.per_prompt)
    result.spec_tokens_per_s = result.generated_tokens / spec_seconds if spec_seconds else 0.0
    result.baseline_tokens_per_s = baseline_tokens / baseline_seconds if baseline_seconds else 0.0
    result.speedup = result.spec_tokens_per_s / result.baseline_tokens_per_s if result.baseline_tokens_per_s else 0.0
    result.mismatched_prompts = sum(prompt.first_mismatch is not None for prompt in result.per_prompt)
    return result


def print_report(results: list[EvalResult]) -> None:
    first = results[0]
    print(f"\ndflash eval: target {first.target}, {first.device} {first.dtype}, temperature {first.temperature:g}, "
          f"up to {first.max_new_tokens} new tokens, {first.num_prompts} prompts ({first.prompts_source})")
    print("| drafter | generated tokens | verifications | tau | spec tokens/s | greedy tokens/s | speedup | lossless |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for result in results:
        lossless = "n/a (sampling)" if result.temperature > 0 else \
            "yes" if result.mismatched_prompts == 0 else f"NO: {result.mismatched_prompts} prompts differ"
        print(f"| {result.drafter} | {result.generated_tokens:,} | {result.verifications:,} | {result.tau:.3f} | "
              f"{result.spec_tokens_per_s:,.1f} | {result.baseline_tokens_per_s:,.1f} | {result.speedup:.2f}x | "
              f"{lossless} |")
    for result in results:
        total = max(result.verifications, 1)
        print(f"{result.drafter}:\n  tokens committed per verification (1..B): "
              + " ".join(f"{k}:{count / total:.1%}" for k, count in enumerate(result.histogram, start=1) if count))
        print("  slot acceptance (slot 1..B-1): " + " ".join(f"{value:.2f}" for value in result.slot_acceptance))
        if result.temperature > 0:
            print("  lossless check: not applicable at temperature > 0 (sampled outputs differ by design)")
        elif result.mismatched_prompts == 0:
            print(f"  lossless: speculative output equals plain greedy output on all {result.num_prompts} prompts")
        else:
            print(f"  MISMATCH: {result.mismatched_prompts} of {result.num_prompts} prompts differ from plain greedy:")
            for prompt in result.per_prompt:
                if prompt.first_mismatch is not None:
                    print(f"    {prompt.prompt_id}: first differing generated token {prompt.first_mismatch}")
    if first.device == "cpu":
        print("(speedup on the CPU is not the served speedup: measure it on the GPU the target serves on)")


def write_json(results: list[EvalResult], path: str) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps({"results": [asdict(result) for result in results]}, indent=1) + "\n")
    print(f"wrote {path}")


def plot(results: list[EvalResult], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    block = results[0].block_size
    width = 0.8 / len(results)
    for index, result in enumerate(results):
        label = f"{Path(result.drafter).name or result.drafter}: tau {result.tau:.2f}"
        fractions = [count / max(result.verifications, 1) for count in result.histogram]
        left.bar([k + (index - (len(results) - 1) / 2) * width for k in range(1, block + 1)], fractions, width,
                 label=label)
        right.plot(range(1, block), result.slot_acceptance, marker="o", label=label)
    left.set(xlabel="tokens committed per target forward", ylabel="fraction of verifications",
             title="acceptance length", xticks=list(range(1, block + 1)))
    right.set(xlabel="block slot", ylabel="fraction of blocks accepting it", ylim=(0, 1),
              title="per-slot acceptance", xticks=list(range(1, block)))
    right.legend(fontsize="small")
    figure.suptitle(f"dflash eval: {results[0].num_prompts} prompts, up to {results[0].max_new_tokens} new tokens")
    figure.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)
    print(f"wrote {path}")
