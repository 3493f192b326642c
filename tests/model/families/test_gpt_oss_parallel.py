"""gpt-oss under every layout that splits it: context parallelism's three methods put each sink in
each query's denominator once, with its gradient (against the softmax written by hand, on a sliding
and a full block); a gpt-oss-shaped model made here and a GptOssForCausalLM imported from
transformers train like one process under ZeRO-3, tp 2 (with sp), pp 2, ep 2 and cp 2 (ring,
all-gather, Ulysses), step by step and in their final weights; and `scaletrain verify` passes them.
The one-process model is held to transformers' logits and gradients in test_gpt_oss.py beside it."""

from __future__ import annotations

import pytest

from scaletrain import cli
from scaletrain.config import load_config

from conftest import (
    MICRO,
    assert_group_trains_alike,
    fit_reference,
    micro_overrides,
    run_group,
    wanted_params,
)

pytestmark = pytest.mark.multiproc

SEQ, HEADS, KV, HEAD_DIM = 32, 4, 2, 16
# SGD without clipping: each update is the gradient itself, so a gradient that misses a rank's share
# (a sink's, an expert bias's) shows in the final weights
BASE = {"train.steps": 3, "train.global_batch": 4, "train.micro_batch": 2, "model.tie_embeddings": False,
        "optim.name": "sgd", "optim.lr": 0.1, "train.grad_clip": 0.0}
# gpt-oss's parts on the micro model: sinks, biases on q/k/v/o, sliding and full blocks alternating (a
# window of 5 divides neither the sequence nor its cp chunks), experts with biases and the clamped SwiGLU
# (a limit low enough to bite), the router's bias, YaRN
SHAPED = {"model.norm": "rmsnorm", "model.position": "rope", "model.n_kv_heads": KV, "model.attn_sinks": True,
          "model.bias": True, "model.sliding_window": 5, "model.global_every": 2, "model.moe_experts": 4,
          "model.moe_top_k": 2, "model.moe_renorm": True, "model.moe_bias": True, "model.moe_bias_rate": 0.0,
          "model.activation": "swiglu_clamped", "model.swiglu_limit": 1.0, "model.ffn_dim": 48,
          "model.rope_scaling": "yarn", "model.rope_factor": 4.0, "model.rope_original_max_seq_len": 8,
          "model.init_std": 0.2}
CP = {f"cp2-{m}": {"parallel.cp": 2, "parallel.cp_method": m} for m in ("ring", "allgather", "ulysses")}
LAYOUTS = {"zero3": {"parallel.dp_shard": 2, "parallel.zero": 3}, "tp2": {"parallel.tp": 2},
           "tp2-sp": {"parallel.tp": 2, "parallel.sp": True}, "pp2": {"parallel.pp": 2},
           "ep2-zero3": {"parallel.ep": 2, "parallel.zero": 3}, **CP}


