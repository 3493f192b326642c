"""The planner held against published large runs: each row of `scaletrain.plan.published.RUNS`
run through the CLI (`scaletrain plan ... --json`, in this process), its prediction printed beside
the published figure as the Markdown table of docs/planner.md, "Held against published runs".

    python benchmarks/planner_published.py            # the table
    python benchmarks/planner_published.py --commands # and the command of every row
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import shlex
import sys

from scaletrain.cli import main
from scaletrain.plan.published import RUNS, Run, predicted


def plan_json(run: Run) -> dict:
    """The first (only) layout of `scaletrain plan ARGS --json`."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["plan", *run.args, "--json"])
    if code not in (0, 1):  # 1: the layout does not fit, which the table reports
        sys.exit(f"scaletrain plan {shlex.join(run.args)} failed with exit code {code}")
    return json.loads(out.getvalue())["layouts"][0]


def _fmt(metric: str, v: float) -> str:
    if metric == "MFU":
        return f"{100 * v:.1f}%"
    if metric in ("GiB/GPU", "model states GB"):
        return f"{v:.1f}"
    return f"{v:,.0f}"


def row(run: Run) -> tuple[str, float]:
    e = plan_json(run)
    got = predicted(run, e)
    ratio = got / run.published
    layout = e["describe"]
    fits = "" if e["fits"] else f" — does not fit ({e['memory']['total'] / 2**30:.0f} GiB)"
    role = "calibration" if run.calibration else "held out"
    mark = "" if abs(ratio - 1) <= 0.15 else " ✗"
    return (f"| {run.name} | {run.source} | {layout} | {run.metric} | {_fmt(run.metric, run.published)} | "
            f"{_fmt(run.metric, got)}{fits} | {ratio:.2f}{mark} | {role} |"), ratio


def main_() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--commands", action="store_true", help="also print each row's command")
    args = ap.parse_args()
    print("| run | source | layout | figure | published | predicted | predicted / published | |")
    print("|---|---|---|---|---|---|---|---|")
    held_out = []
    for run in RUNS:
        line, ratio = row(run)
        print(line, flush=True)
        if not run.calibration:  # the accuracy claim is over held-out rows only
            held_out.append(abs(ratio - 1))
    within = sum(d <= 0.15 for d in held_out)
    print(f"\n{within} of {len(held_out)} held-out rows within 15%; "
          f"median miss {100 * sorted(held_out)[len(held_out) // 2]:.0f}%")
    print()
    for run in RUNS:
        if run.why:
            print(f"- **{run.name.strip()}**: {run.why}")
    if args.commands:
        print()
        for run in RUNS:
            print(f"scaletrain plan {shlex.join(run.args)}   # {run.name.strip()}")
    return 0


if __name__ == "__main__":
    sys.exit(main_())
