"""Properties of attention (model/transformer.py: Attention.attend, the sliding window, the soft
caps) for generated shapes: sequence lengths, grouped-query heads, keys past the queries (a cache),
document masks, soft caps from tight to loose, attention scales, and sliding windows shorter and
longer than the sequence. Against attention written as a loop over queries and keys in numpy
(float64)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from scaletrain.model.config import ModelConfig
from scaletrain.model.kv_cache import KVCache
from scaletrain.model.transformer import Attention, Transformer


@st.composite
def attention_cases(draw):
    """(q (B, H, T, d), k and v (B, Hkv, S, d), mask or None, causal, softcap, scale dim)."""
    B, kv_heads, group = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.integers(1, 3))
    T, d = draw(st.integers(1, 7)), draw(st.sampled_from([1, 2, 4, 8]))
    softcap = draw(st.sampled_from([0.0, 0.3, 1.0, 5.0, 50.0]))
    # what Attention.forward hands attend: causal over T keys; a new token seeing every cached key;
    # an explicit mask (packed documents, or a cache's queries after `past` keys)
    kind = draw(st.sampled_from(["causal", "all", "mask"]))
    past = draw(st.integers(0, 4)) if kind != "causal" or softcap else 0  # the capped path aligns causal right
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
    return q, k, v, mask, kind == "causal", softcap, draw(st.sampled_from([0, 3, 16]))


def attention_by_hand(q, k, v, mask, causal, softcap, scale_dim):
    """Each query of each head: the scores q.k over the keys it sees, scaled, soft-capped, softmaxed,
    the values summed by them. Query head h reads key head h // (H / Hkv); without a mask, causal
    query i sees keys up to S - T + i (the last T keys are the queries' own positions)."""
    q, k, v = (t.double().numpy() for t in (q, k, v))
    B, H, T, d = q.shape
    S, group = k.shape[2], H // k.shape[1]
    scale = 1 / math.sqrt(scale_dim or d)
    out = np.zeros_like(q)
    for b in range(B):
        for h in range(H):
            for i in range(T):
                seen = [j for j in range(S) if (mask[b, 0, i, j] if mask is not None else
                                                 (j <= S - T + i if causal else True))]
                scores = np.array([q[b, h, i] @ k[b, h // group, j] * scale for j in seen])
                if softcap:
                    scores = softcap * np.tanh(scores / softcap)
                weights = np.exp(scores - scores.max())
                weights /= weights.sum()
                out[b, h, i] = sum(w * v[b, h // group, j] for w, j in zip(weights, seen))
    return out


@given(attention_cases())
@example((torch.ones(1, 1, 1, 1) * 30, torch.ones(1, 1, 3, 1) * 30, torch.arange(3.0).view(1, 1, 3, 1), None, False,
          0.3, 0))  # scores of 900 capped to 0.3: the three keys weigh alike
def test_attention_is_the_softmax_of_the_capped_scores_over_the_keys_each_query_sees(case):
    q, k, v, mask, causal, softcap, scale_dim = case
    cfg = ModelConfig(dim=8, n_layers=1, n_heads=1, attn_softcap=softcap, attn_scale_dim=scale_dim)
    attn = Attention(cfg).eval()
    attn.head_dim = q.shape[-1]  # attend reads the head width from here when no scale is set
    got = attn.attend(q, k, v, mask, causal)
    np.testing.assert_allclose(got.double().numpy(), attention_by_hand(q, k, v, mask, causal, softcap, scale_dim),
                               rtol=1e-4, atol=1e-5)


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
def test_a_sliding_window_at_least_the_sequence_attends_to_all_of_it_and_a_shorter_one_is_refused(window, T, seed):
    """scaletrain attends to the whole sequence (model.sliding_window): a sequence up to the window
    gives the logits of the same weights without one; a longer one, or a cache grown past it, is
    refused rather than attended beyond what the model was trained on."""
    tokens = torch.randint(0, 11, (2, T), generator=torch.Generator().manual_seed(seed))
    windowed, plain = tiny(sliding_window=window), tiny()
    with torch.no_grad():
        if T > window:
            with pytest.raises(ValueError, match=f"{T} tokens exceed the model's sliding window of {window}"):
                windowed(tokens)
            return
        torch.testing.assert_close(windowed(tokens), plain(tokens), rtol=0, atol=0)
        cache = KVCache(max_len=17)
        windowed(tokens, cache)
        if T == window:  # one token more than the window
            with pytest.raises(ValueError, match="exceed the model's sliding window"):
                windowed(tokens[:, :1], cache)


@given(st.sampled_from([0.1, 1.0, 3.0, 30.0]), st.integers(1, 16), st.integers(0, 100))
def test_capped_logits_are_c_tanh_of_the_logits_over_c(cap, T, seed):
    tokens = torch.randint(0, 11, (1, T), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        capped, logits = tiny(logit_softcap=cap)(tokens).double().numpy(), tiny()(tokens).double().numpy()
    np.testing.assert_allclose(capped, cap * np.tanh(logits / cap), rtol=1e-5, atol=1e-6)
    assert np.abs(capped).max() <= np.float32(cap)  # (tanh rounds to 1 in fp32 far out)
