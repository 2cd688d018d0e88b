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
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from dflash.config import Config, ConfigError
from dflash.data.tokenizer import load_target_tokenizer
from dflash.dist import resolve_device, share_threads
from dflash.extract.target import load_causal_lm, prepare_checkpoint, stop_token_ids, target_dtype
from dflash.model.modeling_dflash import Proposal, TargetSession, graph_capacity, parse_proposal, plain_generate
from dflash.outputs import write_text_atomic
from dflash.serve.decoding import unsupported_reason
from dflash.serve.evaluation import (ALONE, DEFERRED, HELDOUT, INLINE, EvalResult, PartialResults, PromptResult,
                                     check_drafter_export, decode_prompt, drafter_identity, load_drafter, load_prompts,
                                     mark_code, plot, print_report, result_from_json, summarize, timed,
                                     use_verdict_kernel, warm_up, write_json)
from dflash.serve.target_graphs import StaticTargetSession


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
    defer_timing: bool = False  # decode every prompt untimed; `time_alone` (dflash time-evals) times them later
    drafter_graphs: bool = True  # on CUDA the drafter's block replays as a CUDA graph (modeling_dflash.BlockGraph)
    target_graphs: bool = False  # the target over a static cache, each forward's shape a CUDA graph on CUDA
                                 # (dflash/serve/target_graphs.py; Llama, Mistral, Qwen2, Qwen3 targets)


AUTO_PROPOSAL = "auto"
AUTO_TREE, AUTO_SAMPLED_TREE, AUTO_CHAIN = "tree:64x16", "stree:256x32", "sample"


@torch.inference_mode()
def target_takes_trees(target, device: torch.device) -> bool:
    """Whether the target's cache can verify a tree (every layer full attention with a dynamic cache), read
    from the cache of a one-token forward."""
    session = TargetSession(target, [0])
    session.forward(torch.zeros(1, 1, dtype=torch.long, device=device), logits_to_keep=1)
    return session.tree_refusal() is None


def served_proposals(options: EvalOptions, takes_trees: bool = False, report: bool = True) -> list[Proposal]:
    """The policies to serve, parsed (a bad one is a ConfigError naming it); `auto` is, for a target that can
    verify trees (`takes_trees`), `tree:64x16` at temperature 0 and `stree:256x32` above it (a deterministic tree keeps
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
        return run_sharded(config, options, list(config_args))
    return serve(config, options)


class Server:
    """The target, the drafters and their policies of one process, and how it decodes one prompt: plainly (the
    baseline, a timed prompt only) and speculatively with every drafter and policy, each random stream restarted
    from the seed plus the prompt's index."""

    def __init__(self, target, device: torch.device, stops, options: EvalOptions,
                 served: list[tuple[object, Proposal]], graphs: bool, prompts=()):
        self.target, self.device, self.stops, self.options, self.graphs = target, device, stops, options, graphs
        self.served = [(draft, proposal, torch.Generator(device=device)) for draft, proposal in served]
        self.baseline_generator = torch.Generator(device=device)
        # with options.target_graphs, one static session per distinct feature layers, as long as `prompts` need
        self.sessions, self.max_context = {}, 0
        if options.target_graphs and StaticTargetSession.supports(target):
            widest = max([draft.block_size for draft, _ in served] + [proposal.tree for _, proposal in served],
                         default=1)
            longest = max((len(prompt.ids) for prompt in prompts), default=0)
            self.max_context = longest + options.max_new_tokens + widest + 1

    @property
    def target_graphs(self) -> bool:
        return self.max_context > 0

    def session_for(self, draft):
        """The target's static session for `draft`'s feature layers (None: the plain decoding's, any one), or
        None without target graphs."""
        if not self.target_graphs:
            return None
        if draft is None and self.served:  # the plain decoding: any session serves it, the first drafter's
            draft = self.served[0][0]
        layer_ids = tuple(draft.target_layer_ids) if draft is not None else ()
        if layer_ids not in self.sessions:
            self.sessions[layer_ids] = StaticTargetSession(self.target, list(layer_ids), self.max_context)
        return self.sessions[layer_ids]

    def warm_up(self, prompts, warmed: set | None = None) -> None:
        """`warm_up` with every drafter and policy served here, once per drafter cache capacity among `prompts` (the
        drafter's block graph is captured per capacity, `graph_capacity`); `warmed`: what this process warmed
        already (the plain decoding per temperature kind; each drafter's chain or tree shape at 0, each policy
        above, per capacity), left out and added to."""
        warmed = set() if warmed is None else warmed
        sampled, new_tokens = self.options.temperature > 0, self.options.max_new_tokens
        for prompt in prompts:
            plain = ("plain", sampled) not in warmed
            for draft in dict.fromkeys(draft for draft, _, _ in self.served):
                capacity = graph_capacity(draft.block_size, len(prompt.ids) + new_tokens + draft.block_size)
                shapes = {}  # the first policy of each shape stands for it
                for served, proposal, _ in self.served:
                    if served is draft:
                        shapes.setdefault((id(draft), proposal if sampled else proposal.greedy_key(), sampled,
                                           capacity), proposal)
                fresh = [proposal for key, proposal in shapes.items() if key not in warmed]
                if fresh or plain:
                    warm_up([draft] if fresh else [], self.target, prompt.ids, new_tokens, self.stops, self.device,
                            fresh, self.graphs, self.options.temperature, self.session_for)
                    plain = False
                warmed.update(shapes)
            warmed.add(("plain", sampled))

    def decode(self, index: int, prompt, timed_prompt: bool) -> list[PromptResult]:
        options = self.options
        for generator in [self.baseline_generator, *(generator for _, _, generator in self.served)]:
            generator.manual_seed(options.seed + index)
        input_ids = torch.as_tensor(prompt.ids, dtype=torch.long, device=self.device)[None]
        # the plain baseline is only a speed figure (at temperature 0 the output is checked against the
        # target's greedy choices in one forward): an untimed prompt skips it
        baseline = None if not timed_prompt else timed(
            self.device, lambda: plain_generate(self.target, input_ids, options.max_new_tokens, self.stops,
                                                options.temperature, self.baseline_generator, self.session_for(None)))
        checks = {}  # the greedy check once per distinct output (the policies' outputs are mostly one)
        decoded = [decode_prompt(draft, self.target, prompt.label, input_ids, baseline, options.max_new_tokens,
                                 options.temperature, self.stops, generator, self.device, proposal, self.graphs, checks,
                                 self.session_for(draft))
                   for draft, proposal, generator in self.served]
        for one in decoded:
            one.kind, one.timed = prompt.kind, timed_prompt
        return decoded


