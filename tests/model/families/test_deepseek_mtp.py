"""DeepSeek-V3's multi-token prediction modules in and out (model/mtp.py): a checkpoint as DeepSeek ships it
(the module as the layer after the last: enorm, hnorm, eh_proj, shared_head.norm, a whole block with its
experts and routing bias, copies of the embedding and head) imports with model.mtp_depth=1 and exports back
to the same bytes; transformers drops those layers when it loads, so the round trip is checked on the files.
The depth-1 logits equal transformers' own MtpLayer (modeling_layers) built from the same tensors.
Training on 2 ranks under ZeRO-3 and tp 2 equals one process; pp, cp, ep and sp are refused in one line."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from safetensors.torch import load_file, save_file  # noqa: E402

from scaletrain import cli  # noqa: E402
from scaletrain.config import load_config  # noqa: E402
from scaletrain.errors import CheckpointError  # noqa: E402
from scaletrain.model.hf import load_hf_weights  # noqa: E402
from scaletrain.model.transformer import Transformer  # noqa: E402
from scaletrain.parallel.init import load_weights  # noqa: E402
from scaletrain.trained.export_hf import save_hf  # noqa: E402
from scaletrain.verify import TOLERANCES  # noqa: E402
from test_deepseek import make_hf  # noqa: E402
from test_deepseek_parallel import MLA, STEPS  # noqa: E402
from test_expert_parallel import assert_same_gradients, fit_one  # noqa: E402

from conftest import (  # noqa: E402
    MICRO,
    assert_same_run,
    assert_same_weights,
    micro_cfg,
    micro_overrides,
    run_group,
    run_here,
)


def with_mtp(folder, shape: str = "plain-query-groups", **change) -> dict:
    """A tiny DeepSeek-V3 folder with one multi-token prediction module (the last block's tensors moved
    on, then perturbed; its own norms and projection random), as DeepSeek's checkpoints hold it."""
    hf = make_hf(shape, folder, **change)
    n, d = hf.config.num_hidden_layers, hf.config.hidden_size
    tensors = load_file(folder / "model.safetensors")
    g = torch.Generator().manual_seed(5)
    last = {k: v for k, v in tensors.items() if k.startswith(f"model.layers.{n - 1}.")}
    mtp = {k.replace(f"layers.{n - 1}.", f"layers.{n}."): v + 0.05 * torch.randn(v.shape, generator=g)
           for k, v in last.items()}
    head = tensors.get("lm_head.weight", tensors["model.embed_tokens.weight"])
    mtp.update({f"model.layers.{n}.enorm.weight": 1 + 0.3 * torch.randn(d, generator=g),
                f"model.layers.{n}.hnorm.weight": 1 + 0.3 * torch.randn(d, generator=g),
                f"model.layers.{n}.eh_proj.weight": 0.1 * torch.randn(d, 2 * d, generator=g),
                f"model.layers.{n}.shared_head.norm.weight": 1 + 0.3 * torch.randn(d, generator=g),
                f"model.layers.{n}.shared_head.head.weight": head.clone(),
                f"model.layers.{n}.embed_tokens.weight": tensors["model.embed_tokens.weight"].clone()})
    save_file({**tensors, **mtp}, folder / "model.safetensors", metadata={"format": "pt"})
    return {**tensors, **mtp}


def ours(folder, depth: int = 1) -> Transformer:
    cfg = load_config(None, {"model.from_hf": str(folder), "model.mtp_depth": depth, "data.seq_len": 16}).model
    model = Transformer(cfg)
    load_weights(model, load_hf_weights(folder, cfg), str(folder))
    return model


