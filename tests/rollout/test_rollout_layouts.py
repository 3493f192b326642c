"""The colocated engine on 2 ranks, on the training module as ZeRO-3, tp 2 and tp 2 with sequence
parallelism shard it: the same tokens and log-probs as one process with the same seed, every rank running
the same number of forwards (ZeRO-3's ranks sample uneven shares of the prompts: 2 and 3, and rescore
3 and 6 rows), and the trainer's side (logprobs_of) on the same layout bit for bit the engine's.

Measured (2 ranks, gloo, fp32): ZeRO-3 bitwise equal to one process (the gathered weights are the same
numbers, and each rank's forwards the same shapes); tp 2, with or without sp, at most 4.8e-7 from one
process (the row-parallel sums add in another order). The trainer's sample after training
(model.generate.sample_text, with the cache; padded under sp) the same text as one process's."""

from __future__ import annotations

import json

import pytest

import rollout_probe

from conftest import micro_cfg, micro_overrides

LAYOUTS = {
    "zero3": ({"parallel.zero": 3}, "split"),
    "tp2": ({"parallel.tp": 2}, "whole"),
    "tp2-sp": ({"parallel.tp": 2, "parallel.sp": True}, "whole"),
}


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    from scaletrain.train.trainer import Trainer

    trainer = Trainer(micro_cfg(tmp_path_factory.mktemp("one")))
    return rollout_probe.sample(trainer.pm.dp.module, None, False, 0, 1)


def rows_in_order(got: list[dict], split: bool) -> list[tuple]:
    """Every rank's rows as one process's (prompt-major): a split's ranks in turn, a tp group's rank 0."""
    parts = got if split else got[:1]
    return [(g["prompt_index"][k], g["completions"][k], g["logprobs"][k], g["trainer"][k])
            for g in parts for k in range(len(g["completions"]))]


@pytest.mark.multiproc
@pytest.mark.parametrize("layout", LAYOUTS)
def test_two_ranks_sample_what_one_process_does(layout, tmp_path, one_process):
    from forked_ranks import run_forked

    extra, split = LAYOUTS[layout]
    overrides = tmp_path / "overrides.json"
    overrides.write_text(json.dumps(micro_overrides(tmp_path / "run", **extra)))
    # (ranks that disagree on their forwards wait on each other: the time limit ends them)
    code, err = run_forked("rollout_probe:main", [str(tmp_path / "out.json"), str(overrides), split], 2, timeout=180)
    assert code == 0, err
    got = json.loads((tmp_path / "out.json").read_text())
    assert got[0]["forwards"] == got[1]["forwards"] > 0  # the ranks ran the same forwards
    if split == "whole":  # a tp group: both ranks drew the same
        assert got[0]["completions"] == got[1]["completions"] and got[0]["logprobs"] == got[1]["logprobs"]
    rows = rows_in_order(got, split == "split")
    ref = one_process
    assert [r[0] for r in rows] == [i for i in range(5) for _ in range(3)]
    assert [r[1] for r in rows] == ref["completions"]
    lps = [x for r in rows for x in r[2]]
    ref_lps = [x for lp in ref["logprobs"] for x in lp]
    worst = max(abs(a - b) for a, b in zip(lps, ref_lps, strict=True))
    if layout == "zero3":
        assert lps == ref_lps  # bitwise
    else:
        assert worst <= 1e-6, worst
    assert all(r[2] == r[3] for r in rows)  # the engine's log-probs are logprobs_of's on the layout
    assert 0 < max(g["sampling_gap"] for g in got) <= 2e-6
    assert got[0]["text"] == got[1]["text"] == ref["text"]  # the trainer's sample, with its cache, alike
