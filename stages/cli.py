"""The `dflash` command line: parses options, loads the config and calls a stage's `run`.

Every command that takes a config reads TOML (`-c`; the embedded tiny default without it)
and accepts any number of `--set section.key=value` overrides. It lives beside the stages it
calls, so the library (dflash/) never imports them; `python -m stages.cli` runs it too.
"""

import errno
import os
import sys

import click

from dflash.config import load_config
from dflash.errors import DflashError
from dflash.interrupts import EXIT_INTERRUPTED, interrupted_line

CONFIG_HELP = "TOML config file (default: the embedded tiny config, configs/tiny.toml)."
SET_HELP = "Override one config value, e.g. --set train.lr=3e-4 (repeatable)."


def config_options(command):
    command = click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help=SET_HELP)(command)
    command = click.option("-c", "--config", "config_path", type=click.Path(dir_okay=False), help=CONFIG_HELP)(command)
    return command


def load_or_exit(config_path, overrides, extra=()):
    """The config, or a ConfigError that `Commands` prints as one `Error:` line (exit status 1)."""
    return load_config(config_path, [*overrides, *extra])


def writes(*paths) -> None:
    """Name what this command writes, so that a full disk can be reported with its place."""
    context = click.get_current_context().find_root()
    context.obj = {"outputs": [str(path) for path in paths]}


def relaunch_without_gpus(gpus: str) -> None:
    """Re-run this very command under torchrun on the given GPUs, then exit with its code."""
    from dflash.dist import launch_on_gpus

    args, skip = [], False
    for arg in sys.argv[1:]:
        if skip:
            skip = False
        elif arg == "--gpus":
            skip = True
        elif not arg.startswith("--gpus="):
            args.append(arg)
    sys.exit(launch_on_gpus(gpus, "stages.cli", args))


def under_torchrun() -> bool:
    import os

    return "LOCAL_RANK" in os.environ


def is_expected(error: BaseException) -> bool:
    """Failures a user can act on: ours, a missing or unreadable path, a full disk."""
    return isinstance(error, (DflashError, FileNotFoundError, NotADirectoryError, PermissionError)) or (
        isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT))


def one_line(error: BaseException, outputs: list[str]) -> str:
    """The error's message; a full disk names the file, or else the outputs the command writes."""
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
        where = error.filename or " or ".join(outputs) or "the output directory"
        return f"no space left on the device writing {where} ({error.strerror or error})"
    return str(error) or type(error).__name__