@pytest.mark.parametrize("shape", ["plain-query-groups", "ungrouped-tied"])
def test_export_then_reload_gives_the_same_bytes(tmp_path, shape):
    source = with_mtp(tmp_path / "hf", shape)
    model = ours(tmp_path / "hf")
    assert model.cfg.mtp_depth == 1
    n = model.cfg.n_layers
    assert torch.equal(model.mtp["0"].eh_proj.weight, source[f"model.layers.{n}.eh_proj.weight"])
    assert torch.equal(model.mtp["0"].head_norm.weight, source[f"model.layers.{n}.shared_head.norm.weight"])
    save_hf(model, tmp_path / "out")
    back = load_file(tmp_path / "out" / "model.safetensors")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["num_nextn_predict_layers"] == 1
    assert sorted(back) == sorted(source)
    for key, t in source.items():
        assert back[key].dtype == t.dtype and torch.equal(back[key], t), key
    again = ours(tmp_path / "out")  # and in again: the same tensors
    for (name, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    # transformers loads the export (leaving the module out, as it does DeepSeek's) and computes our logits
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager").eval()
    tokens = torch.randint(0, 128, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (hf(tokens).logits - model.eval()(tokens)).abs().max() <= 1e-5


def test_depth_one_equals_transformers_mtp_layer(tmp_path):
    """transformers' MtpLayer (its speculative decoding's module) from the checkpoint's tensors: the
    embedding-first concatenation, the block over positions 0 .. T-1, the post norm and the shared head."""
    from transformers.modeling_layers import MtpLayer
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds

    source = with_mtp(tmp_path / "hf")
    model = ours(tmp_path / "hf").eval()
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager").eval()
    n = hf.config.num_hidden_layers
    layer = MtpLayer(hf.config, ds.DeepseekV3DecoderLayer, ds.DeepseekV3RMSNorm, n).eval()
    prefix = f"model.layers.{n}."
    state = {k[len(prefix):].replace("shared_head.norm.", "post_norm."): v for k, v in source.items()
             if k.startswith(prefix) and not k.endswith(("embed_tokens.weight", "shared_head.head.weight"))}
    state = {k if k.split(".")[0] in ("enorm", "hnorm", "eh_proj", "post_norm") else f"mtp_block.{k}": v
             for k, v in state.items()}
    experts = sorted({int(k.split(".")[3]) for k in state if ".experts." in k})  # fused in memory, gate rows first
    each = {m: [state.pop(f"mtp_block.mlp.experts.{e}.{m}.weight") for e in experts]
            for m in ("gate_proj", "up_proj", "down_proj")}
    state["mtp_block.mlp.experts.gate_up_proj"] = torch.stack([torch.cat([g, u]) for g, u in
                                                               zip(each["gate_proj"], each["up_proj"], strict=True)])
    state["mtp_block.mlp.experts.down_proj"] = torch.stack(each["down_proj"])
    missing, unexpected = layer.load_state_dict(state, strict=False)
    assert not unexpected and all("e_score_correction_bias" not in m for m in missing), (missing, unexpected)
    tokens = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(2))
    T = 11
    with torch.no_grad():
        seen = {}  # the last block's output, before the final norm
        hook = hf.model.layers[n - 1].register_forward_hook(lambda m, a, o: seen.setdefault("h", o[0] if
                                                                                            isinstance(o, tuple)
                                                                                            else o))
        hf.model(tokens[:, :T])
        hook.remove()
        h = seen["h"]
        positions = torch.arange(T)[None]
        rope = hf.model.rotary_emb(h, positions)
        mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
        theirs = layer(hf.model.embed_tokens(tokens[:, 1:T + 1]), h, rope, mask, positions, None)
        theirs = hf.lm_head(theirs)
        model.train()
        mine = model(tokens[:, :T])[:, T:]  # depth 1's logits
    assert theirs.abs().max() > 0.1
    # (the last position has no token 1 ahead inside the window: ours is never counted, so not compared)
    assert (mine - theirs)[:, :T - 1].abs().max() <= 1e-5


def test_a_checkpoint_without_the_modules_or_with_other_copies_is_one_line(tmp_path, capfd):
    make_hf("plain-query-groups", tmp_path / "plain")
    with pytest.raises(CheckpointError, match=r"model.mtp_depth=1, but it holds no multi-token prediction modules"):
        ours(tmp_path / "plain")
    source = with_mtp(tmp_path / "other")
    n = 3
    source[f"model.layers.{n}.embed_tokens.weight"] = source[f"model.layers.{n}.embed_tokens.weight"] + 1
    save_file(source, tmp_path / "other" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"model.layers.{n}.embed_tokens.weight differs from "
                                              r"model.embed_tokens.weight"):
        ours(tmp_path / "other")
    # without model.mtp_depth the import leaves the module out, as transformers does
    assert ours(tmp_path / "other", depth=0).mtp is None


@pytest.mark.parametrize("extra,words", [
    (["--parallel.pp=2", "--train.grad_accum=2"],
     "model.mtp_depth=1 with parallel.pp=2 is not supported: the last stage"),
    (["--parallel.cp=2"], "model.mtp_depth=1 with parallel.cp=2 is not supported"),
    (["--parallel.tp=2", "--parallel.sp=true"], "model.mtp_depth=1 with parallel.sp=true is not supported yet"),
    (["--train.objective=preference"], "train.objective=preference reads the next-token logits alone"),
])
def test_layouts_it_cannot_train_are_one_line_exit_2(extra, words):
    r = run_here("train", "--model.mtp_depth=1", "--nproc=2", "--train.steps=1", *extra)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert len(lines) == 1 and words in lines[0], lines



# ---- layouts: 2 ranks (gloo on CPU) against one process ---------------------------------------------------

# DeepSeek-V3's shape (test_deepseek_parallel's), two prediction depths, the second's block a mixture of experts
MTP = {**MLA, "model.mtp_depth": 2, "model.mtp_loss_weight": 0.5}
LAYOUTS = {"zero3": {"parallel.dp_shard": 2, "parallel.zero": 3}, "tp2": {"parallel.tp": 2},
           "ddp2": {"parallel.dp_replicate": 2}}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return fit_one(micro_cfg(tmp_path_factory.mktemp("one"), **MTP))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mtp-layouts")
    jobs = [{"overrides": micro_overrides(tmp / name, **{**MTP, **extra}), "probe": "test_expert_parallel:probe"}
            for name, extra in LAYOUTS.items()]
    code, results, err = run_group(2, jobs, tmp)
    assert code == 0, err
    return dict(zip(LAYOUTS, results, strict=True))


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("name", LAYOUTS)
def test_training_with_mtp_equals_one_process(runs, reference, name):
    got = runs[name]
    grads = {}
    for rank in got["ranks"]:
        grads.update(rank["probe"]["grads"])
    assert any(n.startswith("mtp.1.block.moe") for n in grads)
    assert_same_gradients(grads, reference["grads"], name)
    assert_same_run(got["history"], reference["history"], steps=STEPS, tol=TOLERANCES["32-true"], what=name)
    assert_same_weights(got["weights"], reference["weights"], tol=1e-3, what=name)
    for row, want in zip(got["history"], reference["history"], strict=True):  # each depth's loss, over every rank
        for k in (1, 2):
            assert row[f"mtp_loss/{k}"] == pytest.approx(want[f"mtp_loss/{k}"], rel=1e-5), (name, row["step"], k)


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("layout", [["--parallel.tp=2"], ["--parallel.dp_shard=2", "--parallel.zero=3"]],
                         ids=["tp2", "zero3"])
def test_verify_passes_with_mtp(tmp_path, capfd, layout):
    from test_window_parallel import _toml

    config = tmp_path / "verify.toml"
    config.write_text(_toml({**MICRO, **MTP, "log.run_dir": str(tmp_path / "userrun")}))
    code = cli.main(["verify", "--config", str(config), "--steps=3", *layout])
    out = "".join(capfd.readouterr())
    assert code == 0, out
    line = next(line for line in out.splitlines() if line.startswith("largest relative difference"))
    assert line.endswith("(precision 32-true): PASS"), line