def imported_gpt_oss(folder) -> dict:
    """A tiny GptOssForCausalLM (sliding then full block, window 5 under sequences of 32), every
    tensor off its init, saved to `folder`: the options that import its shape and weights."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.GptOssConfig(
        vocab_size=256, hidden_size=64, intermediate_size=48, num_hidden_layers=2, num_attention_heads=HEADS,
        num_key_value_heads=KV, head_dim=HEAD_DIM, max_position_embeddings=64, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=5, swiglu_limit=1.0,
        rope_parameters={"rope_type": "yarn", "rope_theta": 1000.0, "factor": 4.0, "beta_fast": 8.0,
                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 16})
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" not in n:
                p.normal_(0.0, 0.5 if ("sinks" in n or "router" in n or "bias" in n) else 0.1)
    model.save_pretrained(folder)
    return {"model.from_hf": str(folder), "model.init_from": str(folder), "model.max_seq_len": 64}


# --------------------------------------------------------------------------------------------
# Context parallelism's attention against the softmax by hand


def _inputs():
    """q, k, v of a whole sequence (1, heads, SEQ, HEAD_DIM), the sinks and the weights of the loss."""
    import torch

    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(1, h, SEQ, HEAD_DIM, generator=g) for h in (HEADS, KV, KV))
    return q, k, v, torch.randn(HEADS, generator=g) * 2, torch.randn(1, HEADS, SEQ, HEAD_DIM, generator=g)


def cp_attention(trainer):
    """dist_worker's probe: each block's attention (block 0 sliding, block 1 full) as context
    parallelism replaced it, on this rank's chunks of `_inputs`: its output and the gradients of
    its q, k, v and of the sinks (this rank's share, summed over the ranks by the step's hook)."""
    import torch
    import torch.distributed as dist

    from scaletrain.parallel.context_parallel import chunk_positions

    q, k, v, sinks, w = _inputs()
    mine = chunk_positions(SEQ, dist.get_world_size(), dist.get_rank())
    report = {}
    for name, block in trainer.model.layers.items():
        attn = block.attn
        with torch.no_grad():
            attn.sinks.copy_(sinks)
        attn.sinks.grad = None
        leaves = [t[:, :, mine].clone().requires_grad_() for t in (q, k, v)]
        out = attn.attend(*leaves, None, True)
        (out * w[:, :, mine]).sum().backward()
        report[name] = {"out": out.tolist(), "dq": leaves[0].grad.tolist(), "dk": leaves[1].grad.tolist(),
                        "dv": leaves[2].grad.tolist(), "dsinks": attn.sinks.grad.tolist()}
        attn.sinks.grad = None
    return lambda: {"positions": mine.tolist(), "blocks": report}


@pytest.fixture(scope="module")
def cp_attention_runs(request, tmp_path_factory) -> dict:
    """Each cp method's probe (cp_attention), the methods the session's tests ask for in one group of 2 ranks."""
    tmp = tmp_path_factory.mktemp("cp-sinks")
    wanted = wanted_params(request, "method")
    methods = [m for m in ("ring", "allgather", "ulysses") if wanted is None or m in wanted]
    runs = [micro_overrides(tmp / m, **{**BASE, **SHAPED, "train.steps": 1, "model.dim": 64, "model.n_heads": HEADS,
                                        "model.head_dim": HEAD_DIM, "parallel.cp": 2, "parallel.cp_method": m})
            for m in methods]
    code, results, err = run_group(2, [{"overrides": run, "probe": "test_gpt_oss_parallel:cp_attention"}
                                       for run in runs], tmp)
    assert code == 0, err
    return dict(zip(methods, results, strict=True))


@pytest.mark.parametrize("method", ["ring", "allgather", "ulysses"])
def test_context_parallel_attention_with_sinks_is_the_softmax_by_hand(cp_attention_runs, method):
    import torch

    from scaletrain.model.window import Window
    from test_gpt_oss import attention_by_hand

    result = cp_attention_runs[method]
    q, k, v, sinks, w = _inputs()
    pos = torch.arange(SEQ)
    for block, window in (("0", Window(5)), ("1", None)):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
        allowed = (pos[None, :] <= pos[:, None]) if window is None else window.allows(pos, pos)
        ref = attention_by_hand(*leaves, allowed[None])
        (ref * w).sum().backward()
        got = {key: torch.zeros_like(t) for key, t in (("out", q), ("dq", q), ("dk", k), ("dv", v))}
        dsinks = torch.zeros(HEADS)
        for rank in result["ranks"]:
            mine, report = rank["probe"]["positions"], rank["probe"]["blocks"][block]
            for key in got:
                got[key][:, :, mine] += torch.tensor(report[key])
            dsinks += torch.tensor(report["dsinks"])
        want = {"out": ref.float(), "dq": leaves[0].grad, "dk": leaves[1].grad, "dv": leaves[2].grad}
        for key, t in got.items():
            assert (t - want[key]).abs().max() <= 1e-4, (method, block, key, (t - want[key]).abs().max())
        assert (dsinks - leaves[3].grad).abs().max() <= 1e-4, (method, block, dsinks, leaves[3].grad)
        assert leaves[3].grad.abs().min() > 1e-3  # every head's sink has a gradient to get right


# --------------------------------------------------------------------------------------------
# Training under every layout


@pytest.mark.slow
def test_gpt_oss_trains_alike_under_every_layout(tmp_path):
    models = {"shaped": {**SHAPED, "model.n_layers": 2}, "imported": imported_gpt_oss(tmp_path / "gpt-oss-hf")}

    def overrides(run_dir, name, extra):
        values = micro_overrides(run_dir, **{**BASE, **models[name], **extra})
        if "model.from_hf" in models[name]:  # the shape is the checkpoint's
            values = {k: v for k, v in values.items() if not k.startswith(("model.dim", "model.n_"))}
        return values

    refs = {name: fit_reference(load_config(None, overrides(tmp_path / name / "one", name, {}))) for name in models}
    assert_group_trains_alike(2, tmp_path, [(f"{name} {layout}", overrides(tmp_path / name / layout, name, extra),
                                             refs[name]) for name in models for layout, extra in LAYOUTS.items()],
                              steps=3)


@pytest.mark.slow
@pytest.mark.usefixtures("forked_launches")
# verify's command on the imported model, at one layout: how each layout trains it (tp 2, pp 2, cp 2 ring
# too) is test_gpt_oss_trains_alike_under_every_layout's ("imported"), step by step and in the final weights
@pytest.mark.parametrize("layout", [["--nproc=2", "--parallel.zero=3", "--parallel.ep=2"]], ids=["zero3-ep2"])
def test_verify_passes_an_imported_gpt_oss(tmp_path, capfd, layout):
    hf = imported_gpt_oss(tmp_path / "hf")
    args = [f"--{k}={v}" for k, v in {**MICRO, **hf, "train.micro_batch": 2, "log.run_dir": str(tmp_path / "run")}
            .items() if not k.startswith(("model.dim", "model.n_"))]
    code = cli.main(["verify", "--steps=3", *args, *layout])
    out = "".join(capfd.readouterr())
    assert code == 0, out
    verdict = next(line for line in out.splitlines() if line.startswith("largest relative difference"))
    assert verdict.endswith(": PASS"), out[-2000:]
