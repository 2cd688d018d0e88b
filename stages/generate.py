"""`dflash generate`: regenerate the answers of a chat dataset with the target.

A drafter is accepted where it predicts the target, not the dataset's author, so the
published DFlash recipe trains on the target's own answers. This stage renders every row up
to its last assistant turn with the chat template stage one uses, lets the target write that
turn (greedy by default; with --temperature > 0, --num-samples sampled answers per prompt,
and the greedy one beside them with --with-greedy), keeps the earlier turns, and writes JSONL
rows `{"messages": [..., {"role": "assistant", "content": ANSWER}], "source_row": N,
"sample": K, "cut": bool}` that `data.source` reads (`source_row` is the 1-based row of the
source, `sample` 0 the greedy answer and 1.. the sampled ones, `cut` says the answer reached
--max-new-tokens). With --ask-temperature the target first writes each row's last user turn from the
row's text as its start (rows such as embedded:ask-code's: "Write a Python function"), sampled from
each row's own stream, then answers the prompts it wrote; those it does not end are dropped and counted.
With --turns 2 (and --ask-temperature) the target then writes a second user turn after each answer that
was not cut, from one of dflash.data.starts.FOLLOW_UP_STARTS at the asking temperature, and answers it:
such rows hold two exchanges (`"turns": 2`); an answer cut at --max-new-tokens stays a one-turn row.

The rows are planned first, in source order, into shards of `--rows-per-shard` prompts; the
answers of every shard still to write stream through one engine (dflash/serve/generation.py; the
slots engine takes them in windows of a few thousand, longest prompt first), and each shard is
written atomically as `part-NNNNN.jsonl` once its answers are in, its rows in prompt and sample
order, so a killed run resumes where it stopped (finished shards are kept) and writes the same
files as an uninterrupted one. `generate-manifest.txt` (JSON; not a data suffix, so `data.source`
never reads it) records what the output holds: a rerun with other content settings is refused
unless --overwrite. Under torchrun (`--gpus`) rank r writes shards r, r + world, ... With --turns 2 every
turn of a group of shards (TURNS_GROUP_PROMPTS prompts) is made before the next group's, so that a resume
keeps the groups done.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tqdm import tqdm

from dflash.config import Config, ConfigError
from dflash.data import chat
from dflash.data.tokenizer import load_target_tokenizer, tokenizer_identity
from dflash.dist import DistState, all_reduce_sum, init_distributed, shutdown
from dflash.extract.target import (load_causal_lm, prepare_checkpoint_in_order, stop_token_ids, target_dtype,
                                   weights_fingerprint)
from dflash.outputs import write_text_atomic
from dflash.serve.decoding import ATTENTIONS
from dflash.serve.generation import (ASKED_CUT, ASKED_EMPTY, BAD_PROMPT_TOO_LONG, ENGINES, FIRST_ANSWER_CUT, Answer,
                                     Generator, Job, Prompt, ask_job, asked_prompt, follow_up_answer_job,
                                     follow_up_ask_job, output_row, prepare_output, read_prompts, sample_indices,
                                     shard_path)

TURNS = (1, 2)
TURNS_GROUP_PROMPTS = 4096  # --turns 2: shards made together, first turn to last, before the next ones


@dataclass(frozen=True)
class GenerateOptions:
    out: str
    max_new_tokens: int = 1024
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: the whole vocabulary
    num_samples: int = 1  # sampled answers per prompt (with temperature > 0)
    with_greedy: bool = False  # also the greedy answer (sample 0) when sampling
    seed: int = 0
    batch_size: int = 0  # 0: the engine's slots fill half the free GPU memory; 256 prompts per batch otherwise; CPU 8
    cache_share: float = 0.0  # > 0 (with batch_size 0): the slots' KV cache takes this share of the GPU's whole memory
    engine: str = "auto"  # "auto": the slots engine where the target allows it, "slots", "generate"
    decode_attention: str = "auto"  # the slots engine's decode attention: "auto" (flex on CUDA), "flex", "sdpa"
    rows_per_shard: int = 1024
    limit: int = 0  # only the first N usable rows (0: all)
    device: str = "auto"
    static_cache: str = "auto"  # "auto": on CUDA (compiled decoding), "on", "off"
    overwrite: bool = False
    ask_temperature: float = 0.0  # > 0: the target first writes each row's last user turn, sampled at this
    turns: int = 1  # 2: the target then writes a follow-up user turn (at ask_temperature) and answers it


@dataclass
class GenerateResult:
    out: str
    num_rows: int = 0  # rows read from the source
    num_prompts: int = 0  # rows with a usable prompt (planned)
    bad_rows: dict = field(default_factory=dict)
    shards_written: int = 0
    shards_kept: int = 0
    answers: int = 0
    tokens: int = 0
    cut: int = 0
    asked: int = 0  # prompts the target wrote (--ask-temperature), answered
    ask_dropped: dict = field(default_factory=dict)  # reason -> prompts it wrote that were not answered
    follow_ups: int = 0  # --turns 2: second answers (two-turn rows)
    follow_up_dropped: dict = field(default_factory=dict)  # reason -> answers left as one-turn rows
    seconds: float = 0.0


def run(config: Config, options: GenerateOptions) -> GenerateResult:
    check_options(options)
    dist = init_distributed(options.device)
    try:
        return generate(config, options, dist)
    finally:
        shutdown(dist)


def check_options(options: GenerateOptions) -> None:
    for name in ("max_new_tokens", "rows_per_shard"):
        if getattr(options, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be positive, got {getattr(options, name)}")
    if options.ask_temperature < 0:
        raise ConfigError(f"--ask-temperature must be >= 0 (0: answer the rows' prompts as they are), got "
                          f"{options.ask_temperature}")
    if options.turns not in TURNS:
        raise ConfigError(f"--turns must be one of {', '.join(map(str, TURNS))}, got {options.turns}")
    if options.turns > 1 and options.ask_temperature <= 0:
        raise ConfigError(f"--turns {options.turns}: the target writes the follow-up user turns at --ask-temperature, "
                          f"which must be > 0")
    if options.temperature < 0 or not 0 < options.top_p <= 1:
        raise ConfigError(f"--temperature must be >= 0 and --top-p in (0, 1], got {options.temperature}, "
                          f"{options.top_p}")
    if options.batch_size < 0 or options.limit < 0 or options.top_k < 0:
        raise ConfigError("--batch-size, --limit and --top-k must be >= 0")
    if not 0 <= options.cache_share < 1:
        raise ConfigError(f"--cache-share must be in [0, 1) (0: half the free GPU memory), got {options.cache_share}")
    if options.num_samples < 1 or (options.temperature == 0 and (options.num_samples > 1 or options.with_greedy)):
        raise ConfigError(f"--num-samples {options.num_samples}{' --with-greedy' if options.with_greedy else ''}: "
                          f"several answers per prompt are sampled, so they need --temperature > 0 (at 0 the one "
                          f"answer is the greedy one)")
    if options.engine not in ENGINES:
        raise ConfigError(f"--engine must be one of {', '.join(ENGINES)}, got {options.engine!r}")
    if options.decode_attention not in ATTENTIONS:
        raise ConfigError(f"--decode-attention must be one of {', '.join(ATTENTIONS)}, got {options.decode_attention!r}")
    if options.static_cache not in ("auto", "on", "off"):
        raise ConfigError(f"--static-cache must be auto, on or off, got {options.static_cache!r}")


def generate(config: Config, options: GenerateOptions, dist: DistState) -> GenerateResult:
    checkpoint = prepare_checkpoint_in_order(config.target.path, config.data.cache_dir, dist)
    tokenizer = load_target_tokenizer(checkpoint, config.target.chat_template)
    result = GenerateResult(out=options.out)
    prompts, result.num_rows = read_prompts(config.data.source, config.data.split, tokenizer, config.data.max_length,
                                            config.data.strict, options.limit, result.bad_rows)
    result.num_prompts = len(prompts)
    if not prompts:
        raise ConfigError(f"data.source {config.data.source}: no row has a usable prompt")
    shards = [prompts[i:i + options.rows_per_shard] for i in range(0, len(prompts), options.rows_per_shard)]
    out = Path(options.out)
    if dist.is_main:
        manifest = {"content": content_identity(config, options, checkpoint, tokenizer),
                    "num_prompts": len(prompts), "num_shards": len(shards)}
        prepare_output(out, manifest, options.overwrite)
        report_plan(result, len(shards), sum(shard_path(out, k).exists() for k in range(len(shards))))
    dist.barrier()
    mine = [k for k in range(dist.rank, len(shards), dist.world_size)]
    todo = [k for k in mine if not shard_path(out, k).exists()]
    result.shards_kept = len(mine) - len(todo)
    if todo:
        target = load_causal_lm(str(checkpoint), target_dtype(config.target.dtype, dist.device), dist.device)
        generator = Generator(target, tokenizer, stop_token_ids(tokenizer, target), dist.device,
                              batch_size=options.batch_size, cache_share=options.cache_share, engine=options.engine,
                              static_cache=options.static_cache,
                              max_new_tokens=options.max_new_tokens, temperature=options.temperature,
                              top_p=options.top_p, top_k=options.top_k, seed=options.seed,
                              decode_attention=options.decode_attention)
        if dist.is_main:
            print(generator.describe())
        for group in shard_groups({k: shards[k] for k in todo}, options.turns):
            if options.ask_temperature > 0:
                group = ask_shards(generator, tokenizer, group, options, config.data.max_length, dist, result)
            if options.turns == 1:
                generate_shards(generator, group, out, options, dist, result)
            else:
                two_turn_shards(generator, tokenizer, group, out, options, config.data.max_length, dist, result)
    dist.barrier()
    summarize(dist, result, options)
    return result


def shard_groups(shards: dict[int, list[Prompt]], turns: int) -> list[dict[int, list[Prompt]]]:
    """The shards to make, at once (one turn: every answer streams through one engine run), or with --turns 2
    in groups of consecutive shards that hold TURNS_GROUP_PROMPTS prompts or more (the last: what is left)."""
    if turns == 1:
        return [shards]
    groups, group = [], {}
    for k, prompts in shards.items():
        group[k] = prompts
        if sum(map(len, group.values())) >= TURNS_GROUP_PROMPTS:
            groups.append(group)
            group = {}
    return groups + ([group] if group else [])


def plan_jobs(shards: dict[int, list[Prompt]], options: GenerateOptions) -> list[Job]:
    """Every answer to make, in shard, prompt and sample order."""
    samples = sample_indices(options.temperature, options.num_samples, options.with_greedy)
    return [Job(prompt, sample, k) for k, prompts in shards.items() for prompt in prompts for sample in samples]


def generate_shards(generator: Generator, shards: dict[int, list[Prompt]], out: Path, options: GenerateOptions,
                    dist: DistState, result: GenerateResult) -> None:
    """Every answer of `shards` through one engine; each shard is written as soon as it is whole."""
    jobs = plan_jobs(shards, options)
    members: dict[int, list[int]] = {k: [] for k in shards}  # each shard's jobs, in prompt then sample order
    for index, job in enumerate(jobs):
        members[job.shard].append(index)
    pending = {k: len(indices) for k, indices in members.items()}
    answers: dict[int, Answer] = {}
    start = time.perf_counter()
    bar = tqdm(total=len(jobs), unit="answer", disable=not dist.is_main, dynamic_ncols=True,
               desc=f"generate (rank 0 of {dist.world_size})")

    def take(index: int, answer: Answer) -> None:
        answers[index] = answer
        result.answers += 1
        result.tokens += len(answer.token_ids)
        result.cut += answer.cut
        bar.update(1)
        bar.set_postfix(tokens_per_s=f"{result.tokens / max(time.perf_counter() - start, 1e-9):,.0f}", refresh=False)
        shard = jobs[index].shard
        pending[shard] -= 1
        if pending[shard] == 0:
            write_text_atomic(shard_path(out, shard), "".join(
                json.dumps(output_row(jobs[i], answers.pop(i)), ensure_ascii=False) + "\n" for i in members[shard]))
            result.shards_written += 1

    for k, indices in members.items():  # a shard whose every prompt was dropped while asking: written empty
        if not indices:
            write_text_atomic(shard_path(out, k), "")
            result.shards_written += 1
    generator.run(jobs, take)
    bar.close()
    result.seconds += time.perf_counter() - start


def run_jobs(generator: Generator, jobs: list[Job], dist: DistState, result: GenerateResult, desc: str,
             temperature: float | None = None) -> list[Answer]:
    """Every job's answer in job order, through one engine run (tokens and time added to `result`)."""
    answers: list[Answer | None] = [None] * len(jobs)
    start = time.perf_counter()
    bar = tqdm(total=len(jobs), unit="job", disable=not dist.is_main, dynamic_ncols=True,
               desc=f"{desc} (rank 0 of {dist.world_size})")

    def take(index: int, answer: Answer) -> None:
        answers[index] = answer
        result.tokens += len(answer.token_ids)
        bar.update(1)

    if jobs:
        generator.run(jobs, take, temperature=temperature)
    bar.close()
    result.seconds += time.perf_counter() - start
    return answers


