"""gpt-oss in one process: attention sinks on every attention path (plain, sliding window, soft-capped,
packed documents, generation's cache) against a softmax written out by hand and against
transformers, with the sinks' gradients; the clamped SwiGLU and YaRN against known answers and
transformers; the family's import, export and generation against GptOssForCausalLM (made here from a
tiny random config: nothing downloaded); the planner's count; LoRA on its projections (PEFT loads the
export); and what it does not compute refused in one line."""

from __future__ import annotations

import json
import math

import pytest
import torch

transformers = pytest.importorskip("transformers")

from scaletrain.config import ModelConfig, load_config  # noqa: E402
from scaletrain.errors import ConfigError  # noqa: E402
from scaletrain.model.hf_config import hf_config_from_model, model_config_from_hf  # noqa: E402
from scaletrain.model.mlp import clamped_swiglu  # noqa: E402
from scaletrain.model.transformer import Attention, Transformer, document_ids, document_mask  # noqa: E402
from scaletrain.model.window import Window  # noqa: E402
from scaletrain.trained.export_hf import save_hf  # noqa: E402
from test_hf import hf_logits, our_logits, ours_from  # noqa: E402

from conftest import run_here  # noqa: E402

TOL = 1e-5
YARN = {"rope_type": "yarn", "rope_theta": 1000.0, "factor": 4.0, "beta_fast": 8.0, "beta_slow": 1.0,
        "truncate": False, "original_max_position_embeddings": 16}
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=64, num_local_experts=4,
            num_experts_per_tok=2, sliding_window=5, swiglu_limit=0.6, rope_parameters=YARN)
SHAPES = {
    # transformers' default layer_types (sliding, full, sliding), YaRN, a clamp that bites, grouped K/V
    "alternating": {},
    # every layer sliding, a tied head, one K/V head, top-1, truncated YaRN bounds
    "all-sliding-tied": dict(layer_types=["sliding_attention"] * 3, tie_word_embeddings=True, num_key_value_heads=1,
                             num_experts_per_tok=1, rope_parameters={**YARN, "truncate": True}),
    # every layer full, no rope scaling, no attention biases, heads of a width apart from hidden / heads
    "full-plain": dict(layer_types=["full_attention"] * 3, rope_parameters={"rope_type": "default",
                                                                             "rope_theta": 1000.0},
                       attention_bias=False, head_dim=24, num_key_value_heads=4),
}


def hf_config(**change):
    """The transformers config make_hf builds its model from."""
    return transformers.GptOssConfig(**{**TINY, **change})


