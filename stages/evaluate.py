"""`dflash eval`: the served acceptance of an exported drafter, by real speculative decoding.

`run(config, options)` loads the target (`target.path`: a checkpoint directory, a GGUF file or
the embedded tiny target) and one or more exports, takes prompts (the held-out split of the
config's store, or any data source), and for each prompt decodes plainly once (greedy, the
baseline; with --timed-prompts N only those N prompts, since the baseline is only the speed figure) and
then speculatively with each drafter through `dflash.model.modeling_dflash` (the class
and loop an export serves). Several drafters (checkpoints of one run, or rival runs) share the
prompts and the baseline. For each it reports the acceptance
length tau (tokens committed per verifying target forward), its histogram over 1..B, the
acceptance of each block slot, the wall-clock speedup over the baseline (on CUDA every loop
decodes the first prompt once untimed first), and, at temperature 0, whether every output token is the
target's greedy choice (one target forward over the prompt and the output), telling rounding near-ties of
a bf16 target apart from real mismatches. At temperature > 0 the baseline samples at that temperature, and
every proposal policy listed (`argmax`, `sample`, `sample:F`: how a block's drafts come from the drafter's per-slot
distributions; `tree:N`: N drafts as a tree verified in one forward; docs/eval.md) is served on the
same prompts and baseline; at temperature 0 every chain policy is greedy verification, so the first
of them is served, beside each tree size. Prompt rows with a `kind` field get tau per kind.
The decoding, results and report are `dflash.serve.evaluation`'s.

Prompts end where the answer starts: a held-out sample's tokens before its first supervised
token (the chat template's generation prompt included), or a row's conversation before its
last assistant turn rendered with `add_generation_prompt=True`. Nothing here was trained on:
the held-out split is the one stage two holds out (`train.holdout_fraction`, `train.seed`).
"""

import contextlib
import dataclasses
import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from dflash.config import Config, ConfigError
from dflash.data.tokenizer import load_target_tokenizer
from dflash.dist import resolve_device, share_threads
from dflash.extract.target import load_causal_lm, prepare_checkpoint, stop_token_ids, target_dtype
from dflash.model.modeling_dflash import Proposal, TargetSession, parse_proposal, plain_generate
from dflash.serve.evaluation import (HELDOUT, EvalResult, PartialResults, PromptResult, check_drafter_export,
                                     decode_prompt, drafter_identity, load_drafter, load_prompts, mark_code, plot,
                                     print_report, summarize, timed, warm_up, write_json)
from dflash.serve.turns import DeviceTurns, start_loading


@dataclass(frozen=True)
class EvalOptions:
    drafters: tuple[str, ...]  # export directories
    prompts: str = HELDOUT  # "heldout", "heldout:NAME" (one source of the store's mix) or a data source
    num_prompts: int = 32
    match: str = ""  # regular expression the prompt's text must match ("" = any)
    exclude: str = ""  # regular expression the prompt's text must not match ("" = none)
    max_new_tokens: int = 256
    temperature: float = 0.0
    proposals: tuple[str, ...] = ("auto",)  # proposal policies, each a result (at T = 0 one chain policy)
    seed: int = 0
    device: str = "auto"
    out: str = ""  # JSON path
    plot: str = ""  # PNG path
    workers: int = 1  # processes side by side, each serving a contiguous share of the prompts (`run_sharded`)
    shard: str = ""  # "I/K": this process serves share I of K (a worker of `run_sharded`)
    timed_prompts: int = 0  # > 0: only N prompts' times (spread over the set) make the speed figures (0: all)
    device_lock: str = ""  # a lock file shared by evals side by side: timed prompts decode alone (`DeviceTurns`)
    drafter_graphs: bool = True  # on CUDA the drafter's block replays as a CUDA graph (modeling_dflash.BlockGraph)


AUTO_PROPOSAL = "auto"
AUTO_TREE, AUTO_SAMPLED_TREE, AUTO_CHAIN = "tree:64x16", "stree:256", "sample"


@torch.inference_mode()
def target_takes_trees(target, device: torch.device) -> bool:
    """Whether the target's cache can verify a tree (every layer full attention with a dynamic cache), read
    from the cache of a one-token forward."""
    session = TargetSession(target, [0])
    session.forward(torch.zeros(1, 1, dtype=torch.long, device=device), logits_to_keep=1)
    return session.tree_refusal() is None