def load_target(config: Config, device: str):
    """The config's target on `device` ("auto", "cpu", "cuda:N"): the device, the dtype, its tokenizer, the model;
    the serving loop's verdicts through dflash's Triton kernel where Triton is installed (`use_verdict_kernel`)."""
    use_verdict_kernel()
    device = resolve_device(device)
    dtype = target_dtype(config.target.dtype, device)
    checkpoint = prepare_checkpoint(config.target.path, config.data.cache_dir)
    tokenizer = load_target_tokenizer(checkpoint, config.target.chat_template)
    return device, dtype, tokenizer, load_causal_lm(str(checkpoint), dtype, device)


def serve(config: Config, options: EvalOptions) -> list[EvalResult]:
    """`run` in one process: load, warm up, decode every prompt (a killed run's partial file continues), the
    timed ones with their baseline, unless the timing is deferred (`--defer-timing`: `time_alone` decodes them
    again later, alone on the device). The results keep the prompts' order."""
    device, dtype, tokenizer, target = load_target(config, options.device)
    drafts = [load_drafter(path, target, dtype, device) for path in options.drafters]
    proposals = served_proposals(options, AUTO_PROPOSAL in options.proposals and target_takes_trees(target, device))
    prompts = load_prompts(config, options.prompts, options.num_prompts, tokenizer, options.match, options.exclude)
    start, end = shard_bounds(options.shard, len(prompts)) if options.shard else (0, len(prompts))
    timed_indices = set() if options.defer_timing else spread(options.timed_prompts, len(prompts))
    prompts = prompts[start:end]
    if options.shard:
        if not prompts:  # more workers than prompts
            if options.out:
                write_json([], options.out)
            return []
    source = prompts_source(options)
    # one result, and one random stream, per drafter and policy; every stream restarts at each prompt from
    # the seed plus the prompt's index, so a prompt's draws do not depend on the prompts before it (nor on
    # how --workers shares them out)
    graphs = options.drafter_graphs and device.type == "cuda"  # off CUDA the drafter runs eagerly
    server = Server(target, device, stop_token_ids(tokenizer, target), options,
                    [(draft, proposal) for draft in drafts for proposal in proposals], graphs, prompts)
    if options.target_graphs and not server.target_graphs:
        print(f"eval: --target-graphs: {unsupported_reason(target)}; the target runs through transformers' forward")
    results = [EvalResult(drafter=path, target=config.target.path, prompts_source=source, device=str(device),
                          dtype=str(dtype).removeprefix("torch."), block_size=draft.block_size,
                          temperature=options.temperature, max_new_tokens=options.max_new_tokens,
                          proposal=proposal.name, drafter_graphs=graphs, target_graphs=server.target_graphs,
                          cpu_threads=torch.get_num_threads(),
                          timing=DEFERRED if options.defer_timing else INLINE)
               for path, draft in zip(options.drafters, drafts) for proposal in proposals]
    partial = PartialResults(options.out, run_identity(options, device))
    decoded_by_index = partial.load()  # the prompts a killed run of these options and drafters served
    bar = tqdm(total=len(prompts), unit="prompt", desc=f"eval {options.shard}".strip(), dynamic_ncols=True)
    for index in sorted(decoded_by_index):
        for result, decoded in zip(results, decoded_by_index[index]):
            result.per_prompt.append(decoded)
        bar.update()
    numbered = list(enumerate(prompts, start))
    todo = [(index, prompt) for index, prompt in numbered if index not in decoded_by_index]
    if todo:  # every capacity the timed prompts need (untimed ones capture theirs as they come)
        server.warm_up([prompt for index, prompt in todo if index in timed_indices] or [prompts[0]])
    # the timed prompts first, so that a prompt's time never waits behind work of this process's own
    for index, prompt in sorted(todo, key=lambda item: item[0] not in timed_indices):
        decoded_by_index[index] = server.decode(index, prompt, index in timed_indices)
        partial.add(index, decoded_by_index[index])
        for result, decoded in zip(results, decoded_by_index[index]):  # the running tau: the prompts so far
            result.per_prompt.append(decoded)
        bar.update()
        bar.set_postfix(tau="/".join(f"{summarize(result).tau:.2f}" for result in results))
    bar.close()
    for result, in_order in zip(results, zip(*(decoded_by_index[index] for index, _ in numbered))):
        result.per_prompt = [mark_code(decoded, tokenizer) for decoded in in_order]
    for result in results:
        summarize(result)
    reported(results, options)
    if not options.shard:  # a worker's partial file stays until `run_sharded` has merged every worker's JSON
        partial.remove()
    return results


