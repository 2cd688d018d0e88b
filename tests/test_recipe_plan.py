"""`dflash recipe`'s planning, completion records, --from and report, without running a stage: the parts'
commands from the config, which records a rerun trusts, and a report rendered from fixture JSON whose
numbers are the eval JSON's."""

import json
import os
import sys
from pathlib import Path

import pytest

from dflash.config import ConfigError, load_config
from dflash.pipeline import records, report
from dflash.pipeline.parts import RecipeRun, eval_parts, generate_parts, train_parts, walk_parts
from stages import recipe as recipe_stage

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "configs" / "tiny-recipe.toml")


def recipe_run(tmp_path, *overrides: str) -> RecipeRun:
    sets = (f"recipe.run_dir={tmp_path / 'run'}", *overrides)
    return RecipeRun(load_config(TINY, sets), TINY, sets)


def option(command: list[str], flag: str) -> str | None:
    return command[command.index(flag) + 1] if flag in command else None


def test_one_source_trains_on_its_answers_and_leaves_default_flags_out(tmp_path):
    run = recipe_run(tmp_path)
    (generate,) = generate_parts(run)
    assert generate.command[:4] == [sys.executable, "-m", "stages.cli", "generate"]
    assert option(generate.command, "--out") == str(tmp_path / "run" / "answers" / "code-docs")
    assert option(generate.command, "--num-samples") == "1" and "--with-greedy" in generate.command
    assert "--turns" not in generate.command and "--ask-temperature" not in generate.command
    assert generate.command[-1 - generate.command[::-1].index("--set") + 1] == "data.source=embedded:code-docs"
    (train,) = train_parts(run)
    assert f"data.source={tmp_path / 'run' / 'answers' / 'code-docs'}" in train.command
    assert not any(item.startswith("data.mix") for item in train.command) and train.resume_args == []


def test_several_sources_are_a_data_mix_and_their_flags_pass_when_set(tmp_path):
    sources = ('recipe.sources=[{name = "a", source = "embedded:code-docs", weight = 3.0, turns = 2}, '
               '{name = "b", source = "embedded:ask-code", ask_temperature = 1.0, limit = 5}]')
    run = recipe_run(tmp_path, sources, 'recipe.evals=[{name = "h", prompts = "heldout:a", proposals = ["x", "y"]}]')
    first, second = generate_parts(run)
    assert option(first.command, "--turns") == "2" and option(second.command, "--ask-temperature") == "1"
    assert option(second.command, "--limit") == "5" and "--num-samples" not in second.command
    # side by side on one GPU, each generate's KV cache gets an equal share of it (not half of what is left)
    shared = generate_parts(recipe_run(tmp_path, sources, "recipe.parallel_generates=true"))
    assert [option(part.command, "--cache-share") for part in shared] == ["0.3500", "0.3500"]
    alone = generate_parts(recipe_run(tmp_path, sources, "recipe.parallel_generates=false"))
    assert not any("--cache-share" in part.command for part in alone)
    mix = next(item for item in train_parts(run)[0].command if item.startswith("data.mix="))
    loaded = load_config(TINY, [mix]).data.mix
    assert [(source.name, source.weight) for source in loaded] == [("a", 3.0), ("b", 1.0)]
    assert loaded[0].source == str(tmp_path / "run" / "answers" / "a")
    (checkpoint := tmp_path / "run" / "drafter" / "checkpoints" / "step-00000002").mkdir(parents=True)
    (checkpoint / "state.pt").write_bytes(b"")
    (served,) = eval_parts(run)
    assert option(served.command, "--proposal") == "x,y" and option(served.command, "--prompts") == "heldout:a"
    assert walk_parts(run)[0].command[-1] == str(tmp_path / "run" / "evals" / "walk.json")


def test_two_sources_of_one_name_are_refused(tmp_path):
    run = recipe_run(tmp_path, 'recipe.sources=[{source = "embedded:code-docs"}, {source = "x/code-docs.jsonl"}]')
    with pytest.raises(ConfigError, match="named 'code-docs'"):
        generate_parts(run)


def test_a_record_holds_for_its_own_command_and_outputs_and_from_clears_later_phases(tmp_path):
    run = recipe_run(tmp_path)
    (part,) = generate_parts(run)
    assert not records.is_complete(run.layout, part)
    records.write_record(run.layout, part, 1.5, part.command, {"answers": 4})
    assert not records.is_complete(run.layout, part)  # its output (the manifest) is missing
    part.outputs[0].parent.mkdir(parents=True)
    part.outputs[0].write_text("{}")
    assert records.is_complete(run.layout, part)
    changed = generate_parts(recipe_run(tmp_path, "generate.max_new_tokens=99"))[0]
    assert not records.is_complete(run.layout, changed)  # another command: run again
    (train,) = train_parts(run)
    records.write_record(run.layout, train, 2.0, train.command, {})
    assert recipe_stage.start_phase(run, "train") == "train"
    assert [record["part"] for record in records.all_records(run.layout)] == ["generate-code-docs"]
    with pytest.raises(ConfigError, match="--from nope"):
        recipe_stage.start_phase(run, "nope")


