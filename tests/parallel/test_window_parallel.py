"""Sliding-window and chunked attention (model/window.py) under every layout that splits attention:
context parallelism (ring, allgather, Ulysses; cp 4 makes ring skip blocks the window excludes
whole), tensor parallelism (with sequence parallelism) and pipeline parallelism train like one
process, step by step, on sequences several windows long (models made here, and a Mistral
imported from transformers, whose one-process logits tests/model/test_window.py holds to
transformers'); and `scaletrain verify` passes them.
OLMo 2's q/k norms over the whole projections (qk_norm_scope=projection) under tensor parallelism
(the sum of squares over the tp ranks) likewise."""

from __future__ import annotations

import pytest

from scaletrain import cli
from scaletrain.config import load_config

from conftest import MICRO, Lazy, assert_group_trains_alike, fit_reference, micro_overrides, run_group

pytestmark = pytest.mark.multiproc

# SGD without clipping: each update is the gradient itself, so a gradient that misses a rank's share
# shows in the final weights
BASE = {"train.steps": 3, "train.global_batch": 4, "train.micro_batch": 2, "model.tie_embeddings": False,
        "optim.name": "sgd", "optim.lr": 0.1, "train.grad_clip": 0.0}
LLAMA = {"model.norm": "rmsnorm", "model.activation": "swiglu", "model.position": "rope", "model.n_kv_heads": 2}
# windows that divide neither the sequence (32) nor its cp chunks
MODELS = {
    "sliding": {**LLAMA, "model.sliding_window": 5},
    "chunked": {**LLAMA, "model.attn_chunk": 6},
    # Gemma-shaped: soft-capped scores, local and global blocks (cp refuses the caps)
    "sliding-capped-global": {**LLAMA, "model.sliding_window": 5, "model.global_every": 2, "model.attn_softcap": 2.0},
    # OLMo 2-shaped: norms after the sub-blocks, q/k norms over the whole projections
    "olmo2-shaped": {**LLAMA, "model.n_kv_heads": 0, "model.norm_placement": "post", "model.qk_norm": True,
                     "model.qk_norm_scope": "projection", "model.sliding_window": 5},
}
CP = {f"cp2-{m}": {"parallel.cp": 2, "parallel.cp_method": m} for m in ("ring", "allgather", "ulysses")}
TP = {"tp2": {"parallel.tp": 2}, "tp2-sp": {"parallel.tp": 2, "parallel.sp": True}}
PP = {"pp2": {"parallel.pp": 2}}
TWO = {"sliding": {**CP, **TP, **PP}, "chunked": {**CP, "tp2": TP["tp2"], **PP},
       "sliding-capped-global": {"tp2": TP["tp2"], **PP}, "olmo2-shaped": {**TP, **PP, "cp2-ring": CP["cp2-ring"]},
       "mistral-imported": {"cp2-ring": CP["cp2-ring"], "cp2-ulysses": CP["cp2-ulysses"], "tp2-sp": TP["tp2-sp"],
                            **PP}}
FOUR = {"sliding": {"cp4-ring": {"parallel.cp": 4, "parallel.cp_method": "ring"},
                    "cp2xtp2-allgather": {"parallel.cp": 2, "parallel.tp": 2, "parallel.cp_method": "allgather"}},
        "olmo2-shaped": {"tp4-sp": {"parallel.tp": 4, "parallel.sp": True}}}


def window_overrides(model: dict, run_dir, extra: dict) -> dict:
    values = micro_overrides(run_dir, **{**BASE, **model, **extra})
    if "model.from_hf" in model:  # the shape is the checkpoint's
        values = {k: v for k, v in values.items() if not k.startswith(("model.dim", "model.n_"))}
    return values


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> tuple[Lazy, Lazy]:
    """(each model's options, each model's one-process run), made when a test first asks for them and shared by
    the 2- and 4-rank cases (the Mistral imported once)."""
    tmp = tmp_path_factory.mktemp("window-one")
    models = Lazy({**{name: (lambda options=options: options) for name, options in MODELS.items()},
                   "mistral-imported": lambda: imported_mistral(tmp / "mistral-hf")})
    refs = Lazy({name: (lambda name=name: fit_reference(load_config(None, window_overrides(
        models[name], tmp / name, {})))) for name in models.makers})
    return models, refs


