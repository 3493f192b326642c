"""QLoRA (adapter.base_dtype = nf4 | int8 | bf16, scaletrain.quant.frozen_base): the adapted
linears' frozen bases stored quantized and dequantized per matmul, exactly as a dense model with
the dequantized weights computes; the adapters alone train; small checkpoints resumed bitwise;
the refusals one line each. (Two ranks against one process: tests/model/test_lora.py's one launch.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from scaletrain.model.lora import AdapterSpec, LoRALinear
from scaletrain.quant.frozen_base import FrozenWeight, nf4_scaler_block, quantize_base, stored_bytes
from scaletrain.train.trainer import Trainer

from conftest import MICRO_ARGS, micro_cfg, one_line_exit_2, read_metrics, run_here

BASES = ("nf4", "int8", "bf16")


def dequantized(w: torch.Tensor) -> torch.Tensor:
    """The dense weight a quantized base stands for, by the format's own definition."""
    if isinstance(w, FrozenWeight):
        return w.dequantize(torch.float32)
    return w.get_original_weight()  # torchao's NF4Tensor


def test_nf4_and_int8_dequantize_to_their_definitions():
    torch.manual_seed(0)
    w = torch.randn(8, 128)
    q = FrozenWeight.quantize(w, "int8")
    assert q.qdata.dtype == torch.int8 and q.scale.shape == (8,)
    scale = w.abs().amax(dim=1) / 127  # symmetric, per output row
    torch.testing.assert_close(q.dequantize(), torch.round(w / scale[:, None]) * scale[:, None], rtol=0, atol=1e-6)
    assert (q.dequantize() - w).abs().max() <= scale.max() / 2 + 1e-6  # half a step at most
    lin = LoRALinear(nn.Linear(128, 8), AdapterSpec("lora", rank=2))
    lin.weight.data.copy_(w)
    quantize_base(lin, "nf4")
    nf4 = lin.weight
    assert (nf4.block_size, nf4.scaler_block_size) == (64, nf4_scaler_block(128)) == (64, 2)
    # NF4: each block of 64 is its absmax times one of 16 NormalFloat levels (the absmax
    # itself double-quantized: within 1% here)
    deq = dequantized(nf4).view(-1, 64)
    absmax = w.view(-1, 64).abs().amax(dim=1, keepdim=True)
    levels = (deq / absmax).unsqueeze(-1)
    assert (levels - nf4.nf4).abs().min(dim=-1).values.max() < 0.01
    assert (deq - w.view(-1, 64)).abs().max() < 0.15 * absmax.max()  # the widest gap between levels / 2, ~0.14


@pytest.mark.parametrize("base", BASES)
def test_a_quantized_base_computes_what_its_dequantized_weight_does(base):
    torch.manual_seed(1)
    lin = LoRALinear(nn.Linear(128, 32), AdapterSpec("lora", rank=4, alpha=8.0))
    with torch.no_grad():
        lin.lora_a.normal_()
        lin.lora_b.normal_()
    quantize_base(lin, base)
    dense = dequantized(lin.weight)
    x = torch.randn(3, 5, 128, requires_grad=True)
    y = lin(x)
    ref = F.linear(x, dense, lin.bias) + lin.scale * F.linear(F.linear(x, lin.lora_a), lin.lora_b)
    assert torch.equal(y, ref)
    gx, ga = torch.autograd.grad(y.square().sum(), (x, lin.lora_a))
    rx, ra = torch.autograd.grad(ref.square().sum(), (x, lin.lora_a))
    torch.testing.assert_close(gx, rx, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ga, ra, rtol=1e-6, atol=1e-6)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # bf16-mixed: the base's matmul in bf16
        assert F.linear(x, lin.weight).dtype == torch.bfloat16
    n = lin.weight.numel()
    # nf4: 4-bit codes, an int8 scale per 64, an fp32 factor per 2 scales (a row's 128 / 64
    # blocks), the 16 levels and the scales' mean; int8: a byte each, an fp32 scale per row
    want = {"nf4": n / 2 + n / 64 + 4 * n / 128 + 16 * 4 + 4, "int8": n + 4 * 32, "bf16": 2 * n}[base]
    assert stored_bytes(lin.weight) == want


