"""Hugging Face families beyond GPT-2 and the Llama-likes: OLMo 2 (norms after the sub-blocks,
q/k norms over the whole projections). For each, a tiny model made by transformers (from_config;
nothing downloaded): the import computes its logits, the export gives its state dict back
exactly, greedy generation with our KV cache picks its tokens, and the planner counts the model
scaletrain builds. The multi-rank cases of every family run in one 2-rank launch."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from scaletrain.config import ModelConfig, load_config  # noqa: E402
from scaletrain.model.hf import hf_state_dict, load_hf_weights  # noqa: E402
from scaletrain.model.hf_config import model_config_from_hf  # noqa: E402
from scaletrain.model.transformer import Transformer, count_params  # noqa: E402
from scaletrain.trained.export_hf import save_hf  # noqa: E402

TOL = 1e-5
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=64, rms_norm_eps=1e-6)
PHI_IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)  # (its defaults lie outside a tiny vocabulary)
FAMILIES = {
    "olmo2": ("Olmo2Config", dict(TINY, num_key_value_heads=2)),
    # Pythia: parallel residual, a quarter of each head rotated (its default), exact GELU
    "neox-parallel": ("GPTNeoXConfig", dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                           num_attention_heads=4, max_position_embeddings=64)),
    "neox-sequential": ("GPTNeoXConfig", dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                             num_attention_heads=4, max_position_embeddings=64, rotary_pct=0.5,
                                             use_parallel_residual=False, hidden_act="gelu_new",
                                             tie_word_embeddings=True)),
    "phi3": ("Phi3Config", dict(TINY, **PHI_IDS, num_key_value_heads=2, sliding_window=48)),
    # Phi-4-mini: three quarters of each head rotated, a tied head
    "phi4-partial": ("Phi3Config", dict(TINY, **PHI_IDS, tie_word_embeddings=True,
                                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                         "partial_rotary_factor": 0.75})),
    # Gemma 2: caps low enough to bite on a tiny random model, a query scale apart from head_dim
    "gemma2": ("Gemma2Config", dict(TINY, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24,
                                    sliding_window=48, attn_logit_softcapping=1.0, final_logit_softcapping=2.0)),
    # Gemma 3: q/k norms, head_dim apart, global blocks every 2nd with their own (linearly scaled) rotary base
    "gemma3": ("Gemma3TextConfig", dict(TINY, num_hidden_layers=4, num_key_value_heads=2, head_dim=24,
                                        sliding_window=48, sliding_window_pattern=2,
                                        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0,
                                                                            "rope_theta": 1000000.0},
                                                         "sliding_attention": {"rope_type": "default",
                                                                               "rope_theta": 10000.0}})),
}


def make_hf(name: str, folder, **change):
    """A seeded tiny transformers model, its norms and biases moved off their init (a wrong
    mapping of them must show), saved to `folder`."""
    cls, kw = FAMILIES[name]
    torch.manual_seed(0)
    config = getattr(transformers, cls)(**{**kw, **change})
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("bias") or "norm" in n:
                p.add_(0.2 * torch.randn_like(p))
    model.eval().save_pretrained(folder)
    return model


def ours_from(folder, seq_len: int = 16) -> Transformer:
    cfg = load_config(None, {"model.from_hf": str(folder), "data.seq_len": seq_len}).model
    model = Transformer(cfg)
    weights = load_hf_weights(folder, cfg)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(weights[n])
    return model.eval()


@pytest.fixture
def tokens():
    return torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("name", FAMILIES)
def test_import_export_and_generation_match_transformers(name, tmp_path, tokens):
    """Logits within 1e-5 (fp32), the exported state dict equal to transformers' own, and after
    our weights change, transformers computes our logits from the export; greedy generation with
    our KV cache picks transformers' tokens."""
    from scaletrain.model.generate import generate
    from scaletrain.model.kv_cache import KVCache

    hf = make_hf(name, tmp_path / "hf")
    ours = ours_from(tmp_path / "hf", seq_len=32)
    with torch.no_grad():
        ref, mine = hf(tokens).logits, ours(tokens)
    assert ref.abs().max() > 0.1  # not a comparison of near-zeros
    assert (mine - ref).abs().max() <= TOL

    theirs = {k: v for k, v in hf.state_dict().items() if not (hf.config.tie_word_embeddings and k == "lm_head.weight")}
    back = hf_state_dict(dict(ours.named_parameters()), ours.cfg)
    assert back.keys() == theirs.keys()
    assert [k for k in theirs if not torch.equal(back[k], theirs[k])] == []

    prompt = torch.randint(0, 128, (1, 5), generator=torch.Generator().manual_seed(2))
    greedy = hf.generate(prompt, max_new_tokens=10, do_sample=False, pad_token_id=0)
    mine = generate(lambda x, cache: ours(x, cache), prompt, 10, window=32, temperature=1.0, top_k=1,
                    cache=KVCache(32))
    assert mine.tolist() == greedy.tolist()

    with torch.no_grad():  # as training would
        for p in ours.parameters():
            p.add_(0.01 * torch.randn_like(p))
    save_hf(ours, tmp_path / "out")
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager").eval()
    assert again.config.model_type == hf.config.model_type
    with torch.no_grad():
        assert (again(tokens).logits - ours(tokens)).abs().max() <= TOL


@pytest.mark.parametrize("name", FAMILIES)
def test_the_planner_counts_the_imported_shape(name, tmp_path):
    """Parameters as the model holds them, and FLOPs from the same matmul count."""
    from scaletrain.layout import Layout
    from scaletrain.model.flops import matmul_params
    from scaletrain.plan.params import rank_params

    make_hf(name, tmp_path)
    cfg = ModelConfig(**model_config_from_hf(tmp_path))
    assert rank_params(cfg, Layout(), 0).total == count_params(cfg)
    model = Transformer(cfg)
    linear = sum(m.weight.numel() for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "output")
    assert matmul_params(cfg) == linear + cfg.dim * cfg.vocab_size
