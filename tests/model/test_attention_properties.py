"""Properties of attention (model/transformer.py: Attention.attend, model/window.py: the sliding
and chunked windows, the soft caps) for generated shapes: sequence lengths, grouped-query heads,
keys past the queries (a cache), document masks, soft caps from tight to loose, attention scales,
and windows shorter and longer than the sequence. Against attention written as a loop over
queries and keys in numpy (float64), and a window's mask written as a loop."""

from __future__ import annotations

import math

import numpy as np
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from scaletrain.model.config import ModelConfig
from scaletrain.model.kv_cache import KVCache
from scaletrain.model.transformer import Attention, Transformer
from scaletrain.model.window import Window


@st.composite
def attention_cases(draw):
    """(q (B, H, T, d), k and v (B, Hkv, S, d), mask or None, causal, softcap, scale dim, window or None)."""
    B, kv_heads, group = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.integers(1, 3))
    T, d = draw(st.integers(1, 13)), draw(st.sampled_from([1, 2, 4, 8]))
    # a window (sliding or chunked) narrows what training's attention sees: queries and keys alike
    window = draw(st.none() | st.builds(Window, st.integers(1, 9), st.booleans()))
    softcap = draw(st.sampled_from([0.0, 0.3, 1.0, 5.0, 50.0]))
    # what Attention.forward hands attend: causal over T keys; a new token seeing every cached key;
    # an explicit mask (packed documents, or a cache's queries after `past` keys)
    kind = draw(st.sampled_from(["causal", "mask"] if window else ["causal", "all", "mask"]))
    # (keys past the queries: a cache, never with a window; the capped path aligns causal right)
    past = draw(st.integers(0, 4)) if (kind != "causal" or softcap) and not window else 0
    S = T + past
    mask = None
    if kind == "mask":
        mask = torch.tensor([[[[draw(st.booleans()) or j == i + past for j in range(S)] for i in range(T)]]
                             for _ in range(B)])  # every query sees a key: its own
    elif kind == "all":
        T = 1 if not softcap else T  # (only a single new token attends without a mask or causality)
        S = T + past
    g = torch.Generator().manual_seed(draw(st.integers(0, 1000)))
    q = torch.randn(B, kv_heads * group, T, d, generator=g) * 2  # wide scores: the caps bite
    k, v = torch.randn(B, kv_heads, S, d, generator=g) * 2, torch.randn(B, kv_heads, S, d, generator=g)
    return q, k, v, mask, kind == "causal", softcap, draw(st.sampled_from([0, 3, 16])), window


def near_by_hand(window, i: int, j: int) -> bool:
    """Whether the query at position i sees the key at j: at or before it, and within the window
    (sliding: the size positions ending at i; chunked: i's own run of size positions from 0)."""
    if j > i:
        return False
    if window is None:
        return True
    if window.chunked:
        start = i - i % window.size
        return start <= j
    return i - j <= window.size - 1


