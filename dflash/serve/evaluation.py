"""Served acceptance, measured: one prompt decoded plainly (greedy, or sampled at temperature > 0:
the baseline) and then speculatively by each drafter, and at temperature > 0 by each proposal policy,
through `dflash.model.modeling_dflash` (the class and loop an export serves), the results per prompt
and per drafter and policy, the report, its JSON and its plot. The engine
of `dflash eval` (stages/evaluate.py) and of tools/compare_reference.py, with the drafters it
loads (checked against the target) and the prompts it decodes.

Lossless at temperature 0 means the speculative output is greedy decoding: every token the target's
most likely one after the prompt and the tokens before it, read from one target forward over the
prompt and the output (`greedy_check`; a second, plain decoding would cost a forward per token, so
only the prompts timed for the speedup decode plainly). In bf16 a block verification and a
one-token step can round a near-tie the other way, so the first token that is not the largest
logit is measured by its gap to it: within a few rounding steps of the dtype at that logit size
(`TIE_ULPS` x eps x |top logit|) it is a near-tie of the arithmetic, not a drafting error, and is
reported as such; a wider gap is a mismatch.
"""

import importlib.util
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from dflash.config import Config, ConfigError
from dflash.data import chat, samples
from dflash.data.chat import row_label
from dflash.data.tokenizer import tokenizer_identity
from dflash.extract.target import find_decoder_layers
from dflash.model import modeling_dflash
from dflash.model.export import CONFIG_NAME, WEIGHTS_NAME
from dflash.model.modeling_dflash import DFlashDraftModel, Proposal, plain_generate, speculative_generate
from dflash.outputs import write_text_atomic

HELDOUT = "heldout"  # --prompts: the samples stage two holds out of the config's store ("heldout:NAME": one source's)
TIE_ULPS = 4  # a logit gap within this many rounding steps of the dtype is a near-tie
# an eval's timing: its timed prompts' times taken as they were served (INLINE), not yet (DEFERRED: `dflash eval
# --defer-timing`), or from decoding them again in one process alone on the device once the rest was served
# (ALONE: `dflash time-evals`, `--workers`)
INLINE, DEFERRED, ALONE = "inline", "deferred", "alone"
CODE_FENCE = "```"  # the served text's code blocks: tau inside them and outside (prose) is reported apart


class EvalPrompt(NamedTuple):
    label: str  # "sample <i> (row <r>)" or "row <r>"
    ids: np.ndarray  # the prompt's tokens, up to where the answer starts
    kind: str = ""  # the row's `kind` field (e.g. "writing", "code"), "" when it has none


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
    first_mismatch: int | None = None  # T=0: the first generated token that is not greedy decoding's; None: none
    mismatch_gap: float | None = None  # the target's largest logit there minus that token's (None: a stop missed)
    tie_tolerance: float | None = None  # the largest gap that is a rounding near-tie at that point
    near_tie: bool = False  # the output leaves greedy decoding only where the target's top two tokens tie
    generated_ids: list[int] = field(default_factory=list)  # the speculative output's tokens
    text: str = ""  # ... decoded
    in_code: list[bool] = field(default_factory=list)  # per verification: its first token lies in a ``` block
    kind: str = ""  # the prompt row's `kind`, if it has one
    timed: bool = True  # its times count toward the speed figures (`--timed-prompts N`: N spread over the set)
    # the machine's CPUs while it was timed (`HostLoad`, from /proc/stat; None where unreadable or untimed): the
    # share of all cores' time spent working (this process included) and the share a hypervisor stole
    spec_host_busy: float | None = None
    spec_host_steal: float | None = None
    baseline_host_busy: float | None = None
    baseline_host_steal: float | None = None


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
    proposal: str = "sample"  # how blocks were drafted at temperature > 0 (modeling_dflash.Proposal)
    drafter_graphs: bool = False  # the drafter's block replayed as a CUDA graph (modeling_dflash.BlockGraph)
    target_graphs: bool = False  # the target over a static cache, its forwards as CUDA graphs (target_graphs.py)
    cpu_threads: int = 0  # torch's operator threads in the serving process (a worker's: its share, docs/eval.md)
    num_prompts: int = 0
    generated_tokens: int = 0
    verifications: int = 0
    tau: float = 0.0
    histogram: list[int] = field(default_factory=list)  # index k-1: verifications that committed k tokens
    slot_acceptance: list[float] = field(default_factory=list)  # slot k (1..B-1): fraction accepting it
    spec_tokens_per_s: float = 0.0
    baseline_tokens_per_s: float = 0.0
    speedup: float = 0.0
    timed_prompts: int = 0  # the prompts whose times make the three figures above
    ms_per_verification: float = 0.0  # over those prompts: a speculative step's wall time (prefill included)
    baseline_ms_per_token: float = 0.0  # ... and a plain decoding token's
    timing: str = INLINE  # INLINE, DEFERRED or ALONE: when and how those prompts were timed
    retimed_differing: int = 0  # ALONE: timed decodes whose tokens differ from the untimed ones (device nondeterminism)
    mismatched_prompts: int = 0  # near-ties included
    near_tie_prompts: int = 0
    tau_in_code: float = 0.0  # verifications whose first token lies inside a ``` code block of the output
    verifications_in_code: int = 0
    tau_outside_code: float = 0.0  # ... outside every code block (prose)
    verifications_outside_code: int = 0
    tau_by_kind: dict[str, float] = field(default_factory=dict)  # per prompt `kind`, when the rows carry one
    per_prompt: list[PromptResult] = field(default_factory=list)