def served_proposals(options: EvalOptions, takes_trees: bool = False, report: bool = True) -> list[Proposal]:
    """The policies to serve, parsed (a bad one is a ConfigError naming it); `auto` is, for a target that can
    verify trees (`takes_trees`), `tree:64x16` at temperature 0 and `stree:256` above it (a deterministic tree keeps
    little of a sampled target's mass), and `sample` otherwise. At temperature 0 every chain policy (argmax,
    sample, sample:F) is the same greedy verification, so the first of them stands for all; each tree size
    serves its own tokens' tree and stays."""
    auto = (AUTO_SAMPLED_TREE if options.temperature > 0 else AUTO_TREE) if takes_trees else AUTO_CHAIN
    texts = [auto if text == AUTO_PROPOSAL else text for text in options.proposals]
    try:
        proposals = list(dict.fromkeys(parse_proposal(text) for text in texts))
    except ValueError as error:
        raise ConfigError(f"--proposal: {error}") from None
    if not proposals:
        raise ConfigError("--proposal: no policy given (auto, argmax, sample, sample:F, tree:N or stree:N)")
    if options.temperature > 0:
        return proposals
    first_of_key = {}
    for proposal in proposals:
        first_of_key.setdefault(proposal.greedy_key(), proposal)
    served = list(first_of_key.values())
    if len(served) < len(proposals) and report:
        dropped = ", ".join(proposal.name for proposal in proposals if proposal not in served)
        print(f"temperature 0: every chain policy is greedy verification (and stree:N serves tree:N's tree); serving "
              f"{', '.join(p.name for p in served)} (not {dropped})")
    return served


def spread(chosen: int, count: int) -> set[int]:
    """The indices of `chosen` prompts spread evenly over `count` (0 or `count` and more: every one): a set's
    rows come grouped by kind or module, so its first few would time one kind alone."""
    if not chosen or chosen >= count:
        return set(range(count))
    return {round(k * (count - 1) / max(chosen - 1, 1)) for k in range(chosen)}


def shard_bounds(shard: str, count: int) -> tuple[int, int]:
    """`(start, end)` of share I of K ("I/K", 0 <= I < K) of `count` prompts, contiguous and near-equal."""
    index, slash, total = shard.partition("/")
    if not (slash and index.isdigit() and total.isdigit() and int(index) < int(total)):
        raise ConfigError(f"--shard {shard!r}: expected I/K with 0 <= I < K")
    index, total = int(index), int(total)
    return index * count // total, (index + 1) * count // total


def run(config: Config, options: EvalOptions, config_args=()) -> list[EvalResult]:
    """Serve and report; with `options.workers` > 1 through that many worker processes (`config_args`:
    the `-c` / `--set` arguments that load this config in them)."""
    for path in options.drafters:
        check_drafter_export(path)
    served_proposals(options, report=False)  # a bad policy fails before anything loads
    if options.workers > 1 and not options.shard:
        return run_sharded(options, list(config_args))
    turns = DeviceTurns(options.device_lock)
    with contextlib.ExitStack() as timed_ahead, contextlib.ExitStack() as loading:
        timed_ahead.enter_context(turns.timed_ahead())  # this process's timed prompts go before any untimed ones
        loading.enter_context(turns.loading())  # and no process's timed prompts while this one loads
        return serve(config, options, turns, timed_ahead, loading)


