"""tools/recipe.sh, the real-target recipe, end to end on the CPU with the embedded tiny target and
tiny budgets: every part runs, the held-out prompts' answers are not trained on, and the summary
puts the training log's held-out tau beside the served ones."""

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]


def test_the_recipe_runs_every_part_and_summarizes(tmp_path):
    work = tmp_path / "recipe"
    env = dict(os.environ, CONFIG="configs/tiny.toml", WORK=str(work), SAMPLES="1", NEW_TOKENS="24",
               EVAL_PROMPTS="2", EVAL_TOKENS="8", GENERATE_ARGS="--limit 16", OMP_NUM_THREADS="1",
               MORE_SAMPLES="0", MORE_ARGS="--limit 16",  # the defaults: code-complete, embedded:ask-code
               ASK_ARGS="--limit 6",
               EXTRA="--set train.max_steps=4 --set train.holdout_fraction=0.3 --set train.eval_every=2 "
                     "--set train.log_every=2 "
                     "--set train.save_every=2 --set train.epochs=8 "
                     "--set data.num_workers=1 --set train.num_workers=0 "
                     "--set store.labels=target --set train.eval_served_tokens=8 --set train.fuse_accum=true")
    result = subprocess.run(["bash", "tools/recipe.sh", "run"], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    timing = [line.split("\t") for line in (work / "results" / "timing.tsv").read_text().splitlines()]
    assert [name for name, _, _ in timing] == ["generate", "generate-more", "generate-asked", "generates (side by side)",
                                               "extract", "train", "export",
                                               "export-00000002", "eval-heldout", "eval-heldout-more",
                                               "eval-humaneval", "eval-heldout-t1", "evals (side by side)", "walk"]
    assert all(rc == "0" for _, _, rc in timing)
    summary = (work / "results" / "summary.txt").read_text()
    assert "teacher-forced held-out tau" in summary and summary.count("served tau (") == 4
    walked = re.search(r"teacher-forced held-out tau as served ([\d.]+) \((\d+) greedy held-out answers", summary)
    assert walked and 1.0 <= float(walked.group(1)) <= 16 and int(walked.group(2)) > 0  # train.eval_served_tokens
    assert re.search(r"greedy ones; about \d+ of them \(train.eval_batches micro-batches\) walked over their first 8 "
                     r"tokens", (work / "logs" / "train.log").read_text())
    assert "served curve" in summary
    assert re.search(r"stage two: [\d,]+ tokens/s in the median window, [\d,]+ over the loop", summary)
    # tools/heldout_walk.py: the served prompts' greedy answers walked teacher-forced, per checkpoint served at 0
    assert summary.count("own prompts") == 3  # eval-heldout's two drafters (the curve), eval-heldout-more's one
    walks = json.loads((work / "results" / "walk.json").read_text())["walks"]
    assert [Path(entry["checkpoint"]).name for entry in walks] == ["step-00000004", "step-00000002", "step-00000004"]
    for entry in walks:
        assert entry["walked_prompts"] >= 1
        for prompt in entry["prompts"]:
            if prompt["teacher_forced_lengths"] is not None:  # the walk records what serving recorded
                assert prompt["teacher_forced_lengths"] == prompt["served_lengths"]
    split = re.search(r"training split: ([\d,]+) tokens, ([\d,]+) of them", summary)
    assert split and 0 < int(split.group(2).replace(",", "")) < int(split.group(1).replace(",", ""))
    curve = summary.split("served curve", 1)[1].splitlines()[1:]
    assert [row.split(",")[0].strip() for row in curve] == ["2", "4"]  # an earlier checkpoint, then the last
    assert all("passes)" in row for row in curve[1:])  # tokens seen over the training split's tokens
    assert all(row.split(",")[-5].strip() != "None" for row in curve)  # each beside its teacher-forced tau
    assert all(row.split(",")[-4].strip() != "None" for row in curve)  # that tau walked as served
    assert all(row.split(",")[-3].strip() != "None" for row in curve)  # and walked on the served prompts
    assert all(row.split(",")[-1].strip() != "None" for row in curve)  # HumanEval served by the same checkpoint
    answers = [json.loads(line) for part in sorted((work / "answers").glob("part-*.jsonl"))
               for line in part.read_text().splitlines()]
    assert [row["sample"] for row in answers] == [0, 1] * 16  # the greedy answer and one sampled, per prompt
    more = [json.loads(line) for part in sorted((work / "answers" / "more").glob("part-*.jsonl"))
            for line in part.read_text().splitlines()]
    assert [row["sample"] for row in more] == [0] * 16  # MORE_SAMPLES=0: the greedy answer alone
    assert "Complete the following Python function" in more[0]["messages"][0]["content"]
    asked_log = (work / "logs" / "generate-asked.log").read_text()
    assert "asked: the target wrote 6 prompts (temperature 1)" in asked_log  # embedded:ask-code's starts, continued
    assert "asked: the target wrote 6 prompts (temperature 1)" in summary
    asked = [json.loads(line) for part in sorted((work / "answers" / "asked").glob("part-*.jsonl"))
             for line in part.read_text().splitlines()]
    assert all(row["asked"] and row["messages"][0]["content"].startswith(("Complete", "Write")) for row in asked)
    rows = re.search(r"data: (\d+) rows", (work / "logs" / "extract.log").read_text())
    assert rows and int(rows.group(1)) == 48 + len(asked)  # stage one read the three folders of answers
    held_out = json.loads((work / "results" / "eval-heldout.json").read_text())["results"]
    assert [result["num_prompts"] for result in held_out] == [2, 2] and held_out[0]["temperature"] == 0
    assert held_out[0]["prompts_source"] == "heldout (--match 'the Python module `')"  # code-docs' alone
    more = json.loads((work / "results" / "eval-heldout-more.json").read_text())["results"][0]
    assert more["prompts_source"].startswith("heldout (--match 'Complete the following Python function")
    humaneval = json.loads((work / "results" / "eval-humaneval.json").read_text())["results"]
    assert len(humaneval) == 2 and humaneval[0]["prompts_source"] == "embedded:humaneval"  # the curve here too
    assert all(len(prompt["in_code"]) == len(prompt["acceptance_lengths"]) and prompt["text"]
               for result in held_out + humaneval for prompt in result["per_prompt"])
