"""Qwen3-Next in and out: tiny Qwen3NextForCausalLM models made by transformers (from_config,
save_pretrained; nothing downloaded) compute the same logits in scaletrain after import, and
transformers computes ours after export, in fp32 within 1e-5, on shapes beyond the defaults (value
heads apart from key heads, tied and untied heads, dense and MoE mixes by decoder_sparse_step and
mlp_only_layers, sequences that do not divide the delta rule's chunk). The delta rule against a
hand computation and against transformers' own recurrent fallback, in both our forms; generation
through the cache (the full blocks' keys, the linear blocks' convolution inputs and state) against
the full forward and transformers' tokens; what we do not compute refused in one line."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

transformers = pytest.importorskip("transformers")

from scaletrain.config import ModelConfig, load_config  # noqa: E402
from scaletrain.errors import ConfigError  # noqa: E402
from scaletrain.model.deltanet import chunked_delta_rule, recurrent_delta_rule  # noqa: E402
from scaletrain.model.generate import generate  # noqa: E402
from scaletrain.model.hf import load_hf_weights  # noqa: E402
from scaletrain.model.hf_config import hf_family, model_config_from_hf  # noqa: E402
from scaletrain.model.kv_cache import KVCache  # noqa: E402
from scaletrain.model.transformer import Transformer  # noqa: E402
from scaletrain.trained.export_hf import save_hf  # noqa: E402

from conftest import model_from_hf  # noqa: E402

TOL = 1e-5
CHUNK = 5  # the delta rule's chunk in these tests: sequences of 17 tokens are three chunks and a part
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=64, num_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=32, shared_expert_intermediate_size=40, linear_num_key_heads=2,
            linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12, full_attention_interval=2)
SHAPES = {
    # experts in every block, two value heads per key head, grouped K/V 4:2, untied, full every 2nd block
    "moe-grouped-values": TINY,
    # a tied head, one K/V head, value heads = key heads of another width, a dense first block
    # (mlp_only_layers), full attention every 3rd block, a whole-head rotary
    "tied-dense-first": dict(TINY, num_hidden_layers=3, tie_word_embeddings=True, num_key_value_heads=1,
                             linear_num_value_heads=2, linear_value_head_dim=8, mlp_only_layers=[0],
                             full_attention_interval=3, partial_rotary_factor=1.0, linear_conv_kernel_dim=3),
    # experts every other block (decoder_sparse_step), a head_dim apart from hidden / heads
    "sparse-step": dict(TINY, decoder_sparse_step=2, head_dim=24),
    # no experts at all
    "dense": dict(TINY, num_experts=0, num_hidden_layers=3),
}


def hf_config(name: str, **change):
    """The transformers config make_hf builds its model from."""
    return transformers.Qwen3NextConfig(**{**SHAPES[name], **change})


def make_hf(name: str, folder, **change):
    """A seeded tiny transformers model, its norms off their init, its router decisive and its
    experts large enough that a wrong expert shows, saved to `folder`."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(name, **change), attn_implementation="eager",
                                                          dtype=torch.float32)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n or n.endswith("dt_bias"):
                p.add_(0.2 * torch.randn_like(p))
            elif n.endswith("gate.weight"):
                p.normal_(0.0, 0.5)
            elif ".experts." in n:
                p.normal_(0.0, 0.1)
    model.eval().save_pretrained(folder)
    return model


def ours_from(folder, seq_len: int = 32) -> Transformer:
    return model_from_hf(folder, seq_len, **{"model.linear_chunk": CHUNK})


def logits(model, tokens, hf: bool = False):
    with torch.no_grad():
        return model(tokens).logits if hf else model(tokens)


@pytest.fixture
def tokens():
    return torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(1))


def test_the_delta_rule_decays_before_it_writes_by_hand():
    """One head of width 1, q = k = 1, beta = 1/2, decays 1/2 then 1/4, values 1 then 2:
    S1 = 0.5·0 + 0.5·(1 - 0) = 0.5; S2 = 0.25·0.5 + 0.5·(2 - 0.125) = 1.0625; o_t = S_t.
    (Decaying after the write would give 0.5 then 1.125.)"""
    one = torch.ones(1, 2, 1, 1)
    v = torch.tensor([1.0, 2.0]).view(1, 2, 1, 1)
    g = torch.tensor([0.5, 0.25]).log().view(1, 2, 1)
    beta = torch.full((1, 2, 1), 0.5)
    forms = [recurrent_delta_rule(one, one, v, g, beta, None)]
    forms += [chunked_delta_rule(one, one, v, g, beta, None, chunk) for chunk in (1, 2)]
    for out, state in forms:
        assert out.flatten().tolist() == pytest.approx([0.5, 1.0625])
        assert state.item() == pytest.approx(1.0625)


