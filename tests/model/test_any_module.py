"""Any nn.Module: `Trainer(cfg, model=module, loss_fn=...)` trains a model scaletrain did not
build, under data parallelism (DDP, ZeRO 1-3), precision, activation checkpointing and compile,
exactly as one process does; tensor and pipeline parallelism are refused with one line."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from scaletrain.errors import ConfigError
from scaletrain.layout import Layout
from scaletrain.parallel.parallelize import find_blocks, parallelize_module
from scaletrain.precision import Precision
from scaletrain.runtime import Runtime
from scaletrain.train.trainer import Trainer
from scaletrain.verify import TOLERANCES

from conftest import assert_same_run, micro_cfg, micro_overrides, read_metrics, run_group


class TinyLM(nn.Module):
    """Not our transformer: a GRU-free, attention-free token mixer, blocks in a ModuleList."""

    def __init__(self, vocab: int = 256, dim: int = 48, n_blocks: int = 3):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 2 * dim), nn.GELU(),
                                                  nn.Linear(2 * dim, dim)) for _ in range(n_blocks))
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        # causal mixing: each position adds the running mean of the ones before it
        x = x + torch.cumsum(x, dim=1) / torch.arange(1, x.shape[1] + 1, device=x.device)[:, None]
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)  # (B, T, vocab)


def tiny_lm() -> TinyLM:
    torch.manual_seed(7)
    return TinyLM()


def test_a_custom_module_trains_and_resumes_exactly(tmp_path):
    straight = Trainer(micro_cfg(tmp_path, **{"train.steps": 8, "log.run_dir": str(tmp_path / "a")}),
                       model=tiny_lm()).fit()
    assert straight["losses"][-1] < straight["losses"][0]
    first = Trainer(micro_cfg(tmp_path, **{"train.steps": 8, "log.run_dir": str(tmp_path / "b"),
                                           "checkpoint.save_final": True}), model=tiny_lm())
    first.end_of_step = lambda t, g, real=first.end_of_step: (*real(t, g)[:2], first.step >= 4)  # stopped after 4 steps
    assert first.fit()["checkpoint"].endswith("step_00000004")
    resumed = Trainer(micro_cfg(tmp_path, **{"train.steps": 8, "log.run_dir": str(tmp_path / "b"),
                                             "checkpoint.resume": "auto"}), model=tiny_lm())
    assert resumed.step == 4
    resumed.fit()
    assert [r["loss"] for r in read_metrics(tmp_path / "b")] == straight["losses"]


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_on_a_custom_module_keeps_the_losses(tmp_path, mode):
    plain = Trainer(micro_cfg(tmp_path, **{"train.steps": 3, "log.run_dir": str(tmp_path / "p")}),
                    model=tiny_lm()).fit()
    module = tiny_lm()
    ac = Trainer(micro_cfg(tmp_path, **{"train.steps": 3, "log.run_dir": str(tmp_path / "c"),
                                        "memory.activation_checkpointing": mode}), model=module)
    assert all(type(b).__name__ == "CheckpointWrapper" for b in module.blocks)
    assert ac.fit()["losses"] == pytest.approx(plain["losses"], rel=1e-6)


def test_a_hugging_face_model_trains_as_a_module_with_its_own_loss(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, max_position_embeddings=64,
                                      use_cache=False)  # training: no KV cache (it would grow during recompute)
    hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    assert find_blocks(hf) is hf.model.layers

    def loss_fn(out, targets):  # the protocol: the sum of the token losses
        return F.cross_entropy(out.logits.flatten(0, 1).float(), targets.flatten(), reduction="sum")

    result = Trainer(micro_cfg(tmp_path, **{"train.steps": 6, "data.seq_len": 16,
                                            "memory.activation_checkpointing": "full"}),
                     model=hf, loss_fn=loss_fn).fit()
    assert result["losses"][-1] < result["losses"][0]


def test_tensor_and_pipeline_parallel_are_refused_for_a_custom_module(tmp_path):
    cfg = micro_cfg(tmp_path)
    for tp, pp in ((2, 1), (1, 2)):
        rt = Runtime(0, 0, 2, 2, torch.device("cpu"), Layout(pp=pp, tp=tp))
        with pytest.raises(ConfigError, match=rf"^parallel.tp={tp}, parallel.pp={pp}: tensor and pipeline "
                                              "parallelism split models scaletrain knows"):
            parallelize_module(tiny_lm(), cfg, rt, Precision(cfg.precision, torch.device("cpu")))


def test_context_parallelism_is_refused_for_a_custom_module(tmp_path):
    cfg = micro_cfg(tmp_path)
    rt = Runtime(0, 0, 2, 2, torch.device("cpu"), Layout(cp=2))
    with pytest.raises(ConfigError, match=r"^parallel.cp=2: context parallelism splits the attention of models "
                                          r"scaletrain builds .* set parallel.cp=1$"):
        parallelize_module(tiny_lm(), cfg, rt, Precision(cfg.precision, torch.device("cpu")))


def test_a_module_without_blocks_cannot_be_checkpointed(tmp_path):
    with pytest.raises(ConfigError, match="Linear has no repeated blocks scaletrain can find"):
        Trainer(micro_cfg(tmp_path, **{"memory.activation_checkpointing": "full"}), model=nn.Linear(4, 4))


@pytest.mark.multiproc
def test_data_parallel_custom_module_trains_like_one_process(tmp_path):
    steps = {"train.steps": 5, "train.global_batch": 8}
    jobs = [{"overrides": micro_overrides(tmp_path / f"z{z}", **steps, **{"parallel.zero": z}),
             "module": "test_any_module:tiny_lm"} for z in (0, 1, 2, 3)]
    code, results, err = run_group(2, jobs, tmp_path)
    assert code == 0, err
    one = Trainer(micro_cfg(tmp_path, **steps, **{"log.run_dir": str(tmp_path / "one")}), model=tiny_lm()).fit()
    for z, result in zip((0, 1, 2, 3), results, strict=True):  # every step's loss and gradient norm
        assert_same_run(result["history"], one["history"], steps=5, tol=TOLERANCES["32-true"], what=f"zero {z}")