def use_verdict_kernel(on: bool = True) -> bool:
    """The serving loop's sampled-tree verdicts on CUDA through dflash's Triton kernel (dflash/model/verdict_kernel.py:
    on an H100 0.74 ms a `stree:256x32` call against the tensor tries' 2.61, the same verdicts) where Triton is
    installed and `on`, else the tensor loop; returns whether the kernel serves."""
    kernel = None
    if on and importlib.util.find_spec("triton") is not None:
        from dflash.model.verdict_kernel import verdict_tries

        kernel = verdict_tries
    modeling_dflash.VERDICT_KERNEL = kernel
    return kernel is not None


def check_drafter_export(export_dir: str) -> None:
    """Refuse a --drafter that is not an export before anything slow (the target) is loaded."""
    missing = [name for name in (CONFIG_NAME, WEIGHTS_NAME) if not (Path(export_dir) / name).is_file()]
    if missing:
        what = (f"is not a drafter export (no {' or '.join(missing)})" if Path(export_dir).exists()
                else "does not exist")
        raise FileNotFoundError(f"--drafter {export_dir} {what}; make one with `dflash export CHECKPOINT DIR`")


def load_drafter(export_dir: str, target, dtype: torch.dtype, device: torch.device) -> DFlashDraftModel:
    """The export as served, checked against the target it drafts for."""
    check_drafter_export(export_dir)
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


def load_prompts(config: Config, source: str, num_prompts: int, tokenizer, match: str = "",
                 exclude: str = "") -> list[EvalPrompt]:
    """`EvalPrompt(label, token ids, kind)` of the first `num_prompts` prompts: the store's held-out
    samples (`source` "heldout", or "heldout:NAME": those of the mix's source NAME) or the rows of a
    data source; with `match` / `exclude` (regular expressions), only prompts whose rendered text
    matches / does not match them."""
    if num_prompts < 1:
        raise ConfigError(f"--num-prompts must be positive, got {num_prompts}")
    keep = prompt_filter(tokenizer, match, exclude)
    if source == HELDOUT or source.startswith(HELDOUT + ":"):
        prompts = heldout_prompts(config, tokenizer, num_prompts, keep, source.partition(":")[2])
    else:
        prompts = source_prompts(source, config.data.split, tokenizer, num_prompts, keep)
    if not prompts:
        raise ValueError(f"--prompts {source}: no usable prompt" + (" matches --match / --exclude" if keep else ""))
    if len(prompts) < num_prompts and keep:
        print(f"prompts: only {len(prompts)} of {source} pass --match / --exclude (asked for {num_prompts})")
    return prompts


