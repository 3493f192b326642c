"""Sliding-window and chunked attention (model/window.py) against transformers: the families
scaletrain imports with a window (Mistral, Qwen2, Phi-3, Mixtral, Gemma 2 and 3) at sequences 2-4x
their window give transformers' logits in fp32, and greedy generation through our KV cache (which
keeps only the window) picks the tokens of transformers' model run on the whole sequence each
step. The masks themselves against transformers' mask functions."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from scaletrain.config import load_config  # noqa: E402
from scaletrain.errors import ConfigError  # noqa: E402
from scaletrain.model.generate import generate  # noqa: E402
from scaletrain.model.kv_cache import KVCache  # noqa: E402
from scaletrain.model.transformer import Transformer  # noqa: E402
from scaletrain.model.window import Window  # noqa: E402

from conftest import model_from_hf  # noqa: E402

TOL = 1e-5
WINDOW = 7  # (sequences of 2-4 windows that it does not divide)
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6, sliding_window=WINDOW)
FAMILIES = {
    "mistral": ("MistralConfig", TINY),
    "qwen2": ("Qwen2Config", dict(TINY, use_sliding_window=True, max_window_layers=0)),
    "phi3": ("Phi3Config", dict(TINY, pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    "mixtral": ("MixtralConfig", dict(TINY, num_local_experts=4)),
    # soft-capped scores, a global block every 2nd
    "gemma2": ("Gemma2Config", dict(TINY, head_dim=16, query_pre_attn_scalar=24, attn_logit_softcapping=1.0,
                                    final_logit_softcapping=2.0)),
    "gemma3": ("Gemma3TextConfig", dict(TINY, num_hidden_layers=4, head_dim=24, sliding_window_pattern=2,
                                        rope_parameters={"full_attention": {"rope_type": "default",
                                                                            "rope_theta": 1000000.0},
                                                         "sliding_attention": {"rope_type": "default",
                                                                               "rope_theta": 10000.0}})),
}


def make_hf(name: str, folder, **change):
    cls, kw = FAMILIES[name]
    torch.manual_seed(0)
    config = getattr(transformers, cls)(**{**kw, **change})
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():  # norms off their init: a wrong mapping of them must show
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(0.2 * torch.randn_like(p))
    model.eval().save_pretrained(folder)
    return model


def ours_from(folder, seq_len: int) -> Transformer:
    return model_from_hf(folder, seq_len)


@pytest.mark.parametrize("name", FAMILIES)
def test_logits_and_generation_past_the_window_match_transformers(name, tmp_path):
    """At 2, 3 and 4 windows (and lengths between), logits within 1e-5 of transformers' in fp32;
    and greedy generation from a prompt longer than the window, through our cache, picks the
    tokens transformers' model picks on the whole sequence each step (not its `generate`, which
    stops at an end-of-sequence token: Phi-3's is 2, inside the tiny vocabulary)."""
    hf = make_hf(name, tmp_path)
    ours = ours_from(tmp_path, seq_len=4 * WINDOW)
    assert ours.cfg.sliding_window == WINDOW
    tokens = torch.randint(0, 128, (2, 4 * WINDOW + 1), generator=torch.Generator().manual_seed(1))
    for T in (2 * WINDOW, 3 * WINDOW + 2, 4 * WINDOW + 1):
        with torch.no_grad():
            ref, mine = hf(tokens[:, :T]).logits, ours(tokens[:, :T])
        assert ref.abs().max() > 0.1
        assert (mine - ref).abs().max() <= TOL, (T, (mine - ref).abs().max())
    # the window bites: the whole sequence's attention would give other logits
    whole = Transformer(ours.cfg.__class__(**{**ours.cfg.__dict__, "sliding_window": 0, "global_every": 0}))
    whole.load_state_dict(ours.state_dict())
    with torch.no_grad():
        assert (whole.eval()(tokens) - hf(tokens).logits).abs().max() > 100 * TOL

    prompt, new = tokens[:1, :WINDOW + 3], 2 * WINDOW
    expected = prompt
    with torch.no_grad():
        for _ in range(new):
            expected = torch.cat([expected, hf(expected).logits[:, -1:].argmax(-1)], dim=1)
    cache = KVCache(64)
    mine = generate(lambda x, c: ours(x, c), prompt, new, window=64, temperature=1.0, top_k=1, cache=cache)
    assert mine.tolist() == expected.tolist()
    local = [n for n, b in ours.layers.items() if b.attn.window is not None]
    assert local and all(cache.positions_held(n) == WINDOW - 1 for n in local)


@pytest.mark.parametrize("name", ["mistral", "gemma2"])
def test_packed_documents_past_the_window_give_each_documents_own_logits(name, tmp_path):
    """Documents packed in one sequence (data.document_mask), each longer than the window: the
    logits at each document's positions are transformers' on that document alone."""
    hf = make_hf(name, tmp_path)
    cfg = load_config(None, {"model.from_hf": str(tmp_path), "data.seq_len": 32}).model
    ours = Transformer(cfg, separator=3)
    ours.load_state_dict(ours_from(tmp_path, 32).state_dict())
    g = torch.Generator().manual_seed(4)
    docs = [torch.randint(4, 128, (1, n), generator=g) for n in (2 * WINDOW + 5, 3 * WINDOW - 2)]
    docs[0][0, -1] = 3  # the separator ends the first document
    with torch.no_grad():
        mine = ours.eval()(torch.cat(docs, dim=1))
        ref = torch.cat([hf(d).logits for d in docs], dim=1)
    assert (mine - ref).abs().max() <= TOL


