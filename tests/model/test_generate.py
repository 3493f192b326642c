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


def test_streamed_tokens_are_the_same_draws_and_only_a_window_is_kept():
    model = tiny(position="rope", norm="rmsnorm")
    prompt = torch.randint(0, 64, (1, 5))

    def run(on_token=None):
        return generate(lambda x, cache: model(x, cache), prompt, 30, window=8, temperature=1.0, top_k=0,
                        generator=torch.Generator().manual_seed(1), cache=KVCache(8), on_token=on_token)

    whole = run()
    seen = []
    kept = run(on_token=seen.append)
    assert torch.cat(seen, dim=1).tolist() == whole[:, 5:].tolist()  # each token as drawn, the same draws
    assert kept.tolist() == whole[:, -8:].tolist()  # a stream keeps one window, whatever its length


def test_the_text_stream_hands_on_whole_characters():
    from scaletrain.data.tokenizer import ByteTokenizer
    from scaletrain.model.generate import _TextStream

    text = "añ€😀 z"
    pieces = []
    stream = _TextStream(ByteTokenizer(), pieces.append)
    for b in text.encode():
        stream.add(torch.tensor([[b]]))
    stream.flush()
    assert "".join(pieces) == text and not any("\ufffd" in p for p in pieces)
    assert pieces == ["a", "ñ", "€", "😀", " ", "z"]  # each character as soon as its last byte came
    stream.add(torch.tensor([[0xFF]]))  # a byte that starts no character: handed on at the flush
    stream.flush()
    assert pieces[-1] == "\ufffd"


def test_cli_generate_streams_and_refuses_an_empty_prompt(tmp_path):
    import os
    import select
    import signal
    import subprocess
    import sys

    from conftest import REPO

    cfg = micro_cfg(tmp_path, **{"train.steps": 1, "checkpoint.save_final": True})
    Trainer(cfg).fit()
    ckpt = tmp_path / "run" / "checkpoints" / "step_00000001"
    r = run_here("generate", str(ckpt), "--prompt", "")
    assert r.returncode == 2 and r.stderr.strip() == \
        "scaletrain: error: --prompt is empty: give the text to continue (at least one character)", r.stderr
    # a sample far too long to wait for shows as it grows: the first bytes come while it still runs
    proc = subprocess.Popen([sys.executable, "-m", "scaletrain", "generate", str(ckpt), "--prompt", "The ",
                             "--max-new-tokens", str(10**13)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    got = b""
    try:
        while len(got) < 4 + 40:
            ready, _, _ = select.select([proc.stdout], [], [], 120)
            assert ready, f"nothing streamed within 120 s: {got!r}"
            chunk = os.read(proc.stdout.fileno(), 4096)
            assert chunk, f"the process ended: {got!r} {proc.stderr.read().decode()}"
            got += chunk
        assert proc.poll() is None  # still sampling
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    assert got.startswith(b"The ")


def test_an_empty_sample_prompt_is_refused_before_training(tmp_path):
    from scaletrain.errors import ConfigError

    with pytest.raises(ConfigError, match="train.sample_prompt is empty: the sample after training continues"):
        micro_cfg(tmp_path, **{"train.sample_prompt": "", "train.sample_tokens": 20})
    micro_cfg(tmp_path, **{"train.sample_prompt": "", "train.sample_tokens": 0})  # no sample: nothing to refuse