def prompts_source(options: EvalOptions) -> str:
    """The prompts as the report names them: the source, and its --match / --exclude."""
    return options.prompts + "".join(f" ({flag} {pattern!r})" for flag, pattern in
                                     (("--match", options.match), ("--exclude", options.exclude)) if pattern)


def time_alone(config: Config, jobs: list[tuple[EvalOptions, list[EvalResult]]], device: str = "auto") -> None:
    """Decode each job's timed prompts (`options.timed_prompts`, spread over its set; 0: every prompt) again, with
    their plain baseline, in this one process, and put them in place of their untimed decodes; every result's
    speed figures then come from them (`timing` "alone"). Run it where no other process uses the device: timed
    beside other processes, even ones waiting on a lock, a step of the recipe of 12-06 took 45-50 ms where one
    process alone takes 21-26 (H100). The target is loaded once for every job (each must serve config's)."""
    for options, results in jobs:
        for result in results:
            if result.target != config.target.path:
                raise ConfigError(f"target.path is {config.target.path!r} but {options.out or 'an eval'} served "
                                  f"{result.target!r}: time it with the config it was served with")
    device, dtype, tokenizer, target = load_target(config, device)
    stops = stop_token_ids(tokenizer, target)
    drafts, warmed = {}, set()
    for options, results in jobs:
        for result in results:
            if result.drafter not in drafts:
                drafts[result.drafter] = load_drafter(result.drafter, target, dtype, device)
        prompts = load_prompts(config, options.prompts, options.num_prompts, tokenizer, options.match,
                               options.exclude)
        if len(prompts) != results[0].num_prompts:
            raise ConfigError(f"{options.out or 'an eval'}: {results[0].num_prompts} prompts were served, but "
                              f"{options.prompts} gives {len(prompts)} now: the prompts changed since")
        indices = sorted(spread(options.timed_prompts, len(prompts)))
        graphs = options.drafter_graphs and device.type == "cuda"
        timed_prompts = [prompts[index] for index in indices]
        server = Server(target, device, stops, options,
                        [(drafts[result.drafter], parse_proposal(result.proposal)) for result in results], graphs,
                        timed_prompts)
        server.warm_up(timed_prompts, warmed if not server.target_graphs else set())  # a new server's sessions: warm
        for index in tqdm(indices, unit="prompt", desc=f"time {Path(options.out).stem if options.out else ''}".strip(),
                          dynamic_ncols=True):
            for result, decoded in zip(results, server.decode(index, prompts[index], True)):
                decoded = mark_code(decoded, tokenizer)
                if decoded.generated_ids != result.per_prompt[index].generated_ids:
                    result.retimed_differing += 1  # the device's nondeterminism: the timed decode's tau is kept
                result.per_prompt[index] = decoded
        for result in results:
            for index, prompt in enumerate(result.per_prompt):
                prompt.timed = index in indices
            result.timing = ALONE
            result.target_graphs = server.target_graphs  # the speed figures' target (served untimed either way)
            summarize(result)


OPTION_NAMES = {field.name for field in dataclasses.fields(EvalOptions)}  # what an eval JSON's "options" may name


