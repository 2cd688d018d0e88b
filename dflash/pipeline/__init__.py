"""`dflash recipe`: the whole pipeline (generate -> stage one -> stage two -> export -> eval -> walk) as
parts that run as `python -m stages.cli ...` subprocesses, each recorded once it succeeded.

`layout` names every path under the run folder, `parts` plans the parts from the config (phase by
phase: the exports and evals are planned once stage two's checkpoints exist), `records` writes and
checks the completion records a rerun skips by, `runner` runs the parts (side by side where configured)
and `report` turns the records and the eval and walk JSONs into report.json, report.md and plots.
"""