def prompt_filter(tokenizer, match: str, exclude: str):
    """None (every prompt), or a predicate on token ids: the decoded text matches `match` and not `exclude`."""
    if not match and not exclude:
        return None
    import re

    try:
        wanted, unwanted = (re.compile(pattern) if pattern else None for pattern in (match, exclude))
    except re.error as error:
        raise ConfigError(f"--match / --exclude: not a regular expression: {error}") from None

    def keep(ids: np.ndarray) -> bool:
        text = tokenizer.decode(ids.tolist())
        return (wanted is None or bool(wanted.search(text))) and (unwanted is None or not unwanted.search(text))
    return keep


def heldout_prompts(config: Config, tokenizer, num_prompts: int, keep=None,
                    source: str = "") -> list[EvalPrompt]:
    """Prompts of the samples stage two holds out of training (same store, fraction, seed and
    `train.holdout_by`: `dflash.train.mix.held_out_split`), each prompt once, in the split's order
    (those `keep` accepts); with `source`, only those of that source of the store's mix."""
    from dflash.store.reader import StoreReader
    from dflash.train.mix import held_out_split, source_number
    from dflash.train.sampler import holdout_groups

    reader = StoreReader(config.store.path)
    stored = reader.attrs["tokenizer"]["hash"]
    if stored != tokenizer_identity(tokenizer)["hash"]:
        raise ValueError(f"store {config.store.path} was tokenized with another tokenizer or chat template than "
                         f"target {config.target.path} has now; its prompts would not be what the target reads")
    groups = holdout_groups(config, reader)
    _, eval_indices = held_out_split(config, reader, groups)
    if source:
        eval_indices = eval_indices[reader.sample_source[eval_indices] == source_number(reader, source)]
    if groups is not None:  # one prompt per held-out prompt group: its several answers share the prompt
        _, first = np.unique(groups[eval_indices], return_index=True)
        eval_indices = eval_indices[np.sort(first)]
    if not eval_indices.size:
        raise ConfigError("--prompts heldout: train.holdout_fraction is 0, so no sample was held out; "
                          "pass --prompts SOURCE")
    prompts = []
    for index in eval_indices:
        if len(prompts) == num_prompts:
            break
        sample = reader.read_sample(int(index))
        first_answer = int(np.argmax(sample["loss_mask"]))
        if first_answer > 0 and (keep is None or keep(sample["input_ids"][:first_answer])):
            prompts.append(EvalPrompt(f"{reader.sample_label(int(index))} (sample {int(index)})",
                                      sample["input_ids"][:first_answer]))
    return prompts


def source_prompts(source: str, split: str, tokenizer, num_prompts: int, keep=None) -> list[EvalPrompt]:
    """The first `num_prompts` usable rows of a data source (those `keep` accepts), rendered up to
    their last answer, with the row's `kind` if it has one."""
    prompts, skipped = [], 0
    for row_id, row in chat.read_rows(source, split):
        try:
            messages = chat.prompt_messages(row)
        except chat.RowProblem:
            skipped += 1
            continue
        ids = np.asarray(samples.prompt_token_ids(messages, tokenizer), dtype=np.int64)
        if keep is not None and not keep(ids):
            continue
        kind = row.get("kind") if isinstance(row, dict) else None
        prompts.append(EvalPrompt(row_label(row_id), ids, str(kind or "")))
        if len(prompts) == num_prompts:
            break
    if skipped:
        print(f"prompts: skipped {skipped} row(s) of {source} with no usable conversation")
    return prompts


# ----------------------------------------------------------------------------- decoding