def fixture_run(root: Path) -> Path:
    """A finished run's JSON files: records, stage two's metrics, one eval of two drafters and a walk."""
    (root / "results").mkdir(parents=True)
    (root / "drafter").mkdir()
    (root / "evals").mkdir()
    metrics = [{"step": 2, "tokens_seen": 100, "tokens_per_s": 50.0}, {"step": 2, "eval/tau": 1.5},
               {"step": 4, "tokens_seen": 200, "tokens_per_s": 50.0}, {"step": 4, "eval/tau": 2.5,
                                                                        "eval/served_tau": 2.25}]
    (root / "drafter" / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in metrics))
    result = {"drafter": str(root / "exports" / "export"), "temperature": 0.0, "num_prompts": 2, "tau": 2.375,
              "speedup": 1.75, "generated_tokens": 16, "verifications": 8, "histogram": [2, 3, 3],
              "slot_acceptance": [0.75, 0.375], "tau_in_code": 2.5, "verifications_in_code": 4,
              "tau_outside_code": 2.25, "verifications_outside_code": 4, "tau_by_kind": {"code": 2.5, "prose": 2.25}}
    earlier = {**result, "drafter": str(root / "exports" / "export-00000002"), "tau": 1.625, "speedup": 1.25}
    (root / "evals" / "eval-h-t0.json").write_text(json.dumps({"results": [result, earlier]}))
    (root / "evals" / "walk.json").write_text(json.dumps({"walks": [{
        "eval": str(root / "evals" / "eval-h-t0.json"), "drafter": result["drafter"], "checkpoint": "c",
        "walked_prompts": 2, "served_tau": 2.375, "served_tau_same_prompts": 2.375, "teacher_forced_tau": 2.5,
        "ratio": 2.5 / 2.375, "prompts": []}]}))
    made = [("generate-a", "generate", [str(root / "answers" / "a" / "generate-manifest.txt")],
             {"source": "a", "prompts": "embedded:code-docs", "weight": 1.0, "answers": 32}),
            ("train", "train", [str(root / "drafter" / "metrics.jsonl")], {"tokens_seen": 200, "steps": 4}),
            ("export", "export", [str(root / "exports" / "export" / "config.json")], {"step": 4}),
            ("export-00000002", "export", [str(root / "exports" / "export-00000002" / "config.json")], {"step": 2}),
            ("eval-h-t0", "eval", [str(root / "evals" / "eval-h-t0.json")],
             {"eval_set": "h", "prompts": "heldout", "temperature": 0.0, "generated_tokens": 32})]
    for name, phase, outputs, facts in made:
        record = {"part": name, "phase": phase, "command": [], "ran": [], "seconds": 4.0, "finished": "",
                  "outputs": outputs, "facts": facts}
        (root / "results" / f"{name}.json").write_text(json.dumps(record))
    return root


def test_the_report_copies_the_eval_json_and_renders_again_from_report_json(tmp_path):
    root = fixture_run(tmp_path / "run")
    recipe_stage.rerender(str(root))  # no report.json yet: gathered, then rendered
    gathered = json.loads((root / "report.json").read_text())
    (served,) = gathered["evals"]
    assert [(row["tau"], row["speedup"], row["step"], row["tokens_seen"]) for row in served["results"]] == [
        (2.375, 1.75, 4, 200), (1.625, 1.25, 2, 100)]
    assert served["results"][0]["tau_by_kind"] == {"code": 2.5, "prose": 2.25}
    assert gathered["train"]["heldout_tau"] == 2.5 and gathered["walk"][0]["teacher_forced_tau"] == 2.5
    assert [row["rate"] for row in gathered["parts"] if row["part"] == "train"] == [50.0]
    text = (root / "report.md").read_text()
    assert "| h | heldout | 0 |  | export | 4 | 200 | 2.375 | 1.75 | 2.500 | 2.250 | code 2.500, prose 2.250 |" in text
    for name in ("served-curve", "acceptance-lengths", "slot-acceptance"):
        assert (root / "plots" / f"{name}.png").stat().st_size > 0
    (root / "report.md").unlink()
    recipe_stage.rerender(str(root))  # from report.json alone
    assert (root / "report.md").read_text() == text