@pytest.mark.parametrize("T,chunk", [(13, 4), (12, 4), (1, 4), (7, 64)])
def test_the_chunked_and_recurrent_forms_agree_with_transformers(T, chunk):
    """Our chunked form (lengths that do and do not divide the chunk, from a state carried in) and our
    recurrent form equal transformers' torch_recurrent_gated_delta_rule, with two value heads per key head."""
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_recurrent_gated_delta_rule

    g = torch.Generator().manual_seed(T)
    B, Hk, Hv, dk, dv = 2, 2, 4, 6, 5
    q, k = torch.randn(B, T, Hk, dk, generator=g), torch.randn(B, T, Hk, dk, generator=g)
    v = torch.randn(B, T, Hv, dv, generator=g)
    decay = -torch.rand(B, T, Hv, generator=g) * 2
    beta = torch.rand(B, T, Hv, generator=g)
    state = torch.randn(B, Hv, dk, dv, generator=g)
    ref, ref_state = torch_recurrent_gated_delta_rule(q, k, v, g=decay, beta=beta, initial_state=state,
                                                      output_final_state=True, use_qk_l2norm_in_kernel=True)
    qn, kn = (torch.nn.functional.normalize(t, dim=-1, eps=0).repeat_interleave(2, dim=2) for t in (q, k))
    qn = qn * dk ** -0.5
    for out, s in (chunked_delta_rule(qn, kn, v, decay, beta, state, chunk),
                   recurrent_delta_rule(qn, kn, v, decay, beta, state)):
        assert (out - ref).abs().max() <= 1e-5 and (s - ref_state).abs().max() <= 1e-5


@given(T=st.integers(1, 23), chunk=st.integers(1, 9), heads=st.sampled_from([(1, 1), (1, 3), (2, 4)]),
       carried=st.booleans(), seed=st.integers(0, 2**16))
