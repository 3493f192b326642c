"""Generation with a key/value cache: the same logits as the full forward, one position per new
token, a context window past which it goes on; `scaletrain generate` on a checkpoint and on a
Hugging Face folder, with the data folder's tokenizer."""

from __future__ import annotations

import pytest
import torch

from scaletrain.model.config import model_config
from scaletrain.model.generate import generate
from scaletrain.model.kv_cache import KVCache
from scaletrain.model.transformer import Transformer
from scaletrain.train.trainer import Trainer

from conftest import micro_cfg, run_here

SHAPES = {
    "gpt2": {"position": "learned"},
    "llama-gqa": {"position": "rope", "norm": "rmsnorm", "activation": "swiglu", "n_kv_heads": 2},
}


def tiny(**kw) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(model_config({"vocab_size": 64, "dim": 32, "n_layers": 2, "n_heads": 4, "max_seq_len": 24,
                                      **kw}))
    for p in model.parameters():  # larger weights than init: logits that differ token to token
        torch.nn.init.normal_(p, std=0.3)
    return model.eval()


@pytest.mark.parametrize("shape", SHAPES)
def test_cached_logits_equal_the_full_forward(shape):
    model = tiny(**SHAPES[shape])
    tokens = torch.randint(0, 64, (2, 20))
    full = model(tokens)
    cache = KVCache(24)
    parts = [model(tokens[:, :7], cache), model(tokens[:, 7:8], cache), model(tokens[:, 8:13], cache)]
    parts += [model(tokens[:, t:t + 1], cache) for t in range(13, 20)]
    torch.testing.assert_close(torch.cat(parts, dim=1), full, rtol=1e-5, atol=1e-5)
    assert cache.length == 20


@pytest.mark.parametrize("shape", SHAPES)
def test_each_new_token_costs_one_position_and_the_tokens_match(shape):
    model = tiny(**SHAPES[shape])
    seen = []
    model.register_forward_pre_hook(lambda m, args: seen.append(args[0].shape[1]))
    prompt = torch.randint(0, 64, (1, 5))
    greedy = dict(window=24, temperature=1.0, top_k=1)
    plain = generate(lambda x: model(x), prompt, 12, **greedy)
    plain_positions = sum(seen)
    seen.clear()
    cached = generate(lambda x, cache: model(x, cache), prompt, 12, cache=KVCache(24), **greedy)
    assert torch.equal(cached, plain)
    assert seen == [5] + [1] * 11  # the prompt once, then one position per new token
    assert plain_positions == sum(range(5, 17))  # without the cache: the whole context every time


def test_past_the_window_it_goes_on_from_the_last_half():
    model = tiny(position="rope", norm="rmsnorm")
    seen = []
    model.register_forward_pre_hook(lambda m, args: seen.append(args[0].shape[1]))
    out = generate(lambda x, cache: model(x, cache), torch.randint(0, 64, (1, 30)), 40, window=8,
                   temperature=1.0, top_k=1, cache=KVCache(8))
    assert out.shape == (1, 70)
    assert seen[0] == 8 and max(seen) == 8 and 4 in seen  # the prompt's last 8, then re-encodes of 4
    assert sum(seen) <= 8 + 2 * 40  # at most two positions per new token on average


def test_cli_generate_from_a_checkpoint_and_a_hugging_face_folder(tmp_path):
    pytest.importorskip("safetensors")
    cfg = micro_cfg(tmp_path, **{"train.steps": 2, "checkpoint.save_final": True})
    Trainer(cfg).fit()
    ckpt = tmp_path / "run" / "checkpoints" / "step_00000002"
    args = ["--prompt", "The ", "--max-new-tokens", "20", "--seed", "3"]
    r = run_here("generate", str(ckpt), *args)
    assert r.returncode == 0, r.stderr
    text = r.stdout.rstrip("\n")
    assert text.startswith("The ") and len(text.encode()) >= 4 + 20 - 3  # byte-level: 20 new bytes, printable
    assert run_here("generate", str(ckpt), *args).stdout == r.stdout  # the seed fixes the draws
    r = run_here("export", str(ckpt), "--format", "hf", "--out", str(tmp_path / "hf"))
    assert r.returncode == 0, r.stderr
    r2 = run_here("generate", str(tmp_path / "hf"), *args)
    assert r2.returncode == 0, r2.stderr
    assert r2.stdout.startswith("The ")
    # bad input: one line, exit 2
    r = run_here("generate", str(tmp_path), "--prompt", "x")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "neither a checkpoint" in r.stderr
    r = run_here("generate", str(ckpt), "--prompt", "x", "--temperature", "0")
    assert r.returncode == 2 and "--temperature 0.0 must be above 0" in r.stderr