def test_the_report_says_what_sampling_keeps_of_greedy_tau():
    from dflash.pipeline.report import sampling_table

    def entry(name, temperature, *rows):
        return {"eval_set": name, "temperature": temperature, "results": [
            {"drafter": f"/run/exports/{drafter}", "step": step, "proposal": proposal, "tau": tau, "speedup": 1.5,
             "timed_prompts": 3, "num_prompts": 16} for drafter, step, proposal, tau in rows]}

    evals = [entry("docs", 0.0, ("export", 8, "sample", 3.0), ("export", 8, "tree:64", 4.0),
                   ("export-4", 4, "sample", 9.0)),  # an earlier checkpoint (the curve): its own drafter
             entry("docs", 1.0, ("export", 8, "sample", 1.5), ("export", 8, "tree:64", 2.4),
                   ("export", 8, "sample:1.5", 1.2)),
             entry("other", 1.0, ("export", 8, "sample", 1.0))]  # no T = 0 eval of its own: no row
    lines = sampling_table(evals)
    rows = [line for line in lines if line.startswith("| docs |")]
    assert rows == ["| docs | 1 | sample | export | 1.500 | 1.50 (3 alone) | 0.50 | 0.50 | 0.38 |",
                    "| docs | 1 | tree:64 | export | 2.400 | 1.50 (3 alone) | 0.60 | 0.80 | 0.60 |",
                    "| docs | 1 | sample:1.5 | export | 1.200 | 1.50 (3 alone) | - | 0.40 | 0.30 |"]
    assert not any(line.startswith("| other |") for line in lines)
    assert sampling_table([evals[0]]) == []  # nothing sampled
    evals[1]["results"][0]["target_graphs"] = True  # timed with the target as CUDA graphs: the cell says so
    assert "| 1.50 (3 alone, target graphs) |" in sampling_table(evals)[6]


def test_until_stops_after_its_phase_and_a_rerun_continues(tmp_path, monkeypatch, capsys):
    """`dflash recipe --until extract` runs generate and extract, writes no report, and says how to go on; a rerun
    without it skips them and runs the rest. A --until before the --from phase, or not a phase, is refused before
    --from clears anything."""
    from dflash.config import ConfigError
    from dflash.pipeline import runner
    from dflash.pipeline.parts import PHASES, Part
    from stages import recipe as recipe_stage

    run = recipe_run(tmp_path)
    made = tmp_path / "made"
    made.mkdir()

    def planner(phase):
        out = made / phase
        return lambda _run: [Part(phase, phase, [sys.executable, "-c", f"open({str(out)!r}, 'w').write('x')"], (out,))]

    for phase in PHASES:
        monkeypatch.setitem(runner.PLANNERS, phase, planner(phase))
    monkeypatch.setattr(runner, "facts", lambda run, part: {})  # the stand-ins write no store, answers or metrics
    monkeypatch.setattr(recipe_stage.report, "write_report", lambda layout: {"reported": True})
    assert recipe_stage.run(run.config, run.config_path, run.overrides, until="extract") == {}
    assert sorted(path.name for path in made.iterdir()) == ["extract", "generate"]
    assert "stopped after extract (--until): a rerun without --until continues from train" in capsys.readouterr().out
    with pytest.raises(ConfigError, match="--until extract comes before the phase the run starts from"):
        recipe_stage.run(run.config, run.config_path, run.overrides, start_from="train", until="extract")
    with pytest.raises(ConfigError, match="--until report: not a phase"):
        recipe_stage.run(run.config, run.config_path, run.overrides, until="report")
    assert records.read_record(run.layout, "extract") is not None  # nothing cleared by the refused runs
    assert recipe_stage.run(run.config, run.config_path, run.overrides) == {"reported": True}
    assert sorted(path.name for path in made.iterdir()) == sorted(PHASES)
    assert "recipe: extract: complete" in capsys.readouterr().out


def test_parts_side_by_side_each_recorded_and_a_failure_named(tmp_path, capsys):
    from dflash.pipeline.parts import Part
    from dflash.pipeline.runner import PartFailed, run_parts

    run = recipe_run(tmp_path)
    made = tmp_path / "made.txt"
    good = Part("walk", "walk", [sys.executable, "-c", f"open({str(made)!r}, 'w').write('x')"], (made,))
    bad = Part("walk-bad", "walk", [sys.executable, "-c", "raise SystemExit(3)"], ())
    with pytest.raises(PartFailed, match="walk-bad failed with exit code 3"):
        run_parts(run, [bad, good], at_once=True)
    assert records.is_complete(run.layout, good) and records.read_record(run.layout, "walk-bad") is None
    printed = capsys.readouterr().out
    assert "recipe: walk-bad, walk: side by side" in printed and "recipe: walk: done in" in printed