def time_evals(config: Config, paths: list[str], device: str = "auto", summary: str = "",
               target_graphs: bool | None = None, again: bool = False) -> list[str]:
    """`dflash time-evals`: `time_alone` for the eval JSONs whose timing was deferred (`--defer-timing`), each
    written back with its speed figures and its report printed; JSONs timed already are left as they are, unless
    `again` (their speed figures replaced). Returns the paths timed. `summary`: a JSON naming each path and what was
    done with it. `target_graphs`: the timed decodes' target as CUDA graphs (True) or transformers' forward (False);
    None: as each eval was served."""
    jobs, done = [], []
    for path in paths:
        try:
            written = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as error:
            raise ConfigError(f"{path}: not a dflash eval JSON ({error})") from None
        results = [result_from_json(result) for result in written.get("results", [])]
        if not results or "options" not in written:
            raise ConfigError(f"{path}: no results or no options: write it with dflash eval --out")
        if any(result.timing != DEFERRED for result in results) and not again:
            print(f"{path}: timed already ({results[0].timing}), left as it is")
            done.append({"path": path, "timed": False, "timing": results[0].timing})
            continue
        options = EvalOptions(**{key: tuple(value) if isinstance(value, list) else value
                                 for key, value in written["options"].items() if key in OPTION_NAMES})
        for result in results:
            result.retimed_differing = 0
        timing = dataclasses.replace(options, out=path, defer_timing=False)
        if target_graphs is not None:
            timing = dataclasses.replace(timing, target_graphs=target_graphs)
        jobs.append((timing, results))
    if jobs:
        time_alone(config, jobs, device)
    for options, results in jobs:
        reported(results, options)
        done.append({"path": options.out, "timed": True, "timing": ALONE, "timed_prompts": results[0].timed_prompts,
                     "speedups": [{"drafter": result.drafter, "proposal": result.proposal, "speedup": result.speedup}
                                  for result in results]})
    if summary:
        write_text_atomic(Path(summary), json.dumps({"evals": done}, indent=1) + "\n")
    return [options.out for options, _ in jobs]


def run_identity(options: EvalOptions, device: torch.device) -> dict:
    """What decides an eval's outputs, as its partial file names it: its options but where it writes and how many
    processes share the work, the device and each drafter's weights (`drafter_identity`)."""
    identity = {key: value for key, value in dataclasses.asdict(options).items() if key not in NOT_IDENTITY}
    identity.update(drafters=[drafter_identity(path) for path in options.drafters], device=str(device))
    return json.loads(json.dumps(identity))  # as the partial file's first line reads back (tuples as lists)


NOT_IDENTITY = ("out", "plot", "workers", "device")  # options that leave a prompt's outputs alone


def reported(results: list[EvalResult], options: EvalOptions) -> list[EvalResult]:
    """Print the report; write the JSON and the plot where asked."""
    print_report(results)
    if options.out:
        write_json(results, options.out, dataclasses.asdict(options))
    if options.plot:
        plot(results, options.plot)
    return results


def run_sharded(config: Config, options: EvalOptions, config_args: list[str]) -> list[EvalResult]:
    """`options.workers` processes of `dflash eval --shard I/K --defer-timing` side by side, each on a contiguous
    share of the prompts with its own target; their JSONs merged in prompt order and summarised as one run. Once
    they have ended, this process times the timed prompts alone (`time_alone`), unless the timing is deferred
    further (`--defer-timing`: `dflash time-evals`). A worker that fails stops the others, and its log's tail
    names it."""
    total = options.workers
    print(f"eval: {total} workers side by side, each serving a contiguous share of the prompts")
    with shard_folder(options.out) as folder:
        workers = []
        try:
            for index in range(total):
                out, log = (Path(folder) / f"shard-{index}of{total}.{kind}" for kind in ("json", "log"))
                command = worker_command(options, config_args, f"{index}/{total}", out)
                with open(log, "w") as stream:  # each worker its share of this eval's CPU threads
                    workers.append((subprocess.Popen(command, env=share_threads(total), stdout=stream), out, log))
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
        merged = merge_shards([shard for shard in shards if shard])
        if not options.defer_timing:
            print(f"eval: the workers have ended; timing {options.timed_prompts or 'every'} prompt(s) alone")
            time_alone(config, [(options, merged)], options.device)
        return reported(merged, options)


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
            "--timed-prompts", str(options.timed_prompts), "--defer-timing",
            "--drafter-graphs" if options.drafter_graphs else "--no-drafter-graphs",
            "--target-graphs" if options.target_graphs else "--no-target-graphs"]


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
        result = result_from_json(results[0])
        result.per_prompt = [prompt for shard in results for prompt in result_from_json(shard).per_prompt]
        merged.append(summarize(result))
    return merged