@example(T=1, chunk=1, heads=(1, 1), carried=False, seed=0)
def test_any_length_and_chunk_give_the_recurrence(T, chunk, heads, carried, seed):
    """Drawn lengths and chunks (the last chunk a part, chunks longer than the sequence, one-position
    chunks), grouped value heads, a state carried in or not: the chunked form's outputs and final state
    are the recurrent form's."""
    g = torch.Generator().manual_seed(seed)
    hk, hv = heads
    B, dk, dv = 2, 3, 4
    q, k = (torch.nn.functional.normalize(torch.randn(B, T, hk, dk, generator=g), dim=-1).repeat_interleave(
        hv // hk, dim=2) for _ in range(2))
    v = torch.randn(B, T, hv, dv, generator=g)
    decay, beta = -torch.rand(B, T, hv, generator=g) * 3, torch.rand(B, T, hv, generator=g)
    state = torch.randn(B, hv, dk, dv, generator=g) if carried else None
    out, s = chunked_delta_rule(q, k, v, decay, beta, state, chunk)
    ref, ref_s = recurrent_delta_rule(q, k, v, decay, beta, state)
    assert (out - ref).abs().max() <= 1e-5 and (s - ref_s).abs().max() <= 1e-5


@pytest.mark.parametrize("name", SHAPES)
def test_import_then_export_matches_transformers(name, tmp_path, tokens):
    hf = make_hf(name, tmp_path / "hf")
    ours = ours_from(tmp_path / "hf")
    ref = logits(hf, tokens, hf=True)
    assert ref.abs().max() > 0.1  # the comparison below is not of near-zeros
    assert (logits(ours, tokens) - ref).abs().max() <= TOL

    # change our weights (as training would), export, and let transformers load the folder on its own
    with torch.no_grad():
        for p in ours.parameters():
            p.add_(0.01 * torch.randn_like(p))
    save_hf(ours, tmp_path / "out")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager").eval()
    assert back.config.model_type == "qwen3_next" and back.config.layer_types == hf.config.layer_types
    dense = [int(i) for i, b in ours.layers.items() if hasattr(b, "mlp")]
    assert back.config.num_experts == 0 or back.config.mlp_only_layers == dense
    assert (logits(back, tokens, hf=True) - logits(ours, tokens)).abs().max() <= TOL
    # and our own import reads the export back to the same model
    assert torch.equal(logits(ours_from(tmp_path / "out"), tokens), logits(ours, tokens))


def test_the_options_land_where_qwen3_next_puts_them(tmp_path):
    make_hf("moe-grouped-values", tmp_path / "a")
    make_hf("tied-dense-first", tmp_path / "b")
    a, b = (ModelConfig(**model_config_from_hf(tmp_path / n)) for n in ("a", "b"))
    assert (a.linear_heads, a.linear_v_heads, a.linear_head_dim, a.linear_v_dim, a.linear_conv) == (2, 4, 8, 12, 4)
    assert [a.is_linear_block(i) for i in range(4)] == [True, False, True, False]
    assert (a.norm_unit_offset, a.attn_gate, a.rotary_fraction, a.rotary_dim, a.qk_norm) == (True, True, 0.25, 4, True)
    assert (a.moe_shared_experts, a.shared_hidden, a.moe_shared_gate, a.moe_renorm, a.moe_bias_rate) == (
        1, 40, True, True, 0.0)
    assert [b.is_linear_block(i) for i in range(3)] == [True, True, False]
    assert [b.is_moe_block(i) for i in range(3)] == [False, True, True]
    assert (b.linear_v_heads, b.linear_v_dim, b.linear_conv, b.rotary_fraction, b.tie_embeddings) == (2, 8, 3, 1.0,
                                                                                                       True)
    assert hf_family(a) == hf_family(b) == "qwen3_next"


def test_the_parts_matter(tmp_path, tokens):
    """Each new part moves the logits: the output gate, the shared expert's gate, the (1 + w) norms,
    the convolution, the decay."""
    make_hf("moe-grouped-values", tmp_path)
    ours = ours_from(tmp_path)
    ref = logits(ours, tokens)
    with torch.no_grad():
        for part in ("layers.1.attn.wq.weight", "layers.0.moe.shared_gate.weight", "norm.weight",
                     "layers.0.attn.conv", "layers.2.attn.A_log", "layers.0.attn.z_norm.weight"):
            p = dict(ours.named_parameters())[part]
            saved = p.clone()
            p.mul_(1.5).add_(0.3)
            assert (logits(ours, tokens) - ref).abs().max() > 1e-3, part
            p.copy_(saved)


def test_generation_through_the_cache_equals_the_full_forward_and_picks_transformers_tokens(tmp_path):
    """Greedy generation from a prompt longer than a chunk, through our cache: each step's token is
    the one transformers' model picks on the whole sequence; each cached step's logits are our full
    forward's; a linear block keeps a state of fixed size whatever the length."""
    hf = make_hf("moe-grouped-values", tmp_path)
    ours = ours_from(tmp_path)
    prompt = torch.randint(0, 128, (1, CHUNK + 3), generator=torch.Generator().manual_seed(2))
    expected = prompt
    with torch.no_grad():
        for _ in range(2 * CHUNK):
            expected = torch.cat([expected, hf(expected).logits[:, -1:].argmax(-1)], dim=1)
    mine = generate(lambda x, c: ours(x, c), prompt, 2 * CHUNK, window=64, temperature=1.0, top_k=1,
                    cache=KVCache(64))
    assert mine.tolist() == expected.tolist()
    cache = KVCache(64)
    with torch.no_grad():
        ours(expected[:, :CHUNK + 3], cache)
        for t in range(CHUNK + 3, expected.shape[1]):
            step = ours(expected[:, t:t + 1], cache)
            assert (step[0, -1] - ours(expected[:, :t + 1])[0, -1]).abs().max() <= TOL
        conv, state = cache.linear_state("0")
        assert conv.shape == (1, 2 * (2 * 8 + 2 * 12), 3) and state.shape == (1, 4, 8, 12)
    with pytest.raises(ValueError, match="cannot rewind"):
        cache.rewind(1)


def one_line(excinfo) -> str:
    assert len(excinfo.value.lines) == 1, excinfo.value.lines
    return excinfo.value.lines[0]


@pytest.mark.parametrize("change,field,why", [
    ({"layer_types": ["linear_attention", "full_attention", "full_attention", "linear_attention"]}, "layer_types",
     "cannot"),
    ({"linear_num_value_heads": 3}, "linear_num_value_heads", "multiple of linear_num_key_heads"),
    ({"attention_bias": True}, "attention_bias", "bias on the output projection"),
    ({"rope_parameters": {"rope_type": "longrope", "factor": 2.0, "rope_theta": 1e4}}, "rope_parameters", "longrope"),
])
def test_what_a_qwen3_next_file_holds_that_we_do_not_compute_is_refused(tmp_path, change, field, why):
    make_hf("moe-grouped-values", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ConfigError) as e:
        load_config(None, {"model.from_hf": str(tmp_path), "data.seq_len": 16})
    line = one_line(e)
    assert line.startswith("model.from_hf: ") and f"{field}=" in line and why in line, line


def test_options_without_linear_attention_are_refused_in_one_line():
    with pytest.raises(ConfigError) as e:
        load_config(None, {"model.linear_conv": 3})
    assert one_line(e) == "model.linear_conv shape linear attention, but model.linear_heads=0; set it, or drop them"
    with pytest.raises(ConfigError) as e:
        load_config(None, {"model.linear_heads": 2, "model.linear_value_heads": 3})
    assert one_line(e) == ("model.linear_value_heads=3 must be a multiple of model.linear_heads=2 (each key head "
                           "serves the same number of value heads)")
    with pytest.raises(ConfigError, match="Qwen3-Next's, which is rope, zero-centred rmsnorm"):
        hf_family(ModelConfig(position="rope", norm="rmsnorm", activation="swiglu", linear_heads=2, attn_gate=True,
                              qk_norm=True))


def test_a_rank_reads_its_slices_of_the_translated_tensors(tmp_path):
    """What a sharded rank reads (`read(name, index)`: rows that cut heads and the reordered
    convolution's groups) is that slice of the whole translated tensor, for every parameter."""
    make_hf("moe-grouped-values", tmp_path)
    cfg = load_config(None, {"model.from_hf": str(tmp_path), "data.seq_len": 16}).model
    weights = load_hf_weights(tmp_path, cfg)
    for name in weights:
        whole = weights[name]
        index = tuple(slice(min(3, n - 1), max(min(3, n - 1) + 1, n - 2)) for n in whole.shape)
        assert torch.equal(weights.read(name, index), whole[index]), name


def test_the_planners_count_by_hand_and_transformers():
    """Parameters: transformers' own count, on one rank; on each of 2 tp ranks every split matrix
    (attention's, linear attention's projections, the dense MLPs, embedding and head) halved and the
    rest whole (a single K/V head's projections too), counted from the model; the two pipeline
    stages' blocks as the trainer splits them."""
    from scaletrain.layout import Layout
    from scaletrain.model.transformer import count_params
    from scaletrain.plan.params import rank_params, total_and_active

    for name in ("moe-grouped-values", "tied-dense-first"):
        config = transformers.Qwen3NextConfig(**SHAPES[name])
        with torch.device("meta"):
            hf = transformers.AutoModelForCausalLM.from_config(config)
        cfg = ModelConfig(**model_config_from_hf(config.to_dict()))
        assert count_params(cfg) == total_and_active(cfg)[0] == rank_params(cfg, Layout(), 0).total == \
            sum(p.numel() for p in hf.parameters())
        split = ("attn.wq.", "attn.wo.", "attn.in_qkvz.", "attn.in_ba.", "attn.out.", "mlp.w")
        split += ("attn.wk.", "attn.wv.") if cfg.kv_heads >= 2 else ()  # (one K/V head: whole on both ranks)
        model = Transformer(cfg)
        by_hand = sum(p.numel() // 2 if n.startswith(("tok_emb", "output")) or any(s in n for s in split) else p.numel()
                      for n, p in model.named_parameters())
        assert rank_params(cfg, Layout(tp=2), 0).total == by_hand, name
        stages = [rank_params(cfg, Layout(pp=2), r).total for r in range(2)]
        tied = cfg.dim * cfg.vocab_size if cfg.tie_embeddings else 0  # (the last stage holds the tied head too)
        assert sum(stages) == count_params(cfg) + tied


def test_flops_per_token_of_linear_attention_by_hand():
    """6 per active matmul parameter (the gated full attention's doubled wq, the linear blocks'
    in_qkvz, in_ba and out, the router, the shared expert's gate, the top-2 and shared experts, the
    head) plus the full blocks' scores over 32 keys, plus each linear block's chunked delta rule
    (chunk 32 here: the whole sequence) and its convolution, 3x their forward."""
    from scaletrain.model.flops import flops_per_token
    from scaletrain.plan.params import total_and_active

    cfg = ModelConfig(**model_config_from_hf(transformers.Qwen3NextConfig(**TINY).to_dict()))
    d, T = 64, 32
    full = 2 * d * 64 + 2 * d * 32 + 64 * d  # wq (query and gate), wk, wv, wo
    linear = d * (2 * 2 * 8 + 2 * 4 * 12) + d * 2 * 4 + 4 * 12 * d  # in_qkvz, in_ba, out
    moe = d * 4 + d + 3 * d * (2 * 32 + 40)  # router, shared gate, two experts and the shared one
    active = 2 * (full + moe) + 2 * (linear + moe) + d * 128
    assert total_and_active(cfg)[1] == active
    scores = 6 * 4 * (16 + 16) * T * 2  # the two full blocks
    delta = 3 * (4 * (T * (5 * 8 + 3 * 12) + 6 * 8 * 12) + 2 * 4 * (2 * 2 * 8 + 4 * 12))  # a linear block
    assert flops_per_token(cfg, T) == 6 * active + scores + 2 * delta


def test_the_generation_cache_holds_the_state_not_the_positions(tmp_path):
    """After a prompt, the cache holds the full blocks' keys and values for every position and, per
    linear block, its state and the convolution's last inputs (fp32 here), as the planner counts it;
    the linear blocks' share does not grow with the positions."""
    from scaletrain.plan.params import latent_cache_bytes

    make_hf("moe-grouped-values", tmp_path)
    model = ours_from(tmp_path)
    held = []
    for positions in (9, 17):
        cache = KVCache(positions)
        with torch.no_grad():
            model(torch.randint(0, 128, (2, positions), generator=torch.Generator().manual_seed(5)), cache)
        keys = sum(cache.positions_held(b) * 2 * 2 * 32 * 4 for b in ("1", "3"))  # (B, kv heads x head_dim) x 2
        linear = [t.numel() * t.element_size() for b in ("0", "2") for t in cache.linear_state(b)]
        assert sum(linear) == 2 * 2 * (4 * 8 * 12 + 80 * 3) * 4
        assert keys + sum(linear) == latent_cache_bytes(model.cfg, 2, positions, bytes_per_value=4)
        held.append(sum(linear))
    assert held[0] == held[1]


@pytest.mark.slow
def test_lora_on_the_linear_and_gated_attention_exports_to_peft(tmp_path):
    """LoRA on the attention's linears of both kinds (the gated q_proj, k_proj, v_proj, o_proj; the
    linear blocks' in_proj_qkvz, in_proj_ba, out_proj), trained from an imported Qwen3-Next: the
    merged export computes our logits in transformers; the PEFT folder loads onto the transformers
    base with them, and back onto ours (the gated q_proj's rows reordered for the partial rotary as
    its weight's are: its query's first rotary_dim rows of each head, never the gate's)."""
    peft = pytest.importorskip("peft")
    from scaletrain.train.trainer import Trainer
    from scaletrain.trained.adapters import adapted_from_checkpoint, load_peft

    from conftest import micro_overrides, run_here

    make_hf("moe-grouped-values", tmp_path / "hf", vocab_size=256)
    run = {"model.from_hf": str(tmp_path / "hf"), "model.init_from": str(tmp_path / "hf"), "data.seq_len": 16,
           "model.max_seq_len": 64, "model.linear_chunk": CHUNK, "train.steps": 3, "optim.lr": 0.01,
           "checkpoint.save_final": True, "adapter.kind": "lora", "adapter.targets": "attention"}
    values = {k: v for k, v in micro_overrides(tmp_path / "run", **run).items()
              if not k.startswith(("model.dim", "model.n_"))}  # (the shape is the checkpoint's)
    saved = Trainer(load_config(None, values)).fit()["checkpoint"]
    ours, _ = adapted_from_checkpoint(saved)
    assert {"layers.0.attn.in_qkvz", "layers.0.attn.in_ba", "layers.0.attn.out", "layers.1.attn.wq"} <= {
        n.removesuffix(".lora_a") for n, _ in ours.named_parameters() if n.endswith(".lora_a")}
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(3))
    want = logits(ours, x)
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    assert (want - logits(base, x, hf=True)).abs().max() > 0.05  # the adapters changed the model
    r = run_here("export", saved, "--format", "hf", "--out", str(tmp_path / "merged"))
    assert r.returncode == 0, r.stderr
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    assert (logits(merged, x, hf=True) - want).abs().max() <= TOL
    r = run_here("export", saved, "--format", "peft", "--out", str(tmp_path / "peft"))
    assert r.returncode == 0, r.stderr
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert set(config["target_modules"]) == {"q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkvz", "in_proj_ba",
                                             "out_proj"}
    adapted = peft.PeftModel.from_pretrained(base, str(tmp_path / "peft")).eval()
    assert (logits(adapted, x, hf=True) - want).abs().max() <= TOL
    back, _ = load_peft(tmp_path / "peft")  # and PEFT's folder read back onto our base, rows and all
    assert (logits(back.eval(), x) - want).abs().max() <= TOL
