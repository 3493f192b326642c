from __future__ import annotations

import pytest

from scaletrain.errors import ConfigError
from scaletrain.plan import timeline

from conftest import run_here


@pytest.mark.parametrize("schedule,p,m,v", [
    ("gpipe", 2, 1, 1), ("gpipe", 4, 8, 1), ("1f1b", 4, 4, 1), ("1f1b", 3, 12, 1),
    ("interleaved-1f1b", 2, 4, 2), ("interleaved-1f1b", 4, 8, 2), ("interleaved-1f1b", 4, 8, 4),
    ("zero-bubble", 2, 4, 2), ("zero-bubble", 4, 8, 2), ("zero-bubble", 8, 32, 2),
])
def test_bubble_matches_theory(schedule, p, m, v):
    placed = timeline.simulate(schedule, p, m, v)
    assert timeline.bubble_fraction(placed) == pytest.approx(timeline.theory(schedule, p, m, v))


@pytest.mark.parametrize("schedule,v", [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("zero-bubble", 2)])
def test_every_operation_runs_once_and_in_dependency_order(schedule, v):
    p, m = 4, 8
    placed = timeline.simulate(schedule, p, m, v)
    ops = [(x.op.kind.replace("I", "B"), x.stage, x.op.mb, x.start, x.end) for row in placed for x in row]
    stages = p * v if v > 1 else p
    fwd = {(s, mb): (st, en) for k, s, mb, st, en in ops if k == "F"}
    bwd = {(s, mb): (st, en) for k, s, mb, st, en in ops if k == "B"}
    assert len(fwd) == len(bwd) == stages * m
    for (s, mb), (start, _) in fwd.items():
        if s > 0:
            assert start >= fwd[(s - 1, mb)][1]
    for (s, mb), (start, _) in bwd.items():
        assert start >= fwd[(s, mb)][1]
        if s < stages - 1:
            assert start >= bwd[(s + 1, mb)][1]
    for row in placed:  # a rank does one thing at a time
        for a, b in zip(row, row[1:]):
            assert b.start >= a.end


def _torch_orders(schedule: str, p: int, m: int, v: int) -> list[list[tuple[str, int, int]]]:
    """Each rank's compute actions as torch.distributed.pipelining's schedule class computes
    them when it is built (its `_calculate_single_rank_operations`, called on a stand-in for
    the schedule: building the real one needs a process group and stages)."""
    from types import SimpleNamespace

    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B, ScheduleZBVZeroBubble

    if schedule == "zero-bubble":
        cls = ScheduleZBVZeroBubble
        fake = SimpleNamespace(pp_group_size=p, num_stages=2 * p, _n_microbatches=m, n_local_stages=2)
    else:
        cls = ScheduleInterleaved1F1B
        rounds = max(1, m // p)
        fake = SimpleNamespace(pp_group_size=p, n_local_stages=v, _n_microbatches=m, number_of_rounds=rounds,
                               microbatches_per_round=m // rounds)
    return [[(a.computation_type.value, a.stage_index, a.microbatch_index)
             for a in cls._calculate_single_rank_operations(fake, r) if a is not None] for r in range(p)]


@pytest.mark.parametrize("schedule,v", [("zero-bubble", 2), ("interleaved-1f1b", 2), ("interleaved-1f1b", 3)])
def test_rank_orders_are_those_torch_pipelining_runs(schedule, v):
    """What `scaletrain schedule` draws and the planner counts (micro-batches in flight) is the
    order the trainer's schedules run: every rank's F, B (I and W) on every stage and
    micro-batch, in torch's order. Interleaved 1F1B for the micro-batch counts it accepts (a
    multiple of pp); ZB-V for any."""
    for p in (2, 3, 4):
        for m in range(1, 4 * p + 2) if schedule == "zero-bubble" else (p, 2 * p, 3 * p):
            orders, stage_of = timeline.rank_orders(schedule, p, m, v)
            ours = [[(op.kind, stage_of(r, op.chunk), op.mb) for op in order] for r, order in enumerate(orders)]
            assert ours == _torch_orders(schedule, p, m, v), (schedule, p, m, v)


def test_zero_bubble_beats_1f1b():
    zb = timeline.bubble_fraction(timeline.simulate("zero-bubble", 4, 8, 2))
    assert zb < timeline.bubble_fraction(timeline.simulate("interleaved-1f1b", 4, 8, 2)) / 2


def test_bad_requests():
    with pytest.raises(ConfigError, match="needs at least --pp=4 micro-batches"):
        timeline.check("1f1b", 4, 2, 1)
    with pytest.raises(ConfigError, match="exactly 2 stages per rank"):
        timeline.check("zero-bubble", 4, 8, 3)


def test_cli_prints_timeline_and_writes_png(tmp_path):
    r = run_here("schedule", "--pp", "4", "--microbatches", "8", "--schedule", "interleaved-1f1b", "--virtual", "2",
                "--png", str(tmp_path / "s.png"))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert sum(1 for line in lines if line.strip().startswith(("0 |", "1 |", "2 |", "3 |"))) == 4
    assert "bubble (idle / busy per rank): 0.188; theory 0.188 ((p-1)/(v·m))" in r.stdout
    assert (tmp_path / "s.png").read_bytes()[:4] == b"\x89PNG"
    r = run_here("schedule", "--pp", "4", "--microbatches", "2")
    assert r.returncode == 2 and "gpipe also runs fewer" in r.stderr