def make_hf(folder, **change):
    """A seeded tiny GptOssForCausalLM, every tensor off its init (sinks, router and expert biases
    large enough to matter, norms away from one), saved to `folder`."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(**change), attn_implementation="eager",
                                                          dtype=torch.float32)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.5 if ("sinks" in n or "router" in n or "bias" in n) else 0.1)
    model.eval().save_pretrained(folder)
    return model


@pytest.fixture
def tokens():
    return torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))


# --------------------------------------------------------------------------------------------
# The sink by hand


def attention_by_hand(q, k, v, sinks, allowed, softcap=0.0):
    """out[b, h, i] = sum_j w_ij v_j, w_ij = exp(s_ij) / (exp(sink_h) + sum_j' exp(s_ij')) over the
    keys `allowed` (B or 1, T, S) lets query i see, written with exp and sums (no softmax call)."""
    rep = q.shape[1] // k.shape[1]
    outs = []
    for h in range(q.shape[1]):
        s = (q[:, h].double() @ k[:, h // rep].double().transpose(-2, -1)) / math.sqrt(q.shape[-1])
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        top = torch.maximum(s.masked_fill(~allowed, -1e30).amax(-1, keepdim=True), sinks[h].double())
        e = torch.exp(s - top) * allowed
        outs.append((e / (e.sum(-1, keepdim=True) + torch.exp(sinks[h].double() - top))) @ v[:, h // rep].double())
    return torch.stack(outs, 1)


def test_a_sink_takes_its_share_of_equal_scores():
    """Known answer: a query of zeros scores 0 on each of its T keys; with values of ones its output
    is T / (T + e^s), and d output / d s = -T e^s / (T + e^s)²."""
    cfg = ModelConfig(dim=8, n_layers=1, n_heads=1, attn_sinks=True)
    attn = Attention(cfg)
    with torch.no_grad():
        attn.sinks.fill_(0.7)
    T = 5
    q, k, v = torch.zeros(1, 1, T, 8), torch.randn(1, 1, T, 8), torch.ones(1, 1, T, 8)
    out = attn.attend(q, k, v, None, True)  # query i sees i + 1 keys
    seen = torch.arange(1, T + 1, dtype=torch.float32)
    assert torch.allclose(out[0, 0, :, 0], seen / (seen + math.exp(0.7)), atol=1e-6)
    out[0, 0, -1, 0].backward()
    assert math.isclose(attn.sinks.grad.item(), -T * math.exp(0.7) / (T + math.exp(0.7)) ** 2, rel_tol=1e-5)


PATHS = {  # (window, softcap, documents): every path Attention's kernel takes in training
    "plain": (None, 0.0, False),
    "sliding": (Window(3), 0.0, False),
    "chunked": (Window(4, chunked=True), 0.0, False),
    "soft-capped-sliding": (Window(3), 1.5, False),
    "documents": (None, 0.0, True),
    "documents-sliding": (Window(3), 0.0, True),
}


@pytest.mark.parametrize("path", PATHS)
def test_every_attention_path_puts_the_sink_in_the_denominator_with_its_gradient(path):
    """Output and the gradients of q, k, v and the sinks, against the softmax by hand (its autograd),
    on 11 positions (windows that divide neither), 4 query heads over 2 K/V heads."""
    window, softcap, documents = PATHS[path]
    cfg = ModelConfig(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, attn_sinks=True, attn_softcap=softcap)
    attn = Attention(cfg, window)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        attn.sinks.copy_(torch.randn(4, generator=g) * 2)
    q, k, v = (torch.randn(2, h, 11, 8, generator=g, requires_grad=True) for h in (4, 2, 2))
    pos = torch.arange(11)
    allowed = (pos[None, :] <= pos[:, None]) if window is None else window.allows(pos, pos)
    mask = None
    if documents:
        tokens = torch.randint(1, 9, (2, 11), generator=g)
        tokens[0, 3], tokens[1, 6] = 0, 0  # separators: two documents in each row
        mask = document_mask(document_ids(tokens, 0))
        allowed = allowed & mask[:, 0]
    w = torch.randn(2, 4, 11, 8, generator=g)
    ours = attn.attend(q, k, v, mask, mask is None)
    (ours * w).sum().backward()
    mine = [t.grad.clone() for t in (q, k, v, attn.sinks)]
    for t in (q, k, v, attn.sinks):
        t.grad = None
    ref = attention_by_hand(q, k, v, attn.sinks, allowed.expand(2, 11, 11), softcap)
    (ref * w).sum().backward()
    assert (ours.double() - ref).abs().max() <= 1e-5
    for name, got, t in zip("q k v sinks".split(), mine, (q, k, v, attn.sinks), strict=True):
        assert (got - t.grad).abs().max() <= 1e-4, name
    assert attn.sinks.grad.abs().min() > 1e-4  # every head's sink is trained


def test_the_clamped_swiglu_is_gpt_oss_gate():
    """Known answers: below the limit (g · σ(αg)) · (u + 1); above it the gate is g = limit and the
    up projection ±limit; the clamp stops the gradient."""
    gate = torch.tensor([0.5, 9.0, -20.0, 2.0], requires_grad=True)
    up = torch.tensor([1.0, 9.0, -8.0, -0.5])
    out = clamped_swiglu(gate, up, alpha=1.702, limit=7.0)

    def by_hand(g, u):
        return g / (1 + math.exp(-1.702 * g)) * (u + 1)

    expected = [by_hand(0.5, 1.0), by_hand(7.0, 7.0), by_hand(-20.0, -7.0), by_hand(2.0, -0.5)]
    assert torch.allclose(out, torch.tensor(expected), rtol=1e-6)
    out.sum().backward()
    assert gate.grad[1] == 0 and gate.grad[0] != 0


# --------------------------------------------------------------------------------------------
# The family against transformers


@pytest.mark.parametrize("shape", SHAPES)
def test_import_export_and_gradients_match_transformers(shape, tmp_path, tokens):
    """Logits within 1e-5 of transformers after import; the loss's gradients (the sinks', the
    experts' biases, the router's) within 1e-5 too; and transformers computes ours after export."""
    hf = make_hf(tmp_path / "hf", **SHAPES[shape])
    ours = ours_from(tmp_path / "hf")
    ref = hf_logits(hf, tokens)
    assert ref.abs().max() > 0.1
    assert (our_logits(ours, tokens) - ref).abs().max() <= TOL
    # gradients of the same loss: transformers' autograd through its eager attention with sinks
    hf.train(), ours.train()
    hf(tokens).logits.logsumexp(-1).sum().backward()
    ours(tokens).logsumexp(-1).sum().backward()
    theirs = dict(hf.named_parameters())
    for i in range(3):
        for mine, their in ((f"layers.{i}.attn.sinks", f"model.layers.{i}.self_attn.sinks"),
                            (f"layers.{i}.moe.router.bias", f"model.layers.{i}.mlp.router.bias"),
                            (f"layers.{i}.moe.b2", f"model.layers.{i}.mlp.experts.down_proj_bias")):
            got, want = dict(ours.named_parameters())[mine].grad, theirs[their].grad
            assert (got - want).abs().max() <= TOL * max(1.0, want.abs().max()), mine
            # (top-1 renormalised: the router's one weight is 1 whatever its logits, so no gradient)
            assert want.abs().max() > 1e-3 or (".router." in mine and hf.config.num_experts_per_tok == 1), mine
    hf.eval(), ours.eval()
    with torch.no_grad():  # as training would move them
        for p in ours.parameters():
            p.add_(0.01 * torch.randn_like(p))
    save_hf(ours, tmp_path / "out")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager").eval()
    assert back.config.model_type == "gpt_oss" and back.config.layer_types == hf.config.layer_types
    assert (hf_logits(back, tokens) - our_logits(ours, tokens)).abs().max() <= TOL
    assert torch.equal(our_logits(ours_from(tmp_path / "out"), tokens), our_logits(ours, tokens))


def test_the_options_land_where_the_family_puts_them(tmp_path):
    make_hf(tmp_path)
    m = ModelConfig(**model_config_from_hf(tmp_path))
    assert (m.attn_sinks, m.bias, m.moe_bias, m.activation, m.swiglu_alpha, m.swiglu_limit) == \
        (True, True, True, "swiglu_clamped", 1.702, 0.6)
    assert (m.sliding_window, m.global_every, [m.is_local_block(i) for i in range(3)]) == (5, 2, [True, False, True])
    assert (m.moe_experts, m.moe_top_k, m.moe_renorm, m.moe_bias_rate, m.expert_hidden) == (4, 2, True, 0.0, 48)
    assert (m.rope_scaling, m.rope_factor, m.rope_beta_fast, m.rope_truncate, m.rope_original_max_seq_len) == \
        ("yarn", 4.0, 8.0, False, 16)
    assert ModelConfig(**model_config_from_hf(hf_config_from_model(m))) == m


def test_yarn_is_transformers_yarn_in_a_llama_too(tmp_path, tokens):
    """YaRN's frequencies and its attention factor (0.1 ln 4 + 1 on q and k) against transformers'
    Llama (the reference library's own rope code, another family)."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      rope_parameters=YARN)
    hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    hf.eval().save_pretrained(tmp_path)
    ours = ours_from(tmp_path)
    assert ours.cfg.rope_scaling == "yarn"
    cos = ours.rope_cos[1]
    assert math.isclose(float(cos.square().add(ours.rope_sin[1].square()).sqrt()[0]), 0.1 * math.log(4) + 1,
                        rel_tol=1e-6)
    assert (our_logits(ours, tokens) - hf_logits(hf, tokens)).abs().max() <= TOL


def test_generation_with_the_cache_matches_the_full_forward_and_transformers(tmp_path):
    """Greedy decoding past the window: the cached path (its sink) gives transformers' tokens, and
    each step's logits are the full forward's."""
    from scaletrain.model.generate import generate
    from scaletrain.model.kv_cache import KVCache

    hf = make_hf(tmp_path / "hf")
    ours = ours_from(tmp_path / "hf", seq_len=32)
    prompt = torch.randint(0, 128, (1, 4), generator=torch.Generator().manual_seed(2))
    theirs = hf.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=0)
    mine = generate(lambda x, cache: ours(x, cache), prompt, 12, window=32, temperature=1.0, top_k=1,
                    cache=KVCache(32))
    assert mine.tolist() == theirs.tolist()
    cache, steps = KVCache(32), []
    with torch.no_grad():
        steps.append(ours(mine[:, :4], cache))
        for t in range(4, mine.shape[1]):
            steps.append(ours(mine[:, t:t + 1], cache))
        assert (torch.cat(steps, 1) - ours(mine)).abs().max() <= TOL


