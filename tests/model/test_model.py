from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from scaletrain.config import from_dict
from scaletrain.model import Transformer, count_params, flops_per_token, preset_config
from scaletrain.model.names import canonical_name
from scaletrain.parallel.init import init_weights


def model_cfg(**kw):
    base = dict(dim=64, n_layers=2, n_heads=4, max_seq_len=32, vocab_size=256)
    return from_dict({"model": {**base, **kw}, "data": {"seq_len": 32}}).model


# Published parameter counts: GPT-2 small with nanoGPT's padded vocabulary (124,475,904),
# Llama 3.2 1B (1,235,814,400) and Llama 3 8B (8,030,261,248).
@pytest.mark.parametrize("preset,expected", [
    ("gpt2-124m", 124_475_904), ("llama-1b", 1_235_814_400), ("llama-8b", 8_030_261_248)])
def test_preset_parameter_counts(preset, expected):
    assert count_params(preset_config(preset)) == expected


@pytest.mark.parametrize("variant", [
    dict(),  # GPT-2 family
    dict(norm="rmsnorm", activation="swiglu", position="rope", tie_embeddings=False),  # Llama family
    dict(norm="rmsnorm", activation="swiglu", position="rope", n_kv_heads=2),  # grouped-query attention
    dict(n_kv_heads=1, bias=True),  # multi-query attention with biases
])
def test_variants_forward_backward(variant):
    cfg = model_cfg(**variant)
    model = Transformer(cfg)
    init_weights(model, seed=0)
    tokens = torch.randint(0, 256, (2, 16))
    logits = model(tokens)
    assert logits.shape == (2, 16, 256)
    logits.sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_attention_is_causal():
    model = Transformer(model_cfg(position="rope"))
    init_weights(model, seed=0)
    a = torch.randint(0, 256, (1, 16))
    b = a.clone()
    b[0, 10:] = (b[0, 10:] + 1) % 256  # change only the future of position 9
    torch.testing.assert_close(model(a)[0, :10], model(b)[0, :10])


def test_tied_embeddings_share_storage():
    model = Transformer(model_cfg(tie_embeddings=True))
    assert model.output.weight is model.tok_emb.weight
    assert "output.weight" not in dict(model.named_parameters())
    untied = Transformer(model_cfg(tie_embeddings=False))
    assert untied.output.weight is not untied.tok_emb.weight


def test_init_depends_only_on_seed_and_name():
    small = Transformer(model_cfg(n_layers=2))
    big = Transformer(model_cfg(n_layers=4))
    init_weights(small, seed=7)
    init_weights(big, seed=7)
    # same name, same value, although the models differ (and layer order of creation differs)
    for name, p in small.named_parameters():
        if name.startswith("layers.") and "wo" not in name and "w2" not in name:
            torch.testing.assert_close(p, dict(big.named_parameters())[name], rtol=0, atol=0)
    again = Transformer(model_cfg(n_layers=2))
    init_weights(again, seed=7)
    for (n, p), (_, q) in zip(small.named_parameters(), again.named_parameters()):
        assert torch.equal(p, q), n
    other = Transformer(model_cfg(n_layers=2))
    init_weights(other, seed=8)
    assert not torch.equal(small.layers["0"].attn.wq.weight, other.layers["0"].attn.wq.weight)


def test_init_on_meta_then_materialize_matches_eager():
    cfg = model_cfg(position="rope")
    eager = Transformer(cfg)
    init_weights(eager, seed=3)
    with torch.device("meta"):
        lazy = Transformer(cfg)
    lazy.to_empty(device="cpu")
    lazy.init_buffers("cpu")
    init_weights(lazy, seed=3)
    tokens = torch.randint(0, 256, (2, 16))
    torch.testing.assert_close(eager(tokens), lazy(tokens), rtol=0, atol=0)


def test_init_statistics():
    cfg = model_cfg(dim=256, n_layers=4)
    model = Transformer(cfg)
    init_weights(model, seed=0)
    assert torch.equal(model.layers["0"].attn_norm.weight, torch.ones(256))
    std = model.layers["0"].attn.wq.weight.std().item()
    assert abs(std - 0.02) < 0.002
    proj = model.layers["0"].attn.wo.weight.std().item()
    assert abs(proj - 0.02 / (2 * 4) ** 0.5) < 0.001


def test_canonical_names_strip_wrappers():
    assert canonical_name("layers.0._checkpoint_wrapped_module.attn.wq.weight") == "layers.0.attn.wq.weight"
    assert canonical_name("_orig_mod.layers.1.mlp.w1.weight") == "layers.1.mlp.w1.weight"


@pytest.mark.parametrize("variant", [dict(), dict(activation="swiglu", n_kv_heads=2, tie_embeddings=False)])
def test_flops_formula_matches_counted_flops(variant):
    cfg = model_cfg(**variant)
    model = Transformer(cfg)
    B, T = 2, 32
    tokens = torch.randint(0, 256, (B, T))
    # the math backend spells attention as matmuls, which the counter sees (it has no
    # formula for the fused CPU attention kernel)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(tokens).sum().backward()
    counted = counter.get_total_flops()
    predicted = flops_per_token(cfg, T) * B * T
    assert abs(counted - predicted) / predicted < 0.01, (counted, predicted)


def _only_dropout_at(model: Transformer, site: str, p: float) -> None:
    """Leave dropout at `site` alone (embedding, residual or attention) at rate p, every other off."""
    model.drop.p = p if site == "embedding" else 0.0
    for block in model.layers.values():
        block.drop.p = p if site == "residual" else 0.0
        block.attn.dropout = p if site == "attention" else 0.0


@pytest.mark.parametrize("site,extra", [("embedding", {}), ("residual", {}), ("attention", {}),
                                        ("attention", {"attn_softcap": 5.0}),
                                        ("residual", {"parallel_residual": True})],
                         ids=["embedding", "residual", "attention", "attention-softcapped", "parallel-residual"])
def test_each_dropout_draws_anew_in_training_and_is_off_in_eval(site, extra):
    """Every stochastic module of the model, alone: in training two forwards differ (and differ from the
    same weights without dropout); in eval two forwards are the model without dropout, bit for bit."""
    torch.manual_seed(0)
    model = Transformer(model_cfg(dropout=0.2, **extra))
    plain = Transformer(model_cfg(**extra))
    plain.load_state_dict(model.state_dict())
    _only_dropout_at(model, site, 0.2)
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model.train(), plain.train()
        first, second, reference = model(tokens), model(tokens), plain(tokens)
        assert not torch.equal(first, second)
        assert not torch.equal(first, reference) and not torch.equal(second, reference)
        model.eval(), plain.eval()
        first, second, reference = model(tokens), model(tokens), plain(tokens)
        assert torch.equal(first, second) and torch.equal(first, reference)