def attention_by_hand(q, k, v, mask, causal, softcap, scale_dim, window=None):
    """Each query of each head: the scores q.k over the keys it sees, scaled, soft-capped, softmaxed,
    the values summed by them. Query head h reads key head h // (H / Hkv); without a mask, causal
    query i sees keys up to S - T + i (the last T keys are the queries' own positions); a window
    narrows either."""
    q, k, v = (t.double().numpy() for t in (q, k, v))
    B, H, T, d = q.shape
    S, group = k.shape[2], H // k.shape[1]
    scale = 1 / math.sqrt(scale_dim or d)
    out = np.zeros_like(q)
    for b in range(B):
        for h in range(H):
            for i in range(T):
                seen = [j for j in range(S) if (mask[b, 0, i, j] if mask is not None else
                                                 (j <= S - T + i if causal else True))
                        and (window is None or near_by_hand(window, S - T + i, j))]
                scores = np.array([q[b, h, i] @ k[b, h // group, j] * scale for j in seen])
                if softcap:
                    scores = softcap * np.tanh(scores / softcap)
                weights = np.exp(scores - scores.max())
                weights /= weights.sum()
                out[b, h, i] = sum(w * v[b, h // group, j] for w, j in zip(weights, seen))
    return out


@given(attention_cases())
@example((torch.ones(1, 1, 1, 1) * 30, torch.ones(1, 1, 3, 1) * 30, torch.arange(3.0).view(1, 1, 3, 1), None, False,
          0.3, 0, None))  # scores of 900 capped to 0.3: the three keys weigh alike
@example((torch.randn(1, 2, 7, 4, generator=torch.Generator().manual_seed(3)),
          torch.randn(1, 1, 7, 4, generator=torch.Generator().manual_seed(4)),
          torch.randn(1, 1, 7, 4, generator=torch.Generator().manual_seed(5)),
          torch.ones(1, 1, 7, 7, dtype=torch.bool).tril(), False, 0.0, 0, Window(3)))  # a document mask, 3 tiles
def test_attention_is_the_softmax_of_the_capped_scores_over_the_keys_each_query_sees(case):
    q, k, v, mask, causal, softcap, scale_dim, window = case
    cfg = ModelConfig(dim=8, n_layers=1, n_heads=1, attn_softcap=softcap, attn_scale_dim=scale_dim)
    attn = Attention(cfg, window).eval()
    attn.head_dim = q.shape[-1]  # attend reads the head width from here when no scale is set
    got = attn.attend(q, k, v, mask, causal)
    np.testing.assert_allclose(got.double().numpy(),
                               attention_by_hand(q, k, v, mask, causal, softcap, scale_dim, window),
                               rtol=1e-4, atol=1e-5)


@given(st.integers(1, 9), st.booleans(), st.integers(1, 20), st.integers(0, 20))
def test_a_windows_mask_is_the_one_written_by_hand(size, chunked, T, first):
    """Window.allows against the loop, for queries and keys at any positions (a cache's keys start
    later), and first_key is the earliest key any later query sees."""
    window = Window(size, chunked)
    q_pos, k_pos = torch.arange(first, first + T), torch.arange(0, first + T)
    got = window.allows(q_pos, k_pos).tolist()
    assert got == [[near_by_hand(window, i, j) for j in k_pos.tolist()] for i in q_pos.tolist()]
    reach = [j for i in range(first, first + 3 * size) for j in range(i + 1) if near_by_hand(window, i, j)]
    assert window.first_key(first) == min(reach)


def tiny(**kw) -> Transformer:
    cfg = ModelConfig(vocab_size=11, dim=16, n_layers=2, n_heads=2, max_seq_len=16, position="rope", **kw)
    torch.manual_seed(0)
    model = Transformer(cfg).eval()
    model.init_buffers("cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.5)
    return model


@given(st.integers(1, 16), st.integers(1, 16), st.integers(0, 100))
@example(7, 7, 0)  # a window exactly the sequence
def test_a_window_at_least_the_sequence_changes_nothing(window, T, seed):
    """A sequence no longer than the window gives the logits of the same weights without one,
    bit for bit (the plain causal kernel runs)."""
    tokens = torch.randint(0, 11, (2, T), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        for kind in ("sliding_window", "attn_chunk"):
            windowed, plain = tiny(**{kind: max(window, T)}), tiny()
            torch.testing.assert_close(windowed(tokens), plain(tokens), rtol=0, atol=0)


@given(st.integers(1, 6), st.booleans(), st.sampled_from([0, 2]), st.integers(1, 5), st.integers(0, 100))
@example(4, False, 0, 1, 0)
def test_generation_with_the_cache_gives_the_whole_sequences_logits_and_keeps_only_the_window(
        size, chunked, global_every, step, seed):
    """Past the window: the logits of a prompt, then of `step` positions at a time through the KV
    cache, equal those of the whole sequence at once; a windowed block keeps at most size - 1
    positions (chunked: those of the current chunk), a global one all."""
    model = tiny(**{"attn_chunk" if chunked else "sliding_window": size, "global_every": global_every})
    tokens = torch.randint(0, 11, (1, 16), generator=torch.Generator().manual_seed(seed))
    cache = KVCache(max_len=16)
    with torch.no_grad():
        whole = model(tokens)
        parts = [model(tokens[:, :5], cache)]
        for at in range(5, 16, step):
            parts.append(model(tokens[:, at:at + step], cache))
            for name in model.layers:
                local = model.layers[name].attn.window is not None
                held = cache.positions_held(name)
                if local:
                    assert held <= (cache.length % size if chunked else size - 1), (name, held)
                else:
                    assert held == 16
    torch.testing.assert_close(torch.cat(parts, dim=1), whole, rtol=1e-5, atol=1e-5)


@given(st.sampled_from([0.1, 1.0, 3.0, 30.0]), st.integers(1, 16), st.integers(0, 100))
def test_capped_logits_are_c_tanh_of_the_logits_over_c(cap, T, seed):
    tokens = torch.randint(0, 11, (1, T), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        capped, logits = tiny(logit_softcap=cap)(tokens).double().numpy(), tiny()(tokens).double().numpy()
    np.testing.assert_allclose(capped, cap * np.tanh(logits / cap), rtol=1e-5, atol=1e-6)
    assert np.abs(capped).max() <= np.float32(cap)  # (tanh rounds to 1 in fp32 far out)