def two_turn_shards(generator: Generator, tokenizer, shards: dict[int, list[Prompt]], out: Path,
                    options: GenerateOptions, max_length: int, dist: DistState, result: GenerateResult) -> None:
    """--turns 2: the first answers; the target's follow-up user turn after each one not cut (sampled at
    --ask-temperature); the answers to those; then every shard, each row the longest conversation made
    (a first answer whose follow-up was dropped stays a one-turn row, counted by reason)."""
    jobs = plan_jobs(shards, options)
    answers = run_jobs(generator, jobs, dist, result, "answer")
    result.answers += len(answers)
    result.cut += sum(answer.cut for answer in answers)
    made = list(zip(jobs, answers))
    asking = [i for i, answer in enumerate(answers) if not answer.cut]
    if len(asking) < len(jobs):
        result.follow_up_dropped[FIRST_ANSWER_CUT] = (result.follow_up_dropped.get(FIRST_ANSWER_CUT, 0)
                                                      + len(jobs) - len(asking))
    asks = [follow_up_ask_job(jobs[i], answers[i], tokenizer) for i in asking]
    follow_ups, owners = [], []
    for i, ask, turn in zip(asking, asks, run_jobs(generator, asks, dist, result, "follow-up ask",
                                                   options.ask_temperature)):
        prompt = asked_prompt(ask.prompt, turn, tokenizer, max_length)
        if isinstance(prompt, str):
            result.follow_up_dropped[prompt] = result.follow_up_dropped.get(prompt, 0) + 1
            continue
        follow_ups.append(follow_up_answer_job(ask, prompt))
        owners.append(i)
    for i, job, answer in zip(owners, follow_ups, run_jobs(generator, follow_ups, dist, result, "follow-up answer")):
        made[i] = (job, answer)
        result.follow_ups += 1
        result.answers += 1
        result.cut += answer.cut
    for k in shards:
        write_text_atomic(shard_path(out, k), "".join(json.dumps(output_row(job, answer), ensure_ascii=False) + "\n"
                                                      for job, answer in made if job.shard == k))
        result.shards_written += 1