class Commands(click.Group):
    """Expected failures end as one `Error: ...` line and exit status 1, without a traceback
    (`--debug` or DFLASH_DEBUG=1 keeps it); Ctrl-C ends as one `Interrupted: ...` line and exit
    status 130. Click's own usage errors (an unknown option, a missing argument) keep status 2."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            if ctx.params.get("debug") or os.environ.get("DFLASH_DEBUG"):
                raise
            click.echo(interrupted_line(ctx.invoked_subcommand or ""), err=True)
            ctx.exit(EXIT_INTERRUPTED)
        except Exception as error:
            if not is_expected(error) or ctx.params.get("debug") or os.environ.get("DFLASH_DEBUG"):
                raise
            raise click.ClickException(one_line(error, (ctx.obj or {}).get("outputs", []))) from None


@click.group(cls=Commands, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option("--debug", is_flag=True, help="Show the full traceback of an error (or set DFLASH_DEBUG=1).")
@click.version_option(package_name="dflash")
def main(debug):
    """Train DFlash drafters offline.

    \b
    1. stage1-extract  run the frozen target over chat data, cache its layer outputs
    2. stage2-train    train the drafter from that cache alone
    3. inspect-cache   statistics and verification of a cache
    4. export          write a checkpoint in the format inference engines load
    5. eval            served acceptance: speculative decoding with the target and an export
       time-evals      the speed figures of evals served with --defer-timing, decoded again alone
    6. generate        regenerate a dataset's answers with the target (train on what it says)
    7. config show     every config key with its value, default and meaning
    8. recipe          the whole pipeline, generate to served eval, resumable, with a report
    """


@main.command("stage1-extract", short_help="Run the target over the data, store its hidden states.")
@config_options
@click.option("--gpus", help="Comma-separated GPU ids, one process each via torchrun (e.g. 0,1,2,3,4).")
@click.option("--overwrite", is_flag=True, help="Replace a store that was made with a different config.")
def stage1_extract(config_path, overrides, gpus, overwrite):
    """Run the target over the dataset and write its hidden states to the store.

    Tokenizes the data (cached), plans length buckets and shards, then writes each shard
    atomically. Rerunning resumes: only missing shards are computed. Under torchrun each
    rank writes its own shards.
    """
    if gpus and not under_torchrun():
        relaunch_without_gpus(gpus)
    config = load_or_exit(config_path, overrides, ["store.overwrite=true"] if overwrite else [])
    writes(config.store.path, config.data.cache_dir)
    from stages import extract

    extract.run(config)


@main.command("stage2-train", short_help="Train the drafter from a stage-one store (no target needed).")
@config_options
@click.option("--gpus", help="Comma-separated GPU ids, one DDP process each via torchrun (e.g. 5,6,7).")
@click.option("--resume", is_flag=False, flag_value="latest", default=None, metavar="[PATH]",
              help="Resume from the latest checkpoint in train.out_dir, or from PATH.")
@click.option("--follow", is_flag=True,
              help="Train while stage one is still writing the store (train.follow): new shards join the first "
                   "epoch as they complete, every step still mixes lengths, later epochs start once it is finished.")
def stage2_train(config_path, overrides, gpus, resume, follow):
    """Train the DFlash drafter from a stage-one store (no target model needed).

    Reads store.path (refused if its layer ids, hidden size or vocabulary do not match the
    drafter), trains with mixed-length micro-batches per optimizer step, evaluates a
    held-out split, and writes metrics.jsonl and checkpoints under train.out_dir. SIGTERM
    saves a final checkpoint; --resume continues the same data order, also on another number
    of GPUs (train.accum_steps is rescaled so that every optimizer step keeps its micro-batches).
    --follow starts on a store that stage one is still writing (train.follow).
    """
    if gpus and not under_torchrun():
        relaunch_without_gpus(gpus)
    config = load_or_exit(config_path, overrides, ["train.follow=true"] if follow else [])
    writes(config.train.out_dir)
    from stages import train

    train.run(config, resume=resume)


@main.command("inspect-cache", short_help="Bucket and shard statistics of a store; verify it.")
@click.argument("store", type=click.Path())
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON only.")
@click.option("--verify", is_flag=True, help="Read every chunk; check checksums, shapes, NaN/Inf, completion marks.")
@click.option("--per-shard", is_flag=True, help="Also print one row per shard.")
@click.option("--plot", type=click.Path(dir_okay=False), help="Write a PNG of the length distribution by bucket.")
@click.option("--repair", is_flag=True,
              help="With --verify: remove the bad shards, so that rerunning stage one rewrites them.")
def inspect_cache(store, as_json, verify, per_shard, plot, repair):
    """Show bucket (and shard) statistics of STORE and optionally verify it.

    Exits with status 1 when --verify finds a bad shard (also after --repair removed it:
    the store is incomplete until stage one rewrites it).
    """
    if repair and not verify:
        raise click.UsageError("--repair needs --verify (it removes what verification finds bad)")
    from stages import inspect

    result = inspect.run(store, as_json=as_json, verify=verify, per_shard=per_shard, plot=plot, repair=repair)
    if verify and not result["ok"]:
        sys.exit(1)


@main.command("export", short_help="Write a checkpoint as inference engines load it.")
@click.argument("checkpoint", type=click.Path(file_okay=False))
@click.argument("out_dir", type=click.Path(file_okay=False))
def export(checkpoint, out_dir):
    """Export a training CHECKPOINT directory to OUT_DIR in the inference format.

    OUT_DIR gets config.json (Qwen3 config with dflash_config), model.safetensors and
    modeling_dflash.py, the drafter's class and decoding loop that engines load with
    trust_remote_code (docs/INTERNALS.md lists the fields they read).
    """
    writes(out_dir)
    from stages import export as export_stage

    path = export_stage.run(checkpoint, out_dir)
    click.echo(f"exported {checkpoint} -> {path}")


@main.command("eval", short_help="Served acceptance: speculative decoding with the target.")
@config_options
@click.option("--drafter", "drafter_dirs", required=True, multiple=True, type=click.Path(file_okay=False),
              help="An exported drafter directory (from `dflash export`); repeat it to compare several "
                   "drafters on the same prompts and baseline.")
@click.option("--prompts", default="heldout", show_default=True,
              help="'heldout': the samples stage two held out of the config's store ('heldout:NAME': those of "
                   "the store's data.mix source NAME); or a data source "
                   "(JSONL/JSON/Parquet file or directory, embedded:NAME, hub name), rendered up to its last answer.")
@click.option("--num-prompts", default=32, show_default=True, help="How many prompts (the first ones).")
@click.option("--match", default="", help="Only prompts whose rendered text matches this regular expression "
                                          "(searched anywhere in it).")
@click.option("--exclude", default="", help="Leave out prompts whose rendered text matches this regular expression "
                                            "(e.g. one source's wording among the held-out prompts of a mix).")
@click.option("--max-new-tokens", default=256, show_default=True, help="Tokens generated per prompt at most.")
@click.option("--temperature", default=0.0, show_default=True,
              help="0: greedy, every output token checked against the target's greedy choice; > 0: sampling with "
                   "the lossless speculative acceptance rule.")
@click.option("--proposal", "proposals", default="auto", show_default=True,
              help="How a block's drafts come from the drafter's per-slot distributions: "
                   "argmax (the target keeps a draft x with p(x)), sample (per-slot draws from q), sample:F (draws "
                   "at F x the temperature), tree:N (N drafts as a tree from the slots' top tokens, verified in "
                   "one forward; tree:N:F builds it from softmax(logits / F); lossless at any temperature, not "
                   "the chain's tokens at 0; full-attention targets only), stree:N or stree:N:F (at T > 0 the "
                   "tree's children drawn from q at F x the temperature and kept by recursive rejection sampling; "
                   "tree:N at 0); a tree's size may name its width, tree:NxW / stree:NxW (at most W children a "
                   "node, 8 without); a comma-separated list serves each on "
                   "the same prompts and baseline. auto (the default) is, where the target can verify a tree, "
                   "tree:64x16 at T=0 and stree:256x32 at T > 0, else sample: on held-out code-docs (12-05) tree:64 "
                   "served 1.47x the chain's tau at T=0, and alone a tree's step costs about a chain's (1.20 against "
                   "1.21 x tau at T=0 on an H200, 12-06); at T=1 stree:256 served 2.31-2.49 against tree:64's "
                   "1.78-1.99 and the chain's 1.69-1.72 (12-06, two H100 runs), and 32 children a node rather than 8 "
                   "2.715 against 2.562 (2.968 -> 3.244 at 0.7; H100, 12-06 16:45); sample beat argmax at 0.7 and 1 "
                   "(12-04); 16 children a node rather than 8 served 2.542 against 2.443 on 24 chat prompts at T=0 "
                   "(CPU, 12-06; docs/eval.md).")
@click.option("--seed", default=0, show_default=True,
              help="Sampling seed (temperature > 0): prompt i's draws start from seed + i.")
@click.option("--device", default="auto", show_default=True, help="auto (cuda when available), cpu, cuda, cuda:N.")
@click.option("--out", type=click.Path(dir_okay=False),
              help="Write every number, per prompt too, as JSON. Each prompt's results go to OUT.partial.jsonl as "
                   "it ends: a killed eval rerun with the same options and drafters continues from there.")
@click.option("--plot", type=click.Path(dir_okay=False),
              help="Write a PNG: histogram of tokens per verification and per-slot acceptance.")
@click.option("--workers", default=1, show_default=True, type=click.IntRange(min=1),
              help="Processes side by side on the device, each serving a contiguous share of the prompts with its "
                   "own target; their results are merged as one run's (the same numbers as --workers 1: every "
                   "random stream restarts at each prompt from --seed plus its index). Batch-1 decoding of a "
                   "small target is bound by the host, so a GPU serves several at once.")
@click.option("--timed-prompts", default=0, show_default=True, type=click.IntRange(min=0),
              help="Only N prompts' times, spread evenly over the set, make tokens/s and the speedup (0: every "
                   "prompt's); tau counts every prompt. The others skip the plain baseline (only the speed figure). "
                   "With --workers the workers serve every prompt untimed and, once they have ended, this process "
                   "decodes the N again alone on the device (0: every prompt again): times taken beside other "
                   "processes are not served ones.")
@click.option("--defer-timing", is_flag=True,
              help="Serve every prompt untimed and write the JSON without speed figures; `dflash time-evals` decodes "
                   "the timed prompts again later, in one process alone on the device (`dflash recipe` runs its "
                   "evals side by side so, then times them all at the end).")
@click.option("--drafter-graphs/--no-drafter-graphs", default=True, show_default=True,
              help="On a GPU, capture the drafter's block once as a CUDA graph and replay it per verification (its "
                   "few hundred kernel launches become one; the same logits as the eager drafter, tested), and at T > 0 "
                   "a sampled tree's verdicts likewise (one replay per tree shape, the same verdicts as eager, "
                   "tested); off: both run eagerly.")
@click.option("--target-graphs/--no-target-graphs", default=False, show_default=True,
              help="Serve the target (plain baseline and verifications alike) over a static KV cache with each "
                   "forward's shape replayed as a CUDA graph, as serving engines run it, instead of transformers' "
                   "forward with its dynamic cache (one Python pass over every layer a token: for a small target "
                   "that pass is the token's whole cost, and it varies). Llama, Mistral, Qwen2, Qwen3 targets; the "
                   "same features and logits as transformers' forward (tested); others keep transformers'.")
@click.option("--shard", default="", hidden=True, help="I/K: serve only the I-th of K contiguous shares (--workers).")
def evaluate(config_path, overrides, drafter_dirs, prompts, num_prompts, match, exclude, max_new_tokens, temperature,
             proposals, seed, device, out, plot, workers, timed_prompts, defer_timing, drafter_graphs, target_graphs,
             shard):
    """Measure an exported drafter as it is served: speculative decoding with the target.

    The target is the config's target.path (checkpoint directory, .gguf file or embedded:tiny).
    For every prompt the target decodes once plainly and once with the drafter (the loop in
    dflash/model/modeling_dflash.py that exports carry). Prints the acceptance length tau (tokens
    committed per target forward), its histogram, per-slot acceptance, the speedup over
    plain greedy decoding, and whether the outputs are identical (temperature 0; where they
    differ, the target's logits there tell a rounding near-tie of a bf16 target from a real
    mismatch).
    """
    config = load_or_exit(config_path, overrides)
    from stages import evaluate as evaluate_stage

    options = evaluate_stage.EvalOptions(drafters=drafter_dirs, prompts=prompts, num_prompts=num_prompts,
                                         match=match, exclude=exclude, max_new_tokens=max_new_tokens,
                                         temperature=temperature, proposals=tuple(proposals.split(",")),
                                         seed=seed, device=device, out=out or "",
                                         plot=plot or "", workers=workers, shard=shard,
                                         timed_prompts=timed_prompts, defer_timing=defer_timing,
                                         drafter_graphs=drafter_graphs, target_graphs=target_graphs)
    config_args = (["-c", config_path] if config_path else []) + [item for override in overrides
                                                                   for item in ("--set", override)]
    evaluate_stage.run(config, options, config_args)


@main.command("time-evals", short_help="Time evals' prompts alone on the device, after they were served.")
@config_options
@click.argument("eval_jsons", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False))
@click.option("--device", default="auto", show_default=True, help="auto (cuda when available), cpu, cuda, cuda:N.")
@click.option("--summary", type=click.Path(dir_okay=False), help="Write a JSON naming each eval and what was done.")
@click.option("--target-graphs/--no-target-graphs", default=None,
              help="Time the target as CUDA graphs over a static cache (as engines serve it), or with transformers' "
                   "forward; default: as each eval was served. The JSON's target_graphs says which.")
@click.option("--again", is_flag=True,
              help="Time JSONs timed already too, their speed figures replaced (e.g. copies, timed the other way).")
def time_evals(config_path, overrides, eval_jsons, device, summary, target_graphs, again):
    """Fill in the speed figures of evals served with --defer-timing.

    For each EVAL_JSON written by `dflash eval --defer-timing --out EVAL_JSON` (the config must name the
    target it served), decodes its --timed-prompts prompts again, plainly and with every drafter and
    policy it served, in this one process, and writes the JSON back with tokens/s and the speedup
    from those times (the timed decodes replace their untimed ones; tau stays over every prompt).
    Run it when nothing else uses the device: times taken beside other processes are not served
    ones. JSONs timed already are left as they are. `dflash recipe` runs it after its evals.
    """
    config = load_or_exit(config_path, overrides)
    from stages import evaluate as evaluate_stage

    evaluate_stage.time_evals(config, list(eval_jsons), device, summary or "", target_graphs, again)


@main.command("generate", short_help="Regenerate a dataset's answers with the target.")
@config_options
@click.option("--out", required=True, type=click.Path(file_okay=False),
              help="Output directory: part-NNNNN.jsonl shards that data.source reads, and a manifest.")
@click.option("--max-new-tokens", default=1024, show_default=True,
              help="Answer tokens at most (longer ones are cut and counted).")
@click.option("--temperature", default=0.0, show_default=True, help="0: greedy; > 0: sampling at this temperature.")
@click.option("--top-p", default=1.0, show_default=True, help="Nucleus sampling mass (with --temperature > 0).")
@click.option("--top-k", default=0, show_default=True,
              help="Sample among the K most likely tokens only (0: the whole vocabulary).")
@click.option("--num-samples", default=1, show_default=True,
              help="Sampled answers per prompt (needs --temperature > 0); rows carry their sample index 1..N.")
@click.option("--with-greedy", is_flag=True,
              help="With sampling, also write each prompt's greedy answer (sample index 0).")
@click.option("--seed", default=0, show_default=True,
              help="Sampling seed: every answer draws from its own stream of (seed, source row, sample), "
                   "so a resumed run draws the same.")
@click.option("--engine", type=click.Choice(["auto", "slots", "generate"]), default="auto", show_default=True,
              help="slots: continuous batching with CUDA graphs (Llama, Mistral, Qwen2, Qwen3 targets); generate: "
                   "transformers' generate; auto: slots where the target allows it, else generate (says so).")
@click.option("--decode-attention", type=click.Choice(["auto", "flex", "sdpa"]), default="auto", show_default=True,
              help="The slots engine's decode attention: flex reads each slot's own keys (its decoding kernel), sdpa "
                   "reads the cache up to the longest row in flight; auto: flex on CUDA, sdpa on the CPU.")
@click.option("--batch-size", default=0, show_default=True,
              help="Rows decoded at once (0: as many slots as half the free GPU memory holds, at most 1024, with "
                   "the slots engine; 256 prompts per call with generate; 8 on the CPU).")
@click.option("--cache-share", default=0.0, show_default=True,
              help="With --batch-size 0 and the slots engine: the KV cache's share of the GPU's whole memory (0: half "
                   "of what is free at the start). Side-by-side generates on one GPU (`dflash recipe`) pass an equal "
                   "share each, so the last to start is not left the scraps.")
@click.option("--rows-per-shard", default=1024, show_default=True,
              help="Prompts per output file (the unit a resume keeps); each holds all their answers.")
@click.option("--limit", default=0, show_default=True, help="Only the first N usable rows (0: all).")
@click.option("--static-cache", type=click.Choice(["auto", "on", "off"]), default="auto", show_default=True,
              help="--engine generate: transformers' static KV cache and compiled decoding (auto: on CUDA).")
@click.option("--device", default="auto", show_default=True,
              help="auto (cuda:<local rank> when available), cpu, cuda:N.")
@click.option("--gpus", help="Comma-separated GPU ids, one process each via torchrun (e.g. 0,1,2,3).")
@click.option("--overwrite", is_flag=True, help="Replace answers generated with other settings in --out.")
@click.option("--ask-temperature", default=0.0, show_default=True,
              help="> 0: the target first writes each row's last user turn, continuing the row's text (a start "
                   "such as embedded:ask-code's \"Write a Python function\") at this temperature until it ends the "
                   "turn, then answers the prompt it wrote (rows marked \"asked\"); prompts it does not end "
                   "within --max-new-tokens are dropped and counted. 0: the rows' prompts as they are.")
@click.option("--turns", type=click.IntRange(1, 2), default=1, show_default=True,
              help="2: after each answer not cut, the target writes a follow-up user turn (from a start such as "
                   "\"Can you\", at --ask-temperature, which must be > 0) and answers it: two-turn rows.")
def generate(config_path, overrides, out, max_new_tokens, temperature, top_p, top_k, num_samples, with_greedy, seed,
             engine, decode_attention, batch_size, cache_share, rows_per_shard, limit, static_cache, device, gpus,
             overwrite, ask_temperature, turns):
    """Regenerate the answers of data.source with the target, for training on what it would say.

    Each row is rendered up to its last assistant turn with the chat template stage one uses;
    the target writes that turn (greedy, or --num-samples sampled answers, with --with-greedy
    the greedy one beside them); earlier turns are kept. Rows go out in source order as JSONL
    shards written atomically, so a killed run resumes (finished shards are kept). It says which
    decoding path runs, and its summary the tokens/s. Point data.source at --out to build a store
    from the answers (docs/generate.md). With --ask-temperature the target writes the prompts too
    (from starts such as `data.source = "embedded:ask-general"`'s), then answers them; with --turns 2
    it then writes a follow-up user turn after each answer and answers that too.
    """
    if gpus and not under_torchrun():
        relaunch_without_gpus(gpus)
    config = load_or_exit(config_path, overrides)
    writes(out)
    from stages import generate as generate_stage

    options = generate_stage.GenerateOptions(
        out=out, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
        num_samples=num_samples, with_greedy=with_greedy, seed=seed, engine=engine, decode_attention=decode_attention,
        batch_size=batch_size, cache_share=cache_share, rows_per_shard=rows_per_shard, limit=limit, device=device,
        static_cache=static_cache,
        overwrite=overwrite, ask_temperature=ask_temperature, turns=turns)
    generate_stage.run(config, options)


@main.command("recipe", short_help="The whole pipeline in one resumable command, then a report.")
@config_options
@click.option("--from", "start_from", metavar="PART",
              help="Rerun from this part's phase on (generate, extract, train, export, eval, walk, time, or a part "
                   "name such as eval-heldout-t0): its records and every later one are deleted first.")
@click.option("--until", "until", metavar="PHASE",
              help="Stop after this phase (generate, extract, train, export, eval, walk): e.g. --until extract builds "
                   "the store once, for stage2-train runs of your own from it; a rerun without --until continues.")
@click.option("--report", "report_dir", type=click.Path(file_okay=False), metavar="RUN_DIR",
              help="Only render RUN_DIR's report.md and plots again from its report.json; runs nothing.")
def recipe(config_path, overrides, start_from, until, report_dir):
    """The whole pipeline in one resumable command: generate -> stage1-extract -> stage2-train -> export
    -> eval -> the teacher-forced walk -> the evals served side by side timed alone (time-evals), then a
    report.

    Settings: the config's [generate], [eval] and [recipe] sections ([[recipe.sources]]: what the
    target answers; [[recipe.evals]]: the prompts served, at which temperatures; recipe.run_dir: where
    everything goes; `dflash config show` lists them). Without -c: configs/tiny-recipe.toml (the tiny
    embedded target, CPU, a minute or two). Each part runs as its own `dflash` subprocess and writes
    run_dir/results/PART.json when it succeeded; a rerun skips complete parts and continues a killed
    one (generate's and stage one's shards, stage two's checkpoints). Writes run_dir/report.md,
    report.json and plots/*.png.
    """
    from stages import recipe as recipe_stage

    if report_dir:
        recipe_stage.rerender(report_dir)
        return
    config_path = config_path or recipe_stage.default_config_path()
    config = load_or_exit(config_path, overrides)
    writes(config.recipe.run_dir)
    recipe_stage.run(config, config_path, overrides, start_from, until)


@main.group("config")
def config_group():
    """Inspect configs."""


@config_group.command("show", short_help="Every config key with its value, default and meaning.")
@config_options
def config_show(config_path, overrides):
    """Print every config key with its value (after -c and --set), default and meaning."""
    from dflash.config import describe, show_value

    rows = describe(load_or_exit(config_path, overrides))
    width = max(len(key) for key, *_ in rows)
    for key, value, default, meaning in rows:
        shown = show_value(value)
        if value != default:
            shown += f"  (default {show_value(default)})"
        click.echo(f"{key:<{width}}  {shown}\n{'':<{width}}  {meaning}")


if __name__ == "__main__":
    main()