class HostLoad(NamedTuple):
    """The machine's CPUs over an interval, from /proc/stat: `busy`, the share of all cores' time spent working
    (user, system and interrupts; every process's, this one's too), and `steal`, the share a hypervisor gave to
    other machines. A timed prompt with a busy or stolen host times the host, not the decoding (12-06: plain
    decoding of one prompt ran 19-44 ms a token in turns alone, though the host was 6% busy then: other
    processes on the GPU, `time_alone`)."""
    busy: float
    steal: float


def host_ticks() -> list[int] | None:
    """The aggregate CPU line of /proc/stat (user nice system idle iowait irq softirq steal), in clock ticks;
    None where there is none (not Linux)."""
    try:
        with open("/proc/stat") as stat:
            fields = stat.readline().split()
    except OSError:
        return None
    if len(fields) < 5 or fields[0] != "cpu":
        return None
    ticks = [int(value) for value in fields[1:9]]
    return ticks + [0] * (8 - len(ticks))  # an old kernel's line lacks the later fields


def host_load(before: list[int] | None, after: list[int] | None) -> HostLoad | None:
    """`HostLoad` between two `host_ticks()` readings (None when either is missing or no tick passed)."""
    if before is None or after is None:
        return None
    user, nice, system, idle, iowait, irq, softirq, steal = (b - a for a, b in zip(before, after))
    total = user + nice + system + idle + iowait + irq + softirq + steal
    if total <= 0:
        return None
    return HostLoad(busy=(user + nice + system + irq + softirq) / total, steal=steal / total)


class Timed(NamedTuple):
    value: object
    seconds: float
    host: HostLoad | None  # the machine's CPUs meanwhile