def ask_shards(generator: Generator, tokenizer, shards: dict[int, list[Prompt]], options: GenerateOptions,
               max_length: int, dist: DistState, result: GenerateResult) -> dict[int, list[Prompt]]:
    """--ask-temperature: the target writes the rest of every prompt's last user turn (each from its own
    sampling stream, so a resumed shard gets the same prompts), and those prompts replace the rows'; the
    ones it did not finish, or left empty or too long, are dropped and counted by reason."""
    jobs = [ask_job(prompt, tokenizer, k) for k, prompts in shards.items() for prompt in prompts]
    asked = [asked_prompt(job.prompt, answer, tokenizer, max_length)
             for job, answer in zip(jobs, run_jobs(generator, jobs, dist, result, "ask", options.ask_temperature))]
    kept: dict[int, list[Prompt]] = {k: [] for k in shards}
    for job, made in zip(jobs, asked):
        if isinstance(made, Prompt):
            kept[job.shard].append(made)
            result.asked += 1
        else:
            result.ask_dropped[made] = result.ask_dropped.get(made, 0) + 1
    return kept


def content_identity(config: Config, options: GenerateOptions, checkpoint: Path, tokenizer) -> dict:
    """What the answers depend on: the rows, the target, its template and the decoding settings
    (not the batch size, device or number of processes)."""
    return {
        "source": chat.content_fingerprint(config.data.source, config.data.split),
        "target_weights": weights_fingerprint(checkpoint),
        "tokenizer": tokenizer_identity(tokenizer)["hash"],
        "max_length": config.data.max_length,
        **{key: value for key, value in asdict(options).items()
           if key in ("max_new_tokens", "temperature", "top_p", "top_k", "num_samples", "with_greedy", "seed",
                      "rows_per_shard", "limit")},
        **({"ask_temperature": options.ask_temperature} if options.ask_temperature > 0 else {}),
        **({"turns": options.turns} if options.turns > 1 else {}),
    }