@pytest.mark.parametrize("base", ["nf4", "int8"])
def test_compiled_the_base_keeps_no_dense_weight_for_backward(base):
    """Under torch.compile the base's matmul stays one op that dequantizes inside (traced as plain
    ops, the compiled graph kept each dense weight for backward); outputs and gradients are eager's."""
    torch.manual_seed(2)
    lin = LoRALinear(nn.Linear(256, 384, bias=False), AdapterSpec("lora", rank=4))
    with torch.no_grad():
        lin.lora_a.normal_()
        lin.lora_b.normal_()
    quantize_base(lin, base)
    x = torch.randn(2, 8, 256, requires_grad=True)

    def run(f):
        saved = []  # what autograd keeps for backward
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            y = f(x)
        return y, torch.autograd.grad(y.square().sum(), (x, lin.lora_a, lin.lora_b)), saved

    y, grads, _ = run(lin)
    # the partitioner inductor uses (min-cut), without its code generation: what backward keeps is decided there
    cy, cgrads, saved = run(torch.compile(lin, backend="aot_eager_decomp_partition", fullgraph=True))
    assert torch.equal(cy, y) and all(torch.equal(a, b) for a, b in zip(cgrads, grads, strict=True))
    dense = [(tuple(t.shape), t.dtype) for t in saved if t.is_floating_point() and t.numel() >= lin.weight.numel()]
    assert saved
    assert not dense, dense


@pytest.mark.parametrize("base", BASES)
def test_only_the_adapters_train_over_a_quantized_base(tmp_path, base):
    trainer = Trainer(micro_cfg(tmp_path, **{"train.steps": 5, "adapter.kind": "lora", "adapter.base_dtype": base,
                                             "optim.warmup_steps": 1}))
    adapted = [n for n, m in trainer.model.named_modules() if isinstance(m, LoRALinear)]
    params = dict(trainer.pm.dp.named_params)
    assert len(adapted) == 12
    for name in adapted:  # the adapted bases stored quantized; the rest of the model as it was
        assert type(params[f"{name}.weight"]) is (FrozenWeight if base != "nf4" else type(params[f"{name}.weight"]))
        assert type(params[f"{name}.weight"]).__name__ in ("FrozenWeight", "NF4Tensor")
    plain = [n for n, p in params.items() if type(p) is nn.Parameter and type(p.data) is torch.Tensor]
    assert "tok_emb.weight" in plain and "norm.weight" in plain
    # the logits are those of the dense model holding the dequantized bases
    dense = Trainer(micro_cfg(tmp_path / "dense", **{"train.steps": 5, "adapter.kind": "lora"}))
    with torch.no_grad():
        for name in adapted:
            dense.model.get_submodule(name).weight.copy_(dequantized(params[f"{name}.weight"]))
        x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(3))
        assert torch.equal(trainer.model(x), dense.model(x))
    before = {n: p.detach().clone() if type(p.data) is torch.Tensor else None for n, p in trainer.pm.dp.named_params}
    losses = trainer.fit()["losses"]
    assert losses[-1] < losses[0] - 0.05, losses
    assert sorted(n for n, _ in trainer.pm.optim_params) == sorted(f"{a}.{leaf}" for a in adapted
                                                                for leaf in ("lora_a", "lora_b"))
    state_of = {id(p) for p in trainer.optimizer.state}
    for name, p in trainer.pm.dp.named_params:
        adapter = ".lora_" in name
        assert p.requires_grad == adapter and (id(p) in state_of) == adapter and p.grad is None, name
        if before[name] is not None:
            assert torch.equal(p, before[name]) != adapter, name


def test_qlora_checkpoints_hold_the_adapters_and_resume_bitwise(tmp_path):
    from test_lora import checkpoint_keys, stopped_after

    run = {"train.steps": 6, "adapter.kind": "lora", "adapter.base_dtype": "nf4", "adapter.dropout": 0.1}
    straight = Trainer(micro_cfg(tmp_path, **run, **{"log.run_dir": str(tmp_path / "a")})).fit()["losses"]
    b = {**run, "log.run_dir": str(tmp_path / "b"), "checkpoint.save_final": True}
    first = stopped_after(Trainer(micro_cfg(tmp_path, **b)), 3)
    trainable = sum(p.numel() for _, p in first.pm.optim_params)
    saved = first.fit()["checkpoint"]
    keys = checkpoint_keys(saved)
    assert keys and all(".lora_" in k for k in keys), keys  # no base, quantized or not
    size = sum(f.stat().st_size for f in Path(saved).iterdir())
    assert size < 12 * trainable + 2560 * len(keys) + 64 * 1024, (size, trainable)
    state = json.loads((Path(saved) / "trainer.json").read_text())["adapter"]
    # the fingerprint is of the unquantized source: the same as a LoRA run's on that base
    from scaletrain.parallel.adapters import base_fingerprint

    assert state["base"] == base_fingerprint(micro_cfg(tmp_path, **{"adapter.kind": "lora"}))
    resumed = Trainer(micro_cfg(tmp_path, **{**b, "checkpoint.resume": "auto"}))
    assert resumed.step == 3
    resumed.fit()
    assert [r["loss"] for r in read_metrics(tmp_path / "b")] == straight