def serve(config: Config, options: EvalOptions, turns: DeviceTurns, timed_ahead: contextlib.ExitStack,
          loading: contextlib.ExitStack) -> list[EvalResult]:
    """`run` in one process: load and warm up beside the others, close `loading`, decode the timed prompts in
    one turn alone (once no process is loading), close `timed_ahead` (this process has no timed work left),
    wait until no process has any, then decode the rest beside the others. The results keep the prompts'
    order."""
    device = resolve_device(options.device)
    dtype = target_dtype(config.target.dtype, device)
    checkpoint = prepare_checkpoint(config.target.path, config.data.cache_dir)
    tokenizer = load_target_tokenizer(checkpoint, config.target.chat_template)
    target = load_causal_lm(str(checkpoint), dtype, device)
    drafts = [load_drafter(path, target, dtype, device) for path in options.drafters]
    proposals = served_proposals(options, AUTO_PROPOSAL in options.proposals and target_takes_trees(target, device))
    prompts = load_prompts(config, options.prompts, options.num_prompts, tokenizer, options.match, options.exclude)
    start, end = shard_bounds(options.shard, len(prompts)) if options.shard else (0, len(prompts))
    timed_indices = spread(options.timed_prompts, len(prompts))
    prompts = prompts[start:end]
    if options.shard:
        if not prompts:  # more workers than prompts
            if options.out:
                write_json([], options.out)
            return []
    source = options.prompts + "".join(f" ({flag} {pattern!r})" for flag, pattern in
                                       (("--match", options.match), ("--exclude", options.exclude)) if pattern)
    # one result, and one random stream, per drafter and policy; every stream restarts at each prompt from
    # the seed plus the prompt's index, so a prompt's draws do not depend on the prompts before it (nor on
    # how --workers shares them out)
    served = [(draft, proposal, torch.Generator(device=device)) for draft in drafts for proposal in proposals]
    graphs = options.drafter_graphs and device.type == "cuda"  # off CUDA the drafter runs eagerly
    results = [EvalResult(drafter=path, target=config.target.path, prompts_source=source, device=str(device),
                          dtype=str(dtype).removeprefix("torch."), block_size=draft.block_size,
                          temperature=options.temperature, max_new_tokens=options.max_new_tokens,
                          proposal=proposal.name, drafter_graphs=graphs, cpu_threads=torch.get_num_threads())
               for path, draft in zip(options.drafters, drafts) for proposal in proposals]
    stops = stop_token_ids(tokenizer, target)
    baseline_generator = torch.Generator(device=device)
    partial = PartialResults(options.out, run_identity(options, device))
    decoded_by_index = partial.load()  # the prompts a killed run of these options and drafters served
    bar = tqdm(total=len(prompts), unit="prompt", desc=f"eval {options.shard}".strip(), dynamic_ncols=True)
    for index in sorted(decoded_by_index):
        for result, decoded in zip(results, decoded_by_index[index]):
            result.per_prompt.append(decoded)
        bar.update()
    if len(decoded_by_index) < len(prompts):
        with turns.beside():  # never beside a prompt timed alone
            warm_up(drafts, target, prompts[0].ids, options.max_new_tokens, stops, device, proposals, graphs)
    loading.close()

    def serve_prompt(index: int, prompt) -> None:
        for generator in [baseline_generator, *(generator for _, _, generator in served)]:
            generator.manual_seed(options.seed + index)
        input_ids = torch.as_tensor(prompt.ids, dtype=torch.long, device=device)[None]
        timed_prompt = index in timed_indices
        # the plain baseline is only a speed figure (at temperature 0 the output is checked against the
        # target's greedy choices in one forward): an untimed prompt skips it
        baseline = None if not timed_prompt else timed(
            device, lambda: plain_generate(target, input_ids, options.max_new_tokens, stops,
                                           options.temperature, baseline_generator))
        checks = {}  # the greedy check once per distinct output (the policies' outputs are mostly one)
        decoded_by_index[index] = [decode_prompt(draft, target, prompt.label, input_ids, baseline,
                                                 options.max_new_tokens, options.temperature, stops, generator,
                                                 device, proposal, graphs, checks)
                                   for draft, proposal, generator in served]
        for decoded in decoded_by_index[index]:
            decoded.kind, decoded.timed = prompt.kind, timed_prompt
        partial.add(index, decoded_by_index[index])
        for result, decoded in zip(results, decoded_by_index[index]):  # the running tau: the prompts so far
            result.per_prompt.append(decoded)
        bar.update()
        bar.set_postfix(tau="/".join(f"{summarize(result).tau:.2f}" for result in results))

    numbered = list(enumerate(prompts, start))
    todo = [(index, prompt) for index, prompt in numbered if index not in decoded_by_index]
    timed_here = [(index, prompt) for index, prompt in todo if index in timed_indices]
    if timed_here:
        with turns.alone():  # one turn for all of them: one wait for the prompts the others have in hand
            for index, prompt in timed_here:
                serve_prompt(index, prompt)
    timed_ahead.close()
    turns.after_timed()
    for index, prompt in todo:
        if index not in timed_indices:
            with turns.beside():
                serve_prompt(index, prompt)
    bar.close()
    for result, in_order in zip(results, zip(*(decoded_by_index[index] for index, _ in numbered))):
        result.per_prompt = [mark_code(decoded, tokenizer) for decoded in in_order]
    for result in results:
        summarize(result)
    reported(results, options)
    if not options.shard:  # a worker's partial file stays until `run_sharded` has merged every worker's JSON
        partial.remove()
    return results