def test_a_qwen2_that_slides_some_layers_only_is_refused_in_one_line(tmp_path):
    make_hf("qwen2", tmp_path, max_window_layers=1)
    with pytest.raises(ConfigError) as e:
        load_config(None, {"model.from_hf": str(tmp_path), "data.seq_len": 16})
    (line,) = e.value.lines
    assert 'layer_types=["full_attention", "sliding_attention"] slides 1 of the 2 layers; scaletrain slides every ' \
           "layer or none" in line, line
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "layer_types": ["sliding_attention"] * 2}))
    assert load_config(None, {"model.from_hf": str(tmp_path), "data.seq_len": 16}).model.sliding_window == WINDOW


@pytest.mark.parametrize("size", [1, 3, 7])
def test_the_masks_are_transformers_masks(size):
    """Window.allows against transformers' own mask functions (masking_utils), on every query and
    key position of 3 windows and a bit."""
    from transformers.masking_utils import chunked_causal_mask_function, sliding_window_causal_mask_function

    T = 3 * size + 2
    pos = torch.arange(T)
    for window, theirs in ((Window(size), sliding_window_causal_mask_function(size)),
                           (Window(size, chunked=True), chunked_causal_mask_function(size, torch.zeros(1, dtype=int)))):
        zero = torch.tensor(0)
        expected = [[bool(theirs(zero, zero, torch.tensor(i), torch.tensor(j))) for j in range(T)] for i in range(T)]
        assert window.allows(pos, pos).tolist() == expected


def test_the_planners_attention_flops_time_and_memory_follow_the_window():
    """FLOPs per token by hand (a local block counts its window's keys, a global one the sequence);
    the predicted compute of a model whose every block slides stays the same per token however
    long the sequence (the tiles' keys, 2·window - 1, do not grow with it) where the plain model's
    grows; the saved softmax of eager attention holds a tile's keys, not the sequence's."""
    import dataclasses

    from scaletrain.config import ModelConfig
    from scaletrain.hardware import lookup
    from scaletrain.model.flops import flops_per_token, matmul_params
    from scaletrain.plan.activations import layer_activation_bytes
    from scaletrain.plan.spec import Cluster, Layout, Workload
    from scaletrain.plan.time_model import compute_seconds

    gemma = ModelConfig(dim=256, n_layers=4, n_heads=4, position="rope", sliding_window=100, global_every=2)
    plain = dataclasses.replace(gemma, sliding_window=0, global_every=0)
    assert flops_per_token(gemma, 1000) == 6 * matmul_params(gemma) + 12 * 256 * (2 * 100 + 2 * 1000)
    assert flops_per_token(gemma, 100) == flops_per_token(plain, 100)  # a window the sequence fits in
    chunked = dataclasses.replace(plain, attn_chunk=300)
    assert flops_per_token(chunked, 1000) == 6 * matmul_params(plain) + 12 * 256 * 4 * 300

    sliding = dataclasses.replace(plain, sliding_window=512)
    cluster = Cluster(lookup("H100-SXM"), 1, 8)

    def per_token(cfg, seq_len, micro_batch):  # the same tokens per micro-batch at either length
        layout = Layout(micro_batch=micro_batch, grad_accum=1)
        return compute_seconds(cfg, Workload(seq_len=seq_len, global_batch=micro_batch), layout, cluster, 4, False)

    assert per_token(sliding, 4096, 4) == pytest.approx(per_token(sliding, 8192, 2), rel=1e-12)
    assert per_token(plain, 8192, 2) > 1.2 * per_token(plain, 4096, 4)

    wl = Workload(seq_len=4096, global_batch=1, precision="bf16-true", attention="eager")
    saved = {cfg: layer_activation_bytes(cfg, wl, 1, 1, False, "none") for cfg in (sliding, plain)}
    assert saved[plain] - saved[sliding] == 1 * 4 * 4096 * (4096 - (2 * 512 - 1)) * 2  # b·heads·T·(T - keys)·bf16


def test_chunked_attention_is_checked_and_exported_as_llama4():
    from scaletrain.config import ModelConfig
    from scaletrain.model.hf_config import hf_family

    with pytest.raises(ConfigError) as e:
        load_config(None, {"model.sliding_window": 8, "model.attn_chunk": 8})
    assert e.value.lines == ["model.sliding_window=8 and model.attn_chunk=8 are two kinds of local attention; set "
                             "one of them"]
    assert load_config(None, {"model.attn_chunk": 8, "model.global_every": 4}).model.attn_chunk == 8
    assert hf_family(ModelConfig(position="rope", norm="rmsnorm", activation="swiglu", attn_chunk=8)) == "llama4_text"


def test_reading_a_config_and_counting_flops_load_no_torch():
    """scaletrain.model imports the transformer (torch) only when asked for it (model/__init__.py);
    the FLOP count now reads the window's spans, whose module keeps torch to its kernel."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import scaletrain

    code = ("import sys, scaletrain.config, scaletrain.model, scaletrain.model.window, scaletrain.model.flops; "
            "assert 'torch' not in sys.modules, 'torch loaded'")
    tree = str(Path(scaletrain.__file__).parents[1])  # this tree's package, not an installed one
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": tree})
    assert r.returncode == 0, r.stderr