def timed(device: torch.device, fn) -> Timed:
    """`(fn(), seconds, host load)`; on CUDA the queue is drained before and after."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # sync: timing only, outside the decoding loops
    ticks = host_ticks()
    start = time.perf_counter()
    value = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # sync: timing only
    seconds = time.perf_counter() - start
    return Timed(value, seconds, host_load(ticks, host_ticks()))


def warm_up(drafts, target, prompt_ids: np.ndarray, max_new_tokens: int, stops, device: torch.device,
            proposals=(Proposal(sample=True),), graphs: bool | None = None, temperature: float = 0.0,
            session_for=lambda draft: None) -> None:
    """On CUDA, one untimed run of the first prompt by the baseline and every drafter with every
    proposal policy at the served temperature (a tree's verification has its own shapes and mask; above 0 a
    sampled tree's verdicts are captured per shape), so that kernel selection, lazy module loading, graph
    captures and allocator growth are timed by none of them (CPU timings are not served speedups anyway, and the
    CPU decodes slowly: no warm-up there). Its draws come from a stream of its own. `session_for(draft)`: the target's
    session for a drafter (None: transformers' forward; `session_for(None)` the plain decoding's)."""
    if device.type != "cuda":
        return
    input_ids = torch.as_tensor(prompt_ids, device=device)[None]
    generator = torch.Generator(device=device).manual_seed(0) if temperature > 0 else None
    plain_generate(target, input_ids, max_new_tokens, stops, temperature, generator, session_for(None))
    # at temperature 0 one chain stands for every chain policy, and each tree size for its kinds
    shapes = list(proposals) if temperature > 0 else list({p.greedy_key(): p for p in proposals}.values())
    for draft in drafts:
        for proposal in shapes:
            speculative_generate(draft, target, input_ids, max_new_tokens, stops, temperature, generator, proposal,
                                 graphs, session=session_for(draft))


def decode_prompt(draft, target, prompt_id: str, input_ids: torch.Tensor, baseline, max_new_tokens: int,
                  temperature: float, stops, generator, device: torch.device,
                  proposal: Proposal = Proposal(sample=True), graphs: bool | None = None,
                  checks: dict | None = None, session=None) -> PromptResult:
    """Speculative decoding of one prompt (blocks drafted by `proposal` at temperature > 0); `baseline`: the
    plain decoding's `Timed` (tokens, seconds, host load: the speed figure; None for a prompt not timed). At temperature
    0 the output is checked against the target's greedy choice at every position (`greedy_check`), once per
    distinct output where the policies of one prompt share `checks`; `graphs`: as `speculative_generate`'s
    (None: a CUDA graph on CUDA); `session`: the target's (`speculative_generate`'s; None: transformers' forward)."""
    spec, spec_seconds, spec_host = timed(device, lambda: speculative_generate(
        draft, target, input_ids, max_new_tokens, stops, temperature, generator, proposal, graphs, session=session))
    baseline_tokens, baseline_seconds, baseline_host = baseline or ([], 0.0, None)
    result = PromptResult(prompt_id=prompt_id, prompt_tokens=input_ids.shape[1], generated_tokens=len(spec.generated),
                          acceptance_lengths=spec.acceptance_lengths, target_forwards=spec.target_forwards,
                          spec_seconds=spec_seconds, baseline_tokens=len(baseline_tokens),
                          baseline_seconds=baseline_seconds, generated_ids=list(spec.generated))
    if baseline is not None:  # a timed prompt
        result.spec_host_busy, result.spec_host_steal = spec_host or (None, None)
        result.baseline_host_busy, result.baseline_host_steal = baseline_host or (None, None)
    if temperature <= 0:
        checks = {} if checks is None else checks
        output = tuple(spec.generated)
        if output not in checks:
            checks[output] = greedy_check(target, input_ids, spec.generated, stops, max_new_tokens)
        result.first_mismatch, result.mismatch_gap, result.tie_tolerance = checks[output]
        result.near_tie = result.mismatch_gap is not None and abs(result.mismatch_gap) <= result.tie_tolerance
    return result


@torch.inference_mode()
def greedy_check(target, input_ids: torch.Tensor, generated: list[int], stops, max_new_tokens: int
                 ) -> tuple[int | None, float | None, float | None]:
    """Whether `generated` is what greedy decoding of the prompt gives, from one target forward over the prompt
    and the output (not a second decoding, which costs a forward per token): `(None, None, None)` when every
    token is the target's most likely one there, it ends at a stop token or at `max_new_tokens` and holds no
    stop before its end; else `(index, gap, tolerance)` of the first token that is not: the target's largest
    logit there minus that token's (None where the output ends early or runs past a stop) and the largest gap
    that is a rounding near-tie of the target's dtype."""
    stops = set(stops)
    early_stop = next((i for i, token in enumerate(generated[:-1]) if token in stops), None)
    if generated:
        context = torch.cat([input_ids, torch.tensor([generated[:-1]], dtype=torch.long, device=input_ids.device)], 1)
        logits = target(input_ids=context, logits_to_keep=len(generated)).logits[0]
        chosen = torch.tensor(generated, device=logits.device)
        wrong = (logits.argmax(-1) != chosen) & (logits.gather(1, chosen[:, None])[:, 0] < logits.max(-1).values)
        first = int(wrong.nonzero()[0, 0]) if bool(wrong.any()) else None
        if first is not None and (early_stop is None or first <= early_stop):
            row = logits[first]
            return first, float(row.max().float() - row[generated[first]].float()), tie_tolerance(row)
    if early_stop is not None:
        return early_stop, None, None
    if len(generated) < max_new_tokens and (not generated or generated[-1] not in stops):
        return len(generated), None, None
    return None, None, None


def tie_tolerance(logits: torch.Tensor) -> float:
    """The largest logit gap that is a rounding near-tie: `TIE_ULPS` rounding steps of the logits'
    dtype at the size of the largest logit."""
    return TIE_ULPS * torch.finfo(logits.dtype).eps * max(float(logits.float().abs().max()), 1.0)


def mark_code(prompt: PromptResult, tokenizer) -> PromptResult:
    """Fill the prompt's `text` and, per verification, whether its first committed token lies inside
    a ``` code block (an odd number of fences in the text before it)."""
    ids = prompt.generated_ids
    prompt.text = tokenizer.decode(ids)
    starts = np.cumsum([0] + prompt.acceptance_lengths[:-1]).tolist()
    prompt.in_code = [tokenizer.decode(ids[:start]).count(CODE_FENCE) % 2 == 1 for start in starts]
    return prompt


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
    timed_prompts = [prompt for prompt in result.per_prompt if prompt.timed]
    result.timed_prompts = len(timed_prompts)
    spec_seconds = sum(prompt.spec_seconds for prompt in timed_prompts)
    spec_tokens = sum(prompt.generated_tokens for prompt in timed_prompts)
    baseline_seconds = sum(prompt.baseline_seconds for prompt in timed_prompts)
    baseline_tokens = sum(prompt.baseline_tokens for prompt in timed_prompts)
    result.spec_tokens_per_s = spec_tokens / spec_seconds if spec_seconds else 0.0
    result.baseline_tokens_per_s = baseline_tokens / baseline_seconds if baseline_seconds else 0.0
    result.speedup = result.spec_tokens_per_s / result.baseline_tokens_per_s if result.baseline_tokens_per_s else 0.0
    forwards = sum(prompt.target_forwards for prompt in timed_prompts)
    result.ms_per_verification = 1e3 * spec_seconds / forwards if forwards else 0.0
    result.baseline_ms_per_token = 1e3 * baseline_seconds / baseline_tokens if baseline_tokens else 0.0
    result.mismatched_prompts = sum(prompt.first_mismatch is not None for prompt in result.per_prompt)
    result.near_tie_prompts = sum(prompt.near_tie for prompt in result.per_prompt)
    marked = [(length, code) for prompt in result.per_prompt if len(prompt.in_code) == len(prompt.acceptance_lengths)
              for length, code in zip(prompt.acceptance_lengths, prompt.in_code)]
    inside = [length for length, code in marked if code]
    outside = [length for length, code in marked if not code]
    result.verifications_in_code, result.verifications_outside_code = len(inside), len(outside)
    result.tau_in_code = float(np.mean(inside)) if inside else 0.0
    result.tau_outside_code = float(np.mean(outside)) if outside else 0.0
    kinds = sorted({prompt.kind for prompt in result.per_prompt if prompt.kind})
    result.tau_by_kind = {kind: float(np.mean([length for prompt in result.per_prompt if prompt.kind == kind
                                               for length in prompt.acceptance_lengths] or [0.0]))
                          for kind in kinds}
    return result


def print_report(results: list[EvalResult]) -> None:
    first = results[0]
    threads = f", {first.cpu_threads} CPU thread{'s' if first.cpu_threads != 1 else ''}" if first.cpu_threads else ""
    print(f"\ndflash eval: target {first.target}, {first.device} {first.dtype}{threads}, "
          f"temperature {first.temperature:g}, "
          f"up to {first.max_new_tokens} new tokens, {first.num_prompts} prompts ({first.prompts_source})"
          + (", the drafter's block as a CUDA graph" if first.drafter_graphs else "")
          + (", the target's forwards as CUDA graphs (static cache)" if first.target_graphs else ""))
    plain = "greedy" if first.temperature <= 0 else "sampled"
    print(f"| drafter | proposal | generated tokens | verifications | tau | spec tokens/s | {plain} tokens/s | speedup "
          "| lossless |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for result in results:
        lossless = lossless_verdict(result)
        print(f"| {result.drafter} | {result.proposal} | {result.generated_tokens:,} | {result.verifications:,} | "
              f"{result.tau:.3f} | "
              f"{result.spec_tokens_per_s:,.1f} | {result.baseline_tokens_per_s:,.1f} | {result.speedup:.2f}x | "
              f"{lossless} |")
    for result in results:
        total = max(result.verifications, 1)
        print(f"{result.drafter} ({result.proposal} proposals):\n  tokens committed per verification (1..B): "
              + " ".join(f"{k}:{count / total:.1%}" for k, count in enumerate(result.histogram, start=1) if count))
        print("  slot acceptance (slot 1..B-1): " + " ".join(f"{value:.2f}" for value in result.slot_acceptance))
        if result.verifications_in_code:
            print(f"  by text: inside {CODE_FENCE} code blocks tau {result.tau_in_code:.3f} over "
                  f"{result.verifications_in_code:,} verifications, outside them {result.tau_outside_code:.3f} over "
                  f"{result.verifications_outside_code:,}")
        if result.tau_by_kind:
            print("  tau by prompt kind: " + ", ".join(f"{kind} {tau:.3f}" for kind, tau in result.tau_by_kind.items()))
        if result.temperature > 0:
            print("  lossless check: not applicable at temperature > 0 (sampled outputs differ by design)")
        elif result.mismatched_prompts == 0:
            print(f"  lossless: every output token is the target's greedy choice, on all {result.num_prompts} prompts")
        else:
            real = result.mismatched_prompts - result.near_tie_prompts
            print(f"  {'MISMATCH' if real else 'near-ties only'}: {result.mismatched_prompts} of {result.num_prompts} "
                  f"prompts leave greedy decoding, {result.near_tie_prompts} of them at a {result.dtype} near-tie "
                  f"(the target's top two tokens within {TIE_ULPS} rounding steps):")
            for prompt in result.per_prompt:
                if prompt.first_mismatch is not None:
                    print(f"    {prompt.prompt_id}: first non-greedy generated token {prompt.first_mismatch}"
                          + mismatch_detail(prompt))
    if first.timing == DEFERRED:
        print(f"(tokens/s and speedup: not yet timed; `dflash time-evals` decodes the timed prompts again, alone on "
              f"the device; tau over all {first.num_prompts})")
    elif first.timing == ALONE:
        differing = sum(result.retimed_differing for result in results)
        print(f"(tokens/s and speedup over {first.timed_prompts} prompt(s) spread over the set, decoded again in one "
              f"process alone on the device once every prompt was served; tau over all {first.num_prompts}"
              + (f"; {differing} timed decode(s) differ from the untimed ones, nondeterminism of the device: their "
                 "timed decodes are the ones kept" if differing else "") + ")")
    elif first.timed_prompts < first.num_prompts:
        print(f"(tokens/s and speedup over {first.timed_prompts} prompt(s) spread over the set; tau over all "
              f"{first.num_prompts})")
    steps = [result for result in results if result.ms_per_verification]
    if steps:
        print("(timed: " + ", ".join(f"{result.proposal} {result.ms_per_verification:.1f} ms a verification"
                                     for result in steps)
              + f"; plain decoding {first.baseline_ms_per_token:.1f} ms a token)")
    loads = [load for result in results for prompt in result.per_prompt if prompt.timed for load in
             ((prompt.spec_host_busy, prompt.spec_host_steal), (prompt.baseline_host_busy, prompt.baseline_host_steal))
             if load[0] is not None]
    if loads:
        print(f"(the host's CPUs while timed: {max(busy for busy, _ in loads):.0%} busy at most, "
              f"{np.mean([busy for busy, _ in loads]):.0%} on average; {max(steal for _, steal in loads):.1%} stolen "
              f"at most)")
    if first.device == "cpu":
        print("(speedup on the CPU is not the served speedup: measure it on the GPU the target serves on)")


def lossless_verdict(result: EvalResult) -> str:
    if result.temperature > 0:
        return "n/a (sampling)"
    if result.mismatched_prompts == 0:
        return "yes"
    if result.mismatched_prompts == result.near_tie_prompts:
        return f"yes up to {result.dtype} near-ties ({result.near_tie_prompts} prompts)"
    return (f"NO: {result.mismatched_prompts - result.near_tie_prompts} prompts differ"
            + (f" (+{result.near_tie_prompts} near-ties)" if result.near_tie_prompts else ""))


def mismatch_detail(prompt: PromptResult) -> str:
    if prompt.mismatch_gap is None:
        return " (the output ends early, or runs on past a stop token)"
    kind = "near-tie" if prompt.near_tie else "NOT a near-tie"
    return f"; target logit gap {prompt.mismatch_gap:+.4f}, tolerance {prompt.tie_tolerance:.4f}: {kind}"


def result_from_json(result: dict) -> EvalResult:
    """An `EvalResult` as `write_json` wrote it."""
    return EvalResult(**{**result, "per_prompt": [PromptResult(**prompt) for prompt in result["per_prompt"]]})


def write_json(results: list[EvalResult], path: str, options: dict | None = None) -> None:
    """The results, and the options that served them (what `dflash time-evals` decodes again)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    written = {"results": [asdict(result) for result in results], **({"options": options} if options else {})}
    write_text_atomic(Path(path), json.dumps(written, indent=1) + "\n")
    print(f"wrote {path}")


PARTIAL_SUFFIX = ".partial.jsonl"  # beside --out: each prompt's results as it ends


class PartialResults:
    """Each prompt's results, one JSON line as it ends, in `OUT.partial.jsonl`: a killed eval loses at most the
    prompt in hand. The first line names the run (`identity`: the options that decide the outputs and each drafter's
    weights file, by path, size and modification time); a rerun whose identity is the same continues from the
    prompts written (every random stream restarts at each prompt from the seed plus its index, so the rest decode
    as they would have), any other starts over. A line cut by a kill is dropped. Removed once the JSON is written."""

    def __init__(self, out: str, identity: dict):
        self.path = Path(out + PARTIAL_SUFFIX) if out else None
        self.identity = identity
        self.stream = None

    def load(self) -> dict[int, list[PromptResult]]:
        """The prompts already served by a run of this identity (by prompt index); the file rewritten with them."""
        done = {}
        if self.path is not None and self.path.exists():
            lines = self.path.read_text().splitlines()
            try:
                same = bool(lines) and json.loads(lines[0]) == {"identity": self.identity}
            except json.JSONDecodeError:
                same = False
            for line in lines[1:] if same else []:
                try:
                    row = json.loads(line)
                    done[row["index"]] = [PromptResult(**decoded) for decoded in row["decoded"]]
                except (json.JSONDecodeError, KeyError, TypeError):  # cut by a kill: served again from here
                    break
            print(f"{self.path}: continuing after {len(done)} prompts served" if same else
                  f"{self.path}: written by another run (options or drafters differ): starting over")
        if self.path is not None:  # rewritten whole beside it, then put in its place: a kill loses nothing served
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fresh = self.path.with_name(self.path.name + ".tmp")
            self.stream = fresh.open("w")
            self._write({"identity": self.identity})
            for index, decoded in sorted(done.items()):
                self.add(index, decoded)
            self.stream.close()
            fresh.replace(self.path)
            self.stream = self.path.open("a")
        return done

    def add(self, index: int, decoded: list[PromptResult]) -> None:
        if self.stream is not None:
            self._write({"index": index, "decoded": [asdict(prompt) for prompt in decoded]})

    def _write(self, row: dict) -> None:
        self.stream.write(json.dumps(row) + "\n")
        self.stream.flush()

    def remove(self) -> None:
        if self.stream is not None:
            self.stream.close()
            self.path.unlink(missing_ok=True)


def drafter_identity(export_dir: str) -> list:
    """An export as a partial file names it: its path and its weights file's size and modification time."""
    weights = Path(export_dir) / WEIGHTS_NAME
    stat = weights.stat()
    return [str(Path(export_dir).resolve()), stat.st_size, stat.st_mtime_ns]


def plot(results: list[EvalResult], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    block = results[0].block_size
    width = 0.8 / len(results)
    for index, result in enumerate(results):
        label = f"{Path(result.drafter).name or result.drafter} ({result.proposal}): tau {result.tau:.2f}"
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