def test_the_planner_counts_gpt_oss(tmp_path):
    """The planner's parameter count is the model's (sinks, expert and router biases included) and
    its FLOPs per token follow the window in the sliding blocks."""
    from scaletrain.layout import Layout
    from scaletrain.model.flops import flops_per_token
    from scaletrain.plan.params import rank_params

    make_hf(tmp_path)
    cfg = ModelConfig(**model_config_from_hf(tmp_path))
    with torch.device("meta"):
        actual = sum(p.numel() for p in Transformer(cfg).parameters())
    assert rank_params(cfg, Layout(), 0).total == actual
    # under tp 2 and ep 2 a rank holds half the sinks and half the experts (with their biases)
    half = rank_params(cfg, Layout(tp=2, ep=2, dp_shard=2), 0)
    assert half.expert * 2 == rank_params(cfg, Layout(), 0).expert
    full = ModelConfig(**{**cfg.__dict__, "sliding_window": 0, "global_every": 0})
    assert flops_per_token(cfg, 64) < flops_per_token(full, 64)
    # the sinks' kernel is plain matmuls: a plan with fused attention is refused in one line
    from scaletrain.plan import plan

    with pytest.raises(ConfigError, match="--attention flash: model.attn_sinks=true adds a sink") as e:
        plan(cfg, hardware="H100-SXM", nodes=1, gpus_per_node=8, seq_len=32, global_batch=8, attention="flash")
    one_line(e)
    planned = plan(cfg, hardware="H100-SXM", nodes=1, gpus_per_node=8, seq_len=32, global_batch=8, attention="eager")
    assert planned["num_params"] == actual