def test_qlora_with_activation_checkpointing_and_accumulation(tmp_path):
    run = {"train.steps": 3, "adapter.kind": "lora", "adapter.base_dtype": "nf4", "train.micro_batch": 8}
    plain = Trainer(micro_cfg(tmp_path, **run, **{"log.run_dir": str(tmp_path / "p")})).fit()["losses"]
    ac = Trainer(micro_cfg(tmp_path, **run, **{"log.run_dir": str(tmp_path / "c"),
                                               "memory.activation_checkpointing": "full"})).fit()["losses"]
    assert ac == plain  # the recomputed forward dequantizes the same codes
    accum = Trainer(micro_cfg(tmp_path, **{**run, "train.micro_batch": 2, "log.run_dir": str(tmp_path / "g")}))
    assert accum.layout.grad_accum == 4
    torch.testing.assert_close(accum.fit()["losses"], plain, rtol=1e-5, atol=0)


def test_bad_quantized_base_settings_are_one_line_and_exit_2(tmp_path):
    one_line_exit_2(run_here("train", "--adapter.base_dtype=nf4"), "adapter.base_dtype=nf4", "adapter.kind=none",
                    "set adapter.kind=lora")
    one_line_exit_2(run_here("train", "--adapter.kind=dora", "--adapter.base_dtype=int8"),
                    "adapter.kind=dora with adapter.base_dtype=int8: not supported")
    one_line_exit_2(run_here("train", "--adapter.kind=lora", "--adapter.base_dtype=nf5"), "adapter.base_dtype",
                    "nf4")
    r = run_here("train", *MICRO_ARGS, f"--log.run_dir={tmp_path / 'a'}", "--adapter.kind=lora",
                 "--adapter.base_dtype=nf4", "--model.dim=96", "--model.n_heads=2")
    one_line_exit_2(r, "adapter.base_dtype=nf4: layers.0.attn.wq has 96 in-features, not a multiple of NF4's block "
                       "of 64 (allowed: 64, 128, 192, ...)")
    r = run_here("train", *MICRO_ARGS, f"--log.run_dir={tmp_path / 'z'}", "--adapter.kind=lora",
                 "--adapter.base_dtype=int8", "--nproc=2", "--parallel.zero=3")  # refused before any rank starts
    one_line_exit_2(r, "adapter.base_dtype=int8 with parallel.zero=3", "use adapter.base_dtype=nf4")
    r = run_here("train", *MICRO_ARGS, f"--log.run_dir={tmp_path / 't'}", "--adapter.kind=lora",
                 "--adapter.base_dtype=nf4", "--nproc=2", "--parallel.tp=2")  # pp and compile are not refused
    one_line_exit_2(r, "adapter.base_dtype=nf4 with parallel.tp=2: not supported", "set parallel.tp=1")


# --- the planner: which GPU fits a LoRA / QLoRA fine-tune ----------------------------------------

def test_the_planner_fits_a_70b_qlora_on_one_80gb_gpu_but_not_lora_or_full_fine_tuning():
    from scaletrain.plan import plan

    def best(**adapter):
        return plan("llama-70b", hardware="H100-SXM", nodes=1, gpus_per_node=1, seq_len=2048, global_batch=8,
                    **adapter)["layouts"][0]

    full, lora, qlora = best(), best(adapter="lora"), best(adapter="lora", base_dtype="nf4")
    assert not full.fits and not lora.fits and qlora.fits, (full.memory.total, lora.memory.total, qlora.memory.total)
    # the frozen base: no gradients, no optimizer state; the adapters' (rank 8 on the 7 linears of 80 blocks) alone
    adapters = 80 * 8 * (2 * (8192 + 8192) + 2 * (8192 + 1024) + 3 * (8192 + 28672))
    assert lora.memory.grads == qlora.memory.grads == 4 * adapters
    assert lora.memory.optimizer == 8 * adapters and full.memory.optimizer == 8 * 70_553_706_496
    # the NF4 base: ~0.52 bytes per adapted weight (1 byte of scales per 64, a factor per 64 x 128 or 64 x 256);
    # the embedding, norms and head stay fp32 (bf16-mixed keeps fp32 weights), as do the adapters
    base = 80 * (2 * 8192 * 8192 + 2 * 8192 * 1024 + 3 * 8192 * 28672)
    rest = 70_553_706_496 - base
    assert qlora.memory.params == pytest.approx(base * (0.5 + 1 / 64) + rest * 4 + adapters * 4, rel=0.002)
    assert lora.memory.params == 4 * (70_553_706_496 + adapters)


