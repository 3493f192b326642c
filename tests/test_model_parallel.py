"""Tensor, sequence and pipeline parallelism on real processes (gloo on CPU), alone and
composed with data parallelism: every step's loss matches one process; checkpoints move
between layouts."""

from __future__ import annotations

import pytest

from scaletrain.train.trainer import Trainer

from conftest import micro_cfg, micro_overrides, run_group

pytestmark = pytest.mark.multiproc

STEPS = 7  # a checkpoint at step 5, resumed for steps 6 and 7
TOL = 1e-5
# 4 blocks (for 2 stages × 2 virtual stages), untied embeddings (pipelining puts the embedding
# and the head on different ranks), micro-batches of 2 sequences out of a global batch of 8
BASE = {"train.steps": STEPS, "model.n_layers": 4, "model.tie_embeddings": False, "train.micro_batch": 2}

TWO = [
    ("tp2", {"parallel.tp": 2}),
    ("tp2-sp", {"parallel.tp": 2, "parallel.sp": True}),
    ("pp2-gpipe", {"parallel.pp": 2, "parallel.pp_schedule": "gpipe"}),
    ("pp2-1f1b", {"parallel.pp": 2, "parallel.pp_schedule": "1f1b"}),
    ("pp2-interleaved", {"parallel.pp": 2, "parallel.pp_schedule": "interleaved-1f1b", "parallel.pp_virtual_stages": 2}),
    ("pp2-zero-bubble", {"parallel.pp": 2, "parallel.pp_schedule": "zero-bubble", "parallel.pp_virtual_stages": 2}),
    ("pp2-one-microbatch", {"parallel.pp": 2, "parallel.pp_schedule": "gpipe", "train.micro_batch": 8}),
    ("pp2-bias-gelu", {"parallel.pp": 2, "model.bias": True, "model.position": "rope"}),
]
FOUR = [
    ("tp2xpp2", {"parallel.tp": 2, "parallel.pp": 2}),
    ("tp2-sp-xpp2-interleaved", {"parallel.tp": 2, "parallel.sp": True, "parallel.pp": 2,
                                 "parallel.pp_schedule": "interleaved-1f1b", "parallel.pp_virtual_stages": 2}),
    ("dp2xtp2-zero1", {"parallel.tp": 2, "parallel.zero": 1}),
    ("dp2xtp2-zero2-sp", {"parallel.tp": 2, "parallel.zero": 2, "parallel.sp": True}),
    ("dp2xtp2-zero3", {"parallel.tp": 2, "parallel.zero": 3}),
    ("dp2xpp2-ddp", {"parallel.pp": 2, "parallel.zero": 0}),
    ("dp2xtp2-zero0-sp", {"parallel.tp": 2, "parallel.zero": 0, "parallel.sp": True}),  # FSDP-style replicate
]
EIGHT = [
    ("dp2xtp2xpp2-zero3", {"parallel.tp": 2, "parallel.pp": 2, "parallel.zero": 3}),
]
LLAMA = {"model.norm": "rmsnorm", "model.activation": "swiglu", "model.position": "rope", "model.n_kv_heads": 2}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = {}
    for name, extra in {"plain": {}, "bias-rope": {"model.bias": True, "model.position": "rope"},
                        "llama": LLAMA}.items():
        out[name] = Trainer(micro_cfg(tmp_path_factory.mktemp(name), **{**BASE, **extra})).fit()["losses"]
    return out


def ref_name(extra):
    if extra.get("model.bias"):
        return "bias-rope"
    if extra.get("model.norm") == "rmsnorm":
        return "llama"
    return "plain"


def worst(losses, ref, first=1):
    assert [s for s, _ in losses] == list(range(first, STEPS + 1))
    return max(abs(loss - ref[s - 1]) / ref[s - 1] for s, loss in losses)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Three groups of processes. The 4-rank group also saves a checkpoint (tp 2 × pp 2) that
    the 2- and 8-rank groups and one process resume at other layouts."""
    tmp = tmp_path_factory.mktemp("mp")
    out = {}
    save = tmp / "save"
    four = FOUR + [("save", {"parallel.tp": 2, "parallel.pp": 2, "checkpoint.every": 5, **LLAMA})]
    code, results, err = run_group(4, [{"overrides": micro_overrides(tmp / n, **{**BASE, **e})} for n, e in four], tmp)
    assert code == 0, err
    out.update({n: r for (n, _), r in zip(four, results)})
    step5 = str(save / "checkpoints" / "step_00000005")
    two = TWO + [("resume-pp2", {"parallel.pp": 2, "checkpoint.resume": step5, **LLAMA}),
                 ("resume-tp2-zero0", {"parallel.tp": 2, "checkpoint.resume": step5, **LLAMA})]
    code, results, err = run_group(2, [{"overrides": micro_overrides(tmp / n, **{**BASE, **e})} for n, e in two], tmp)
    assert code == 0, err
    out.update({n: r for (n, _), r in zip(two, results)})
    eight = EIGHT + [("resume-3d-zero2", {"parallel.tp": 2, "parallel.pp": 2, "parallel.zero": 2, "parallel.sp": True,
                                         "checkpoint.resume": step5, **LLAMA})]
    code, results, err = run_group(8, [{"overrides": micro_overrides(tmp / n, **{**BASE, **e})} for n, e in eight], tmp)
    assert code == 0, err
    out.update({n: r for (n, _), r in zip(eight, results)})
    out["resume-1"] = {"losses": [(r["step"], r["loss"]) for r in Trainer(micro_cfg(
        tmp / "resume-1", **{**BASE, **LLAMA, "checkpoint.resume": step5})).fit()["history"]]}
    return out


@pytest.mark.parametrize("name,extra", TWO + FOUR + EIGHT, ids=[n for n, _ in TWO + FOUR + EIGHT])
def test_parity_with_one_process(runs, reference, name, extra):
    assert worst(runs[name]["losses"], reference[ref_name(extra)]) < TOL


@pytest.mark.parametrize("name", ["save", "resume-pp2", "resume-tp2-zero0", "resume-3d-zero2", "resume-1"])
def test_checkpoint_resumes_at_another_layout(runs, reference, name):
    first = 1 if name == "save" else 6
    assert worst(runs[name]["losses"], reference["llama"], first) < TOL


def test_tensor_parallel_shards_the_blocks(runs):
    """tp 2 holds about half the parameters per rank (embedding and head split too)."""
    one = runs["dp2xtp2-zero3"]["ranks"][0]["state_bytes"]
    two = runs["tp2"]["ranks"][0]["state_bytes"]
    psi = runs["tp2"]["num_params"]
    # tp 2 alone: params + grads + AdamW = 16 bytes per parameter / 2, give or take the
    # replicated norms and positions
    total = sum(two.values())
    assert 0.5 * 16 * psi <= total < 0.6 * 16 * psi, total / psi
    assert sum(one.values()) < 0.6 * total  # dp 2 with ZeRO-3 halves it again (nearly)