@pytest.mark.slow
@pytest.mark.parametrize("ranks,layouts", [(2, TWO), (4, FOUR)], ids=["2ranks", "4ranks"])
def test_windowed_models_train_alike_under_cp_tp_and_pp(tmp_path, one_process, ranks, layouts):
    models, refs = one_process
    cases = [(f"{name} {layout}", window_overrides(models[name], tmp_path / name / layout, extra), refs[name])
             for name, by_layout in layouts.items() for layout, extra in by_layout.items()]
    assert_group_trains_alike(ranks, tmp_path, cases, steps=3)


def imported_mistral(folder) -> dict:
    """A tiny Mistral made by transformers (window 7 under sequences of 32), saved to `folder`:
    the options that import its shape and start from its weights."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.MistralConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                        sliding_window=7)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    return {"model.from_hf": str(folder), "model.init_from": str(folder), "model.max_seq_len": 64}


def full_logits(trainer):
    """dist_worker's probe: the model's logits over the whole vocabulary on fixed tokens, at the
    weights the run starts from (taken now, before training)."""
    import torch

    from scaletrain.parallel.tensor_parallel import whole

    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        logits = whole(trainer.model.eval()(tokens)).tolist()
    trainer.model.train()
    return lambda: logits


def test_olmo2_under_tp_gives_transformers_logits(tmp_path):
    """OLMo 2 imported (its q/k norms over the whole projections), split over tp 2 (and with
    sequence parallelism): the sharded model's logits, gathered, are transformers' within 1e-5."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.Olmo2Config(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():  # norms off their init: a norm computed over the wrong span must show
        for n, p in hf.named_parameters():
            if "norm" in n:
                p.add_(0.2 * torch.randn_like(p))
    hf.eval().save_pretrained(tmp_path / "hf")
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        ref = hf(tokens).logits
    run = {"model.from_hf": str(tmp_path / "hf"), "model.init_from": str(tmp_path / "hf"), "model.max_seq_len": 64,
           "train.steps": 1, "train.global_batch": 2, "train.micro_batch": 2}
    layouts = {"tp2": {"parallel.tp": 2}, "tp2-sp": {"parallel.tp": 2, "parallel.sp": True}}
    jobs = [{"overrides": {k: v for k, v in micro_overrides(tmp_path / name, **run, **extra).items()
                           if not k.startswith(("model.dim", "model.n_"))},
             "probe": "test_window_parallel:full_logits"} for name, extra in layouts.items()]
    code, results, err = run_group(2, jobs, tmp_path)
    assert code == 0, err
    for name, result in zip(layouts, results, strict=True):
        mine = torch.tensor(result["ranks"][0]["probe"])
        assert mine.shape == ref.shape and ref.abs().max() > 0.1
        assert (mine - ref).abs().max() <= 1e-5, (name, (mine - ref).abs().max())


def _toml(values: dict) -> str:
    sections: dict[str, list[str]] = {}
    for key, value in values.items():
        section, name = key.rsplit(".", 1)
        text = ("true" if value else "false") if isinstance(value, bool) else \
            f'"{value}"' if isinstance(value, str) else repr(value)
        sections.setdefault(section, []).append(f"{name} = {text}")
    return "".join(f"[{s}]\n" + "\n".join(lines) + "\n" for s, lines in sections.items())


@pytest.mark.usefixtures("forked_launches")
# verify's command on a windowed model, at one layout: how tp 2 and pp 2 train the same model ("sliding") is
# test_windowed_models_train_alike_under_cp_tp_and_pp's, step by step and in the final weights
@pytest.mark.parametrize("layout", [["--parallel.cp=2", "--parallel.cp_method=ring"]], ids=["cp2-ring"])
def test_verify_passes_a_windowed_model(tmp_path, capfd, layout):
    config = tmp_path / "verify.toml"
    config.write_text(_toml({**MICRO, **LLAMA, "model.sliding_window": 5, "model.n_layers": 2,
                             "model.tie_embeddings": False, "train.micro_batch": 2,
                             "log.run_dir": str(tmp_path / "userrun")}))
    code = cli.main(["verify", "--config", str(config), "--steps=3", *layout])
    out = "".join(capfd.readouterr())
    assert code == 0, out
    line = next(line for line in out.splitlines() if line.startswith("largest relative difference"))
    assert line.endswith("(precision 32-true): PASS"), line