def test_plan_takes_the_adapter_keys_of_a_config(tmp_path):
    r = run_here("plan", "llama-8b", "--hardware", "A100-40GB", "--gpus-per-node", "1", "--seq-len", "2048",
                 "--global-batch", "8", "--adapter.kind=lora", "--adapter.base_dtype=nf4")
    assert r.returncode == 0, r.stdout + r.stderr  # fits: exit 0
    full = run_here("plan", "llama-8b", "--hardware", "A100-40GB", "--gpus-per-node", "1", "--seq-len", "2048",
                    "--global-batch", "8")
    assert full.returncode == 1 and "DOES NOT FIT" in full.stdout
    one_line_exit_2(run_here("plan", "llama-8b", "--adapter.base_dtype=nf4"), "adapter.base_dtype=nf4",
                    "adapter.kind=none")


def test_a_custom_module_takes_a_quantized_base(tmp_path):
    from scaletrain.errors import ConfigError
    from test_any_module import tiny_lm

    run = {"train.steps": 4, "adapter.kind": "lora", "adapter.rank": 4, "adapter.base_dtype": "int8"}
    fresh = dict(tiny_lm().named_parameters())
    trainer = Trainer(micro_cfg(tmp_path, **run), model=tiny_lm())
    bases = {n: p for n, p in trainer.pm.dp.named_params if isinstance(p, FrozenWeight)}
    assert sorted(bases) == sorted(f"blocks.{i}.{j}.weight" for i in range(3) for j in (1, 3))
    for name, p in bases.items():  # the module's own weights, quantized per row
        scale = fresh[name].abs().amax(dim=1) / 127
        torch.testing.assert_close(p.dequantize(), torch.round(fresh[name] / scale[:, None]) * scale[:, None])
    losses = trainer.fit()["losses"]
    assert losses[-1] < losses[0]
    with pytest.raises(ConfigError, match=r"^adapter.base_dtype=nf4: blocks.0.1 has 48 in-features, not a multiple"):
        Trainer(micro_cfg(tmp_path / "nf4", **{**run, "adapter.base_dtype": "nf4"}), model=tiny_lm())


@pytest.mark.parametrize("base", BASES)
def test_a_one_process_qlora_build_never_holds_the_dense_base(tmp_path, monkeypatch, base):
    """The adapted linears' bases are quantized as each weight gets its values, so building peaks
    at about the quantized model and one dense weight, far below the dense bases' bytes."""
    from torchao.quantization.quantize_.workflows.nf4 import nf4_tensor

    from scaletrain.measure import LiveMemory

    # torchao quantizes NF4 codes in chunks of 1M values with ~128 bytes of scratch each: a
    # fixed cost, made small here so that the model's own bytes show (the codes are the same)
    monkeypatch.setattr(nf4_tensor, "CHUNK_SIZE", 2**14)
    live = LiveMemory()  # every tensor storage alive, from before the build on
    with live:
        trainer = Trainer(micro_cfg(tmp_path, **{"model.dim": 256, "model.n_layers": 8, "model.n_heads": 4,
                                                 "adapter.kind": "lora", "adapter.base_dtype": base}))
    bases = [m.weight for m in trainer.model.modules() if isinstance(m, LoRALinear)]
    assert all(type(w).__name__ in ("FrozenWeight", "NF4Tensor") for w in bases)
    dense = sum(4 * w.numel() for w in bases)  # the fp32 bases that a dense build holds all at once
    largest = max(4 * w.numel() for w in bases)
    # what the built model holds, plus a few dense weights' worth (one value, its rounding, absolute
    # values or scaled blocks, the quantizer's scratch); and well under the dense bases (the old
    # build's peak was above them; bf16 bases alone are half of them)
    figures = (live.peak / 2**20, live.live / 2**20, largest / 2**20, dense / 2**20)  # MiB
    assert live.peak < live.live + 5 * largest, figures
    assert live.peak < 0.75 * dense, figures