# --------------------------------------------------------------------------------------------
# What is refused


def one_line(excinfo) -> str:
    assert len(excinfo.value.lines) == 1, excinfo.value.lines
    return excinfo.value.lines[0]


@pytest.mark.parametrize("change,words", [
    ({"rope_parameters": {**YARN, "attention_factor": 2.0}}, "has attention_factor, unknown to rope_type yarn"),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1000.0}},
     "has rope_type 'dynamic'; scaletrain implements default, linear, llama3 and yarn"),
    ({"layer_types": ["full_attention", "sliding_attention", "sliding_attention"]},
     "layer_types=[\"full_attention\", \"sliding_attention\", \"sliding_attention\"] has its full-attention layers "
     "where model.global_every"),
])
def test_what_gpt_oss_options_we_do_not_compute_are_refused(tmp_path, change, words):
    make_hf(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ConfigError) as e:
        load_config(None, {"model.from_hf": str(tmp_path), "data.seq_len": 16})
    assert words in one_line(e), one_line(e)


def test_the_new_options_are_checked_and_export_says_why_no_family(tmp_path):
    r = run_here("train", "--print-config", "--model.swiglu_limit=3")
    assert r.returncode == 2 and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert "model.swiglu_alpha and model.swiglu_limit shape activation=swiglu_clamped only" in r.stderr
    r = run_here("train", "--print-config", "--model.rope_beta_fast=16")
    assert r.returncode == 2 and "apply to model.rope_scaling=yarn only" in r.stderr
    with pytest.raises(ConfigError, match="no Hugging Face family: attention sinks, expert biases and the clamped "
                                          "SwiGLU are gpt-oss's, which has experts with biases in every block"):
        hf_config_from_model(ModelConfig(position="rope", norm="rmsnorm", activation="swiglu_clamped",
                                         attn_sinks=True, dim=64, n_heads=4))


@pytest.mark.slow
def test_lora_on_its_projections_exports_to_peft_and_merged(tmp_path):
    """LoRA on gpt-oss's attention projections (biased q/k/v/o beside the sinks), trained from the
    import: PEFT loads the adapter folder onto transformers' model with scaletrain's logits, and the
    merged export is a GptOssForCausalLM with them too."""
    pytest.importorskip("peft")
    import peft

    from scaletrain.train.trainer import Trainer
    from scaletrain.trained.adapters import adapted_from_checkpoint

    from conftest import micro_cfg

    make_hf(tmp_path / "hf", vocab_size=256)
    hf = str(tmp_path / "hf")
    run = {"model.from_hf": hf, "model.init_from": hf, "data.seq_len": 16, "model.max_seq_len": 64,
           "model.n_layers": 3, "train.steps": 3, "optim.lr": 0.01, "checkpoint.save_final": True,
           "adapter.kind": "lora", "adapter.targets": "attention"}
    saved = Trainer(micro_cfg(tmp_path / "run", **run)).fit()["checkpoint"]
    ours, _ = adapted_from_checkpoint(saved)
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = ours.eval()(tokens)

    def logits(folder, adapters=None):
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager")
        if adapters is not None:
            model = peft.PeftModel.from_pretrained(model, str(adapters))
        with torch.no_grad():
            return model.eval()(tokens).logits

    assert (want - logits(hf)).abs().max() > 0.05  # the adapters changed the model
    for fmt in ("peft", "hf"):
        r = run_here("export", saved, "--format", fmt, "--out", str(tmp_path / f"out-{fmt}"))
        assert r.returncode == 0, r.stderr
    config = json.loads((tmp_path / "out-peft" / "adapter_config.json").read_text())
    assert set(config["target_modules"]) == {"q_proj", "k_proj", "v_proj", "o_proj"}
    assert (logits(hf, tmp_path / "out-peft") - want).abs().max() <= TOL
    assert (logits(str(tmp_path / "out-hf")) - want).abs().max() <= TOL