def report_plan(result: GenerateResult, num_shards: int, num_done: int) -> None:
    skipped = sum(len(rows) for rows in result.bad_rows.values())
    print(f"data: {result.num_rows} rows, {result.num_prompts} prompts, {skipped} skipped")
    for reason, rows in sorted(result.bad_rows.items()):
        examples = ", ".join(str(r + 1) for r in rows[:5])
        print(f"  skipped {len(rows)} row(s): {reason} (e.g. rows {examples})")
    print(f"plan: {num_shards} shards, {num_done} already written")


def summarize(dist: DistState, result: GenerateResult, options: GenerateOptions) -> None:
    reasons = (ASKED_CUT, ASKED_EMPTY, BAD_PROMPT_TOO_LONG)
    follow_up_reasons = (FIRST_ANSWER_CUT, *reasons)
    totals = all_reduce_sum(dist, [result.shards_written, result.shards_kept, result.answers, result.tokens,
                                   result.cut, result.seconds, result.asked,
                                   *(result.ask_dropped.get(reason, 0) for reason in reasons), result.follow_ups,
                                   *(result.follow_up_dropped.get(reason, 0) for reason in follow_up_reasons)])
    if not dist.is_main:
        return
    written, kept, answers, tokens, cut = (int(v) for v in totals[:5])
    seconds = totals[5] / dist.world_size
    if options.ask_temperature > 0:
        asked, dropped = int(totals[6]), [int(v) for v in totals[7:10]]
        print(f"asked: the target wrote {asked + sum(dropped)} prompts (temperature {options.ask_temperature:g}), "
              f"{asked} answered; dropped {dropped[0]} it did not end within --max-new-tokens, {dropped[1]} empty, "
              f"{dropped[2]} of data.max_length tokens or more (tokens below count the prompts it wrote too)")
    if options.turns > 1:
        follow_ups, kept = int(totals[10]), [int(v) for v in totals[11:]]
        print(f"turns: {follow_ups} two-turn rows; one-turn rows kept: {kept[0]} whose first answer was cut, "
              f"{kept[1]} whose follow-up the target did not end within --max-new-tokens, {kept[2]} empty, {kept[3]} "
              f"of data.max_length tokens or more (answers and cut below count both turns')")
    rate = f"{tokens / seconds:,.0f} tokens/s" if seconds > 0 else "-"
    print(f"generate done: {answers} answers, {tokens:,} tokens in {seconds:.1f} s ({rate} over "
          f"{dist.world_size} process(es)); {cut} cut at --max-new-tokens ({options.max_new_tokens}); "
          f"{written} shards written, {kept} kept from an earlier run")
    print(f"train on them: --set data.source=\"{options.out}\" (stage one reads every part-*.jsonl)")