def test_parts_side_by_side_share_the_cpu_threads(tmp_path, monkeypatch):
    """Each of the parts started at once (and a follower) gets an equal share of OMP_NUM_THREADS, the budget, at
    least 1; a part run alone keeps the environment's."""
    from dflash.dist import share_threads
    from dflash.pipeline.parts import Part
    from dflash.pipeline.runner import run_parts

    assert share_threads(3, {"OMP_NUM_THREADS": "16"})["OMP_NUM_THREADS"] == "5"
    assert share_threads(32, {"OMP_NUM_THREADS": "16"})["OMP_NUM_THREADS"] == "1"
    assert share_threads(1, {})["OMP_NUM_THREADS"] == str(len(os.sched_getaffinity(0)))
    assert share_threads(2, {"OMP_NUM_THREADS": "junk"})["OMP_NUM_THREADS"] == str(
        max(1, len(os.sched_getaffinity(0)) // 2))
    run = recipe_run(tmp_path)
    monkeypatch.setenv("OMP_NUM_THREADS", "12")

    def part(name):
        out = tmp_path / f"{name}.txt"
        code = f"import os; open({str(out)!r}, 'w').write(os.environ['OMP_NUM_THREADS'])"
        return Part(name, "walk", [sys.executable, "-c", code], (out,)), out

    (a, a_out), (b, b_out), (c, c_out), (alone, alone_out) = (part(name) for name in ("a", "b", "c", "alone"))
    run_parts(run, [a, b], at_once=True, following=[(c, {"a"})])
    run_parts(run, [alone], at_once=False)
    assert [path.read_text() for path in (a_out, b_out, c_out, alone_out)] == ["4", "4", "4", "12"]


def test_a_follower_starts_beside_the_rest_once_what_it_reads_is_written(tmp_path, capsys):
    """Side by side, each part is recorded when it ends (its own time, not the slowest before it), and the
    follower starts as soon as the part it reads has ended, beside the part still running; after a failure a
    follower does not start."""
    from dflash.pipeline.parts import Part
    from dflash.pipeline.runner import PartFailed, run_parts

    run = recipe_run(tmp_path)  # the parts' phase "walk": their records read nothing they write
    slow_end, quick_out, follower_start = tmp_path / "slow", tmp_path / "quick", tmp_path / "follower"

    def writes(path, delay):
        return [sys.executable, "-c", f"import time; time.sleep({delay}); open({str(path)!r}, 'w').write(repr(time.time()))"]

    slow = Part("eval-slow", "walk", writes(slow_end, 3.0), (slow_end,))
    quick = Part("eval-quick", "walk", writes(quick_out, 0.2), (quick_out,))
    follower = Part("walk", "walk", writes(follower_start, 0.0), (follower_start,))
    run_parts(run, [slow, quick], at_once=True, following=[(follower, {"eval-quick"})])
    assert all(records.is_complete(run.layout, part) for part in (slow, quick, follower))
    assert float(follower_start.read_text()) < float(slow_end.read_text())  # beside the slow one
    assert records.read_record(run.layout, "eval-quick")["seconds"] < 2.0  # its own time, not the slow one's
    assert "recipe: walk: what it reads is written (eval-quick): beside the rest" in capsys.readouterr().out
    bad = Part("eval-bad", "walk", [sys.executable, "-c", "raise SystemExit(2)"], ())
    other = Part("walk-2", "walk", writes(tmp_path / "never", 0.0), (tmp_path / "never",))
    with pytest.raises(PartFailed, match="eval-bad failed"):
        run_parts(run, [bad, Part("eval-ok", "walk", writes(tmp_path / "ok", 0.5), (tmp_path / "ok",))],
                  at_once=True, following=[(other, {"eval-bad"})])
    assert not (tmp_path / "never").exists()


def test_the_walk_follows_the_evals_it_reads_while_they_are_still_to_run(tmp_path):
    from dflash.pipeline.runner import followers

    evals = ('recipe.evals=[{name = "h", prompts = "heldout", temperatures = [0.0, 1.0]}, '
             '{name = "c", prompts = "embedded:chat-heldout"}]')
    run = recipe_run(tmp_path, evals, "store.labels=target")
    (checkpoint := tmp_path / "run" / "drafter" / "checkpoints" / "step-00000002").mkdir(parents=True)
    (checkpoint / "state.pt").write_bytes(b"")
    todo = eval_parts(run)
    assert [part.name for part in todo] == ["eval-h-t0", "eval-h-t1", "eval-c-t0"]
    ((walk, reads),) = followers(run, "eval", todo)
    assert walk.name == "walk" and reads == {"eval-h-t0"}
    assert followers(run, "eval", todo[1:]) == []  # what it reads is done already: the walk keeps its own phase
    assert followers(run, "train", todo) == []


def test_the_report_times_the_run_end_to_end_where_parts_overlap():
    """Three parts, two of them side by side: end to end is first start to last end, less than their sum."""
    done = [{"seconds": 100.0, "finished": "2026-12-04T10:01:40+0000"},  # 10:00:00 - 10:01:40
            {"seconds": 90.0, "finished": "2026-12-04T10:01:30+0000"},  # side by side with the first
            {"seconds": 50.0, "finished": "2026-12-04T10:02:30+0000"}]  # 10:01:40 - 10:02:30
    assert report.wall_seconds(done) == 150.0
    assert report.wall_seconds([]) is None
    line = report.took({"seconds": 240.0, "wall_seconds": 150.0})
    assert line.startswith("150 s end to end") and "240.0 s summed over the parts" in line
    assert report.took({"seconds": 240.0, "wall_seconds": None}) == "240.0 s summed over the parts."


def test_evals_side_by_side_serve_untimed_and_are_timed_alone_at_the_end(tmp_path):
    """Side by side every eval defers its timing, and the last phase's one part (`dflash time-evals`) times them all
    in one process; it runs again when an eval it times was served again since (its JSON deferred)."""
    from dflash.pipeline.parts import time_parts

    evals = ('recipe.evals=[{name = "a", prompts = "embedded:humaneval", temperatures = [0.0, 1.0]}, '
             '{name = "b", prompts = "embedded:chat-heldout", workers = 2}]')
    (checkpoint := tmp_path / "run" / "drafter" / "checkpoints" / "step-00000002").mkdir(parents=True)
    (checkpoint / "state.pt").write_bytes(b"")
    run = recipe_run(tmp_path, evals, "recipe.parallel_evals=true", "recipe.timed_prompts=3")
    parts = eval_parts(run)
    assert len(parts) == 3
    for part in parts:
        assert option(part.command, "--timed-prompts") == "3" and "--defer-timing" in part.command
    (timing,) = time_parts(run)
    jsons = [str(run.layout.eval_json(part.name)) for part in parts]
    assert timing.phase == "time" and timing.command[3] == "time-evals"
    assert all(path in timing.command for path in jsons)
    assert option(timing.command, "--summary") == str(run.layout.timing_json) and timing.stale  # nothing served yet
    for path in jsons:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps({"results": [{"timing": "alone"}]}))
    assert not time_parts(run)[0].stale
    Path(jsons[1]).write_text(json.dumps({"results": [{"timing": "deferred"}]}))  # served again since
    assert time_parts(run)[0].stale
    in_turn = recipe_run(tmp_path, evals, "recipe.parallel_evals=false")
    assert ["--timed-prompts" in part.command for part in eval_parts(in_turn)] == [False, False, True]  # its workers
    assert not any("--defer-timing" in part.command for part in eval_parts(in_turn)) and time_parts(in_turn) == []
    assert not any("--timed-prompts" in part.command
                   for part in eval_parts(recipe_run(tmp_path, evals, "recipe.timed_prompts=0")))
    # the target's path: served untimed through graphs with eval.target_graphs, the speed figures' target is
    # eval.timed_target_graphs' wherever they are taken (time-evals, or an eval in turn timing its own prompts)
    assert not any("--target-graphs" in part.command for part in parts) and "--no-target-graphs" in timing.command
    side = ("recipe.parallel_evals=true", "recipe.timed_prompts=3")
    served = recipe_run(tmp_path, evals, *side, "eval.target_graphs=true")
    assert all("--target-graphs" in part.command for part in eval_parts(served))
    assert "--no-target-graphs" in time_parts(served)[0].command
    engine = recipe_run(tmp_path, evals, *side, "eval.timed_target_graphs=true")
    assert not any("--target-graphs" in part.command for part in eval_parts(engine))
    assert "--target-graphs" in time_parts(engine)[0].command
    for timed in (False, True):
        alone = eval_parts(recipe_run(tmp_path, evals, "recipe.parallel_evals=false", "eval.target_graphs=true",
                                      f"eval.timed_target_graphs={str(timed).lower()}"))
        assert ["--target-graphs" in part.command for part in alone] == [timed] * 3