def run_identity(options: EvalOptions, device: torch.device) -> dict:
    """What decides an eval's outputs, as its partial file names it: its options but where it writes and how many
    processes share the work, the device and each drafter's weights (`drafter_identity`)."""
    identity = {key: value for key, value in dataclasses.asdict(options).items() if key not in NOT_IDENTITY}
    identity.update(drafters=[drafter_identity(path) for path in options.drafters], device=str(device))
    return json.loads(json.dumps(identity))  # as the partial file's first line reads back (tuples as lists)


NOT_IDENTITY = ("out", "plot", "workers", "device_lock", "device")  # options that leave a prompt's outputs alone


def reported(results: list[EvalResult], options: EvalOptions) -> list[EvalResult]:
    """Print the report; write the JSON and the plot where asked."""
    print_report(results)
    if options.out:
        write_json(results, options.out)
    if options.plot:
        plot(results, options.plot)
    return results


def run_sharded(options: EvalOptions, config_args: list[str]) -> list[EvalResult]:
    """`options.workers` processes of `dflash eval --shard I/K` side by side, each on a contiguous share of the
    prompts with its own target and baseline; their JSONs merged in prompt order and summarised as one run.
    A worker that fails stops the others, and its log's tail names it."""
    total = options.workers
    print(f"eval: {total} workers side by side, each serving a contiguous share of the prompts")
    turns = DeviceTurns(options.device_lock)
    with shard_folder(options.out) as folder:
        workers = []
        try:
            with turns.loading():  # until each worker holds its own (`start_loading`)
                for index in range(total):
                    out, log = (Path(folder) / f"shard-{index}of{total}.{kind}" for kind in ("json", "log"))
                    command = worker_command(options, config_args, f"{index}/{total}", out)
                    with open(log, "w") as stream:  # each worker its share of this eval's CPU threads
                        workers.append((start_loading(command, options.device_lock, share_threads(total),
                                                      stdout=stream), out, log))
            for index, (worker, out, log) in enumerate(workers):
                if worker.wait() != 0:
                    tail = "".join(log.read_text().splitlines(keepends=True)[-20:])
                    raise RuntimeError(f"eval worker {index}/{total} exited with status {worker.returncode}; "
                                       f"its output ends:\n{tail}")
        finally:
            for worker, _, _ in workers:
                if worker.poll() is None:
                    worker.terminate()
                    worker.wait()
        shards = [json.loads(out.read_text())["results"] for _, out, _ in workers]
        return reported(merge_shards([shard for shard in shards if shard]), options)


def worker_command(options: EvalOptions, config_args: list[str], shard: str, out: Path) -> list[str]:
    """`dflash eval --shard I/K` with this eval's options."""
    import sys

    return [sys.executable, "-m", "stages.cli", "eval", *config_args,
            *[item for path in options.drafters for item in ("--drafter", path)],
            "--prompts", options.prompts, "--num-prompts", str(options.num_prompts),
            "--match", options.match, "--exclude", options.exclude,
            "--max-new-tokens", str(options.max_new_tokens), "--temperature", f"{options.temperature!r}",
            "--proposal", ",".join(options.proposals), "--seed", str(options.seed),
            "--device", options.device, "--out", str(out), "--shard", shard,
            "--timed-prompts", str(options.timed_prompts),
            *(["--device-lock", options.device_lock] if options.device_lock else []),
            "--drafter-graphs" if options.drafter_graphs else "--no-drafter-graphs"]


@contextlib.contextmanager
def shard_folder(out: str):
    """Where `run_sharded`'s workers write: `OUT.shards/` beside --out, kept if the run fails or is killed (each
    worker's partial file there lets a rerun continue) and removed once the merged JSON is written; without
    --out a temporary folder."""
    if not out:
        with tempfile.TemporaryDirectory(prefix="dflash-eval-") as folder:
            yield Path(folder)
        return
    folder = Path(out + ".shards")
    folder.mkdir(parents=True, exist_ok=True)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def merge_shards(shards: list[list[dict]]) -> list[EvalResult]:
    """One result per drafter and policy from the workers' JSON results (the same list in each), the
    prompts in shard order, every number recomputed from the prompts (`summarize`)."""
    merged = []
    for results in zip(*shards):
        fields = {key: value for key, value in results[0].items() if key != "per_prompt"}
        prompts = [PromptResult(**prompt) for result in results for prompt in result["per_prompt"]]
        merged.append(summarize(EvalResult(**fields, per_prompt=prompts)))
    return merged
