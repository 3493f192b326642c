"""Llama 4 (text) in and out: tiny Llama4ForCausalLM models made by transformers (from_config,
save_pretrained; nothing downloaded) compute the same logits in scaletrain after import, and
transformers computes ours after export, in fp32 within 1e-5, on shapes beyond the defaults
(grouped K/V, tied and untied heads, experts in every block and in every other, top-1 and top-2,
chunks that do not divide the sequence). Generation through our cache picks transformers' tokens,
the chunked blocks' cache bounded by the chunk. The new parts against hand computations (the query
temperature, the weightless q/k norm, an expert scaled at its input); what Llama 4 files hold that
scaletrain does not compute is refused in one line; adapters and the planner's counts."""

from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

transformers = pytest.importorskip("transformers")

from scaletrain.config import ModelConfig, load_config  # noqa: E402
from scaletrain.errors import ConfigError  # noqa: E402
from scaletrain.model.generate import generate  # noqa: E402
from scaletrain.model.hf import hf_linear, load_hf_weights  # noqa: E402
from scaletrain.model.hf_config import hf_config_from_model, hf_family, model_config_from_hf  # noqa: E402
from scaletrain.model.kv_cache import KVCache  # noqa: E402
from scaletrain.model.lora import AdapterSpec, apply_adapters  # noqa: E402
from scaletrain.model.moe import MoE  # noqa: E402
from scaletrain.model.nope import l2_heads, temperature_table  # noqa: E402
from scaletrain.model.transformer import Transformer  # noqa: E402
from scaletrain.trained.export_hf import save_hf  # noqa: E402

from conftest import model_from_hf  # noqa: E402

TOL = 1e-5
CHUNK = 5  # (sequences of 17 tokens: three chunks and a part)
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=48, intermediate_size_mlp=96, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
            num_local_experts=4, attention_chunk_size=CHUNK, no_rope_layer_interval=2, floor_scale=3, attn_scale=0.5)
SHAPES = {
    # experts every other block (the 128E model's interleave), grouped K/V 4:2, untied head
    "interleaved": dict(TINY, interleave_moe_layer_step=2),
    # experts in every block, top-2, one K/V head for four queries, a tied head, a no-rope block every 3rd
    "every-block-tied": dict(TINY, num_hidden_layers=3, num_key_value_heads=1, num_experts_per_tok=2,
                             tie_word_embeddings=True, no_rope_layer_interval=3),
    # no chunks (every block global), no q/k norm, head_dim apart from hidden / heads, a dense first block
    "unchunked-dense-first": dict(TINY, attention_chunk_size=None, use_qk_norm=False, head_dim=24,
                                  moe_layers=[1, 2, 3]),
}


def hf_config(name: str, **change):
    """The transformers config make_hf builds its model from."""
    return transformers.Llama4TextConfig(**{**SHAPES[name], **change})


def make_hf(name: str, folder, **change):
    """A seeded tiny transformers model, its norms off their init, its router decisive and its
    experts large enough that a wrong expert shows, saved to `folder`."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(name, **change), attn_implementation="eager",
                                                          dtype=torch.float32)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(0.2 * torch.randn_like(p))
            elif n.endswith("router.weight"):
                p.normal_(0.0, 0.5)
            elif ".experts." in n:
                p.normal_(0.0, 0.1)
    model.eval().save_pretrained(folder)
    return model


def ours_from(folder, seq_len: int = 32) -> Transformer:
    return model_from_hf(folder, seq_len)


def logits(model, tokens, hf: bool = False):
    with torch.no_grad():
        return model(tokens).logits if hf else model(tokens)


@pytest.fixture
def tokens():
    return torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("name", SHAPES)
def test_import_then_export_matches_transformers(name, tmp_path, tokens):
    hf = make_hf(name, tmp_path / "hf")
    ours = ours_from(tmp_path / "hf")
    ref = logits(hf, tokens, hf=True)
    assert ref.abs().max() > 0.1  # the comparison below is not of near-zeros
    assert (logits(ours, tokens) - ref).abs().max() <= TOL
    # the experts matter: routing every token elsewhere changes the logits
    with torch.no_grad():
        moe = next(b.moe for b in ours.layers.values() if hasattr(b, "moe"))
        moe.router.weight.neg_()
        assert (logits(ours, tokens) - ref).abs().max() > 1e-2
        moe.router.weight.neg_()

    # change our weights (as training would), export, and let transformers load the folder on its own
    with torch.no_grad():
        for p in ours.parameters():
            p.add_(0.01 * torch.randn_like(p))
    save_hf(ours, tmp_path / "out")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager").eval()
    assert back.config.model_type == "llama4_text" and back.config.layer_types == hf.config.layer_types
    assert back.config.moe_layers == hf.config.moe_layers and back.config.no_rope_layers == hf.config.no_rope_layers
    assert (logits(back, tokens, hf=True) - logits(ours, tokens)).abs().max() <= TOL
    # and our own import reads the export back to the same model
    assert torch.equal(logits(ours_from(tmp_path / "out"), tokens), logits(ours, tokens))


@pytest.mark.parametrize("yarn", [dict(truncate=False), dict(mscale=0.7, mscale_all_dim=0.3)],
                         ids=["fractional-ramp", "mscales"])
def test_yarn_rotary_scaling_matches_transformers(yarn, tmp_path, tokens):
    """rope_type yarn (model/yarn.py, DeepSeek-V3's and gpt-oss's) in Llama 4's rotary blocks: the
    ramp between fractional pairs, and the attention factor of two mscales."""
    rope = dict(rope_type="yarn", rope_theta=1e4, factor=4.0, original_max_position_embeddings=16, **yarn)
    hf = make_hf("interleaved", tmp_path / "hf", rope_parameters=rope)
    ours = ours_from(tmp_path / "hf")
    assert ours.cfg.rope_scaling == "yarn" and ours.cfg.rope_truncate == yarn.get("truncate", True)
    assert (logits(ours, tokens) - logits(hf, tokens, hf=True)).abs().max() <= TOL


def test_the_options_land_where_llama4_puts_them(tmp_path):
    make_hf("interleaved", tmp_path / "a")
    make_hf("unchunked-dense-first", tmp_path / "b")
    a, b = (ModelConfig(**model_config_from_hf(tmp_path / n)) for n in ("a", "b"))
    assert (a.attn_chunk, a.global_every, a.nope_every, a.qk_l2_norm) == (CHUNK, 2, 2, True)
    assert (a.attn_temperature, a.attn_temperature_floor, a.rope_theta) == (0.5, 3, 500000.0)
    assert [a.is_moe_block(i) for i in range(4)] == [False, True, False, True]
    assert (a.moe_experts, a.moe_top_k, a.moe_score, a.moe_scale_input, a.moe_shared_experts) == (4, 1, "sigmoid",
                                                                                                  True, 1)
    assert (a.expert_hidden, a.hidden_dim, a.moe_renorm, a.moe_bias_rate, a.tie_embeddings) == (48, 96, False, 0.0,
                                                                                                False)
    assert (b.attn_chunk, b.global_every, b.nope_every, b.qk_l2_norm, b.head_size) == (0, 0, 2, False, 24)
    assert [b.is_moe_block(i) for i in range(4)] == [False, True, True, True]
    assert hf_family(a) == "llama4_text" and hf_config_from_model(b)["moe_layers"] == [1, 2, 3]


def test_the_query_temperature_and_the_weightless_norm_by_hand():
    cfg = ModelConfig(max_seq_len=10, position="rope", nope_every=2, attn_temperature=0.5, attn_temperature_floor=3)
    # 1 + 0.5 * log(1 + floor((p + 1) / 3)): steps at positions 2, 5 and 8
    want = [1.0, 1.0, 1 + 0.5 * math.log(2), 1 + 0.5 * math.log(2), 1 + 0.5 * math.log(2), 1 + 0.5 * math.log(3),
            1 + 0.5 * math.log(3), 1 + 0.5 * math.log(3), 1 + 0.5 * math.log(4), 1 + 0.5 * math.log(4)]
    assert temperature_table(cfg).tolist() == pytest.approx(want, rel=1e-6)
    x = torch.tensor([[3.0, 4.0], [0.0, 2.0]])  # root mean squares 5/sqrt(2) and sqrt(2)
    assert l2_heads(x, 0.0).flatten().tolist() == pytest.approx([3 * 2 ** 0.5 / 5, 4 * 2 ** 0.5 / 5, 0.0, 2 ** 0.5])


def test_an_expert_scaled_at_its_input_by_hand():
    """One token, two experts, top-1 by a sigmoid: the chosen expert computes
    W2 (silu(W1 (s x)) * (W3 (s x))) with s = sigmoid(its logit), plus the shared expert (zeros
    here); the weight on the output instead, s W2 (silu(W1 x) * W3 x), is another number (SwiGLU
    is not linear)."""
    cfg = ModelConfig(dim=2, moe_experts=2, moe_top_k=1, moe_hidden=1, activation="swiglu", moe_score="sigmoid",
                      moe_scale_input=True, moe_shared_experts=1, moe_bias_rate=0.0)
    moe = MoE(cfg).eval()
    with torch.no_grad():
        moe.router.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, -1.0]]))  # logits (x0, -x1)
        moe.w1.copy_(torch.tensor([[[1.0, 1.0]], [[9.0, 9.0]]]))
        moe.w3.copy_(torch.tensor([[[0.5, -1.0]], [[9.0, 9.0]]]))
        moe.w2.copy_(torch.tensor([[[2.0], [-3.0]], [[9.0], [9.0]]]))
        for lin in (moe.shared.w1, moe.shared.w2, moe.shared.w3):
            lin.weight.zero_()
    x = torch.tensor([[[2.0, -1.0]]])  # logits (2, 1): expert 0, s = sigmoid(2)
    s = 1 / (1 + math.exp(-2.0))

    def silu(z):
        return z / (1 + math.exp(-z))

    h_in = silu(s * (2 - 1)) * s * (1 + 1)  # W1 (s x) = s, W3 (s x) = 2s
    h_out = s * silu(2 - 1) * (1 + 1)  # s · silu(W1 x) · W3 x
    assert abs(h_in - h_out) > 0.1
    with torch.no_grad():
        assert moe(x).flatten().tolist() == pytest.approx([2 * h_in, -3 * h_in], abs=1e-6)
        moe.scale_input = False
        assert moe(x).flatten().tolist() == pytest.approx([2 * h_out, -3 * h_out], abs=1e-6)


def test_generation_through_the_cache_picks_transformers_tokens(tmp_path):
    """Greedy generation from a prompt longer than a chunk, through our cache: each step's token is
    the one transformers' model picks on the whole sequence, the last step's logits are our full
    forward's, and the chunked blocks hold no more than the chunk's earlier positions."""
    hf = make_hf("interleaved", tmp_path)
    ours = ours_from(tmp_path, seq_len=32)
    prompt = torch.randint(0, 128, (1, CHUNK + 3), generator=torch.Generator().manual_seed(2))
    expected = prompt
    with torch.no_grad():
        for _ in range(3 * CHUNK):
            expected = torch.cat([expected, hf(expected).logits[:, -1:].argmax(-1)], dim=1)
    cache = KVCache(64)
    mine = generate(lambda x, c: ours(x, c), prompt, 3 * CHUNK, window=64, temperature=1.0, top_k=1, cache=cache)
    assert mine.tolist() == expected.tolist()
    chunked = [n for n, b in ours.layers.items() if b.attn.window is not None]
    assert chunked == ["0", "2"] and all(cache.positions_held(n) < CHUNK for n in chunked)
    # the cached step's logits are the full forward's (the temperature at the cached positions)
    cache = KVCache(64)
    with torch.no_grad():
        ours(expected[:, :-1], cache)
        last = ours(expected[:, -1:], cache)
        assert (last[0, -1] - ours(expected)[0, -1]).abs().max() <= TOL


def one_line(excinfo) -> str:
    assert len(excinfo.value.lines) == 1, excinfo.value.lines
    return excinfo.value.lines[0]


@pytest.mark.parametrize("change,field,why", [
    ({"no_rope_layers": [1, 0, 0, 1]}, "no_rope_layers", "scaletrain's are every n-th block"),
    ({"router_jitter_noise": 0.1}, "router_jitter_noise", "router has no jitter"),
    ({"attention_bias": True}, "attention_bias", "bias on the output projection"),
    ({"layer_types": ["chunked_attention"] * 4}, "layer_types", "chunks the rotary blocks only"),
    ({"moe_layers": [1, 2]}, "moe_layers", "cannot express"),
    ({"rope_parameters": {"rope_type": "longrope", "factor": 2.0, "rope_theta": 1e4}}, "rope_parameters", "longrope"),
])
def test_what_a_llama4_file_holds_that_we_do_not_compute_is_refused(tmp_path, change, field, why):
    make_hf("interleaved", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ConfigError) as e:
        load_config(None, {"model.from_hf": str(tmp_path), "data.seq_len": 16})
    line = one_line(e)
    assert line.startswith("model.from_hf: ") and f"{field}=" in line and why in line, line


def test_the_command_line_exits_2_with_one_line(tmp_path):
    from conftest import run_cli

    make_hf("interleaved", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "router_jitter_noise": 0.1}))
    r = run_cli("train", "--print-config", f"--model.from_hf={tmp_path}")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [
        f"scaletrain: error: model.from_hf: {tmp_path / 'config.json'}: router_jitter_noise=0.1 scales the router's "
        "input by random noise in training; scaletrain's router has no jitter: set it to 0"]


def test_options_llama4_lacks_are_refused_in_one_line():
    base = dict(position="rope", norm="rmsnorm", activation="swiglu", nope_every=2)
    with pytest.raises(ConfigError, match="^this model has no Hugging Face family: Llama 4 has no weighted q/k norm"):
        hf_family(ModelConfig(**base, sliding_window=4))
    with pytest.raises(ConfigError, match=r"Llama 4 chunks exactly the rotary blocks"):
        hf_family(ModelConfig(**base, attn_chunk=4, global_every=3))
    with pytest.raises(ConfigError, match=r"Llama 4 routes by a sigmoid scaling the experts' input"):
        hf_family(ModelConfig(**base, moe_experts=4, moe_top_k=1, moe_shared_experts=1, moe_score="sigmoid"))
    with pytest.raises(ConfigError) as e:
        load_config(None, {"model.attn_temperature": 0.1, "model.position": "rope"})
    assert one_line(e) == ("model.attn_temperature=0.1 scales the queries of the no-rope blocks, but "
                           "model.nope_every=0; set nope_every, or drop attn_temperature")
    with pytest.raises(ConfigError) as e:
        load_config(None, {"model.nope_every": 2})  # (learned positions)
    assert one_line(e) == ("model.nope_every=2 leaves some blocks without rotary positions; it needs "
                           "model.position=rope")


def test_adapters_cover_attention_and_the_shared_expert_and_refuse_the_experts(tmp_path):
    make_hf("interleaved", tmp_path)
    cfg = load_config(None, {"model.from_hf": str(tmp_path), "data.seq_len": 16}).model
    adapted = apply_adapters(Transformer(cfg), AdapterSpec(targets="all-linear"))
    assert {"layers.1.attn.wq", "layers.1.moe.shared.w1", "layers.1.moe.shared.w2", "layers.0.mlp.w3"} <= set(adapted)
    assert not any(".moe.router" in n for n in adapted)
    with pytest.raises(ConfigError) as e:  # the routed experts are stacked tensors, no linears
        apply_adapters(Transformer(cfg), AdapterSpec(targets="layers.1.moe.w1"))
    assert one_line(e).startswith("adapter.targets: 'layers.1.moe.w1' matches no linear of the model")
    with pytest.raises(ConfigError) as e:  # PEFT's module names: refused, merged export instead
        hf_linear("layers.1.attn.wq", cfg)
    assert one_line(e).startswith("adapters of a Llama 4 model are not exported to PEFT")


def test_the_planners_count_and_flops(tmp_path):
    """Parameters: transformers' own count. FLOPs per token, by hand: 6 per active matmul
    parameter (attention, the dense MLP or the router + the top-k and shared experts, the head)
    plus 12 · heads · head_dim per key a query sees (a chunked block: the chunk)."""
    from scaletrain.model.flops import flops_per_token
    from scaletrain.model.transformer import count_params
    from scaletrain.plan.params import total_and_active

    hf = make_hf("interleaved", tmp_path)
    cfg = ModelConfig(**model_config_from_hf(tmp_path))
    assert count_params(cfg) == total_and_active(cfg)[0] == sum(p.numel() for p in hf.parameters())
    d, q, kv, E, h, f = 64, 4 * 16, 2 * 16, 4, 48, 96
    attn = 2 * d * q + 2 * d * kv
    blocks = [attn + 3 * d * f, attn + d * E + 3 * d * h * 2] * 2  # dense, experts (top-1 + shared)
    active = sum(blocks) + d * 128
    assert total_and_active(cfg)[1] == active
    seq = 32  # chunked blocks 0 and 2 see 5 keys, the global ones 32
    assert flops_per_token(cfg, seq) == 6 * active + 12 * q * (CHUNK + seq + CHUNK + seq)


def test_a_scout_shaped_config_counts_meta_s_17b_active():
    """Llama 4 Scout's text shape (config.json's text_config: 48 blocks of 16 experts + a shared
    one, top-1): Meta's model card gives 17B active parameters and 109B in all (with the vision
    encoder, which this text model leaves out). Ours: the active matmul parameters plus the
    embedding row a token reads, and every parameter."""
    from scaletrain.plan.params import total_and_active

    scout = dict(model_type="llama4_text", hidden_size=5120, num_hidden_layers=48, num_attention_heads=40,
                 num_key_value_heads=8, head_dim=128, intermediate_size=8192, intermediate_size_mlp=16384,
                 num_local_experts=16, num_experts_per_tok=1, interleave_moe_layer_step=1, vocab_size=202048,
                 attention_chunk_size=8192, max_position_embeddings=10485760, tie_word_embeddings=False,
                 rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 16.0,
                                  "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                  "original_max_position_embeddings": 8192})
    cfg = ModelConfig(**model_config_from_hf(scout))
    total, active = total_and_active(cfg)
    assert round((active + cfg.dim * cfg.vocab_size) / 1e9) == 17
    assert 107e9 < total < 109e9  # (the vision encoder's parameters make up the rest of the 109B)


def test_packed_documents_give_each_documents_own_logits(tmp_path):
    """Documents packed in one sequence (data.document_mask), each longer than a chunk: the logits
    at each document's positions are transformers' on that document alone (its rotary positions and
    its query temperature restart at its first token; the chunks are counted from the window's
    first token, as transformers counts them, so the first document here is two chunks long)."""
    hf = make_hf("interleaved", tmp_path)
    cfg = load_config(None, {"model.from_hf": str(tmp_path), "data.seq_len": 32}).model
    ours = Transformer(cfg, separator=3)
    ours.load_state_dict(ours_from(tmp_path).state_dict())
    g = torch.Generator().manual_seed(4)
    docs = [torch.randint(4, 128, (1, n), generator=g) for n in (2 * CHUNK, 3 * CHUNK - 2)]
    docs[0][0, -1] = 3  # the separator ends the first document
    with torch.no_grad():
        mine = ours.eval()(torch.cat(docs, dim=1))
        ref = torch.cat([hf(d).logits for d in docs], dim=1)
    assert (mine - ref).abs().max() <= TOL


def test_a_rank_reads_its_slices_of_the_translated_tensors(tmp_path):
    """What a sharded rank reads (`read(name, index)`: rows that cut heads, a slice of the experts
    and of their columns) is that slice of the whole translated tensor, for every parameter."""
    make_hf("interleaved", tmp_path)
    cfg = load_config(None, {"model.from_hf": str(tmp_path), "data.seq_len": 16}).model
    weights = load_hf_weights(tmp_path, cfg)
    for name in weights:
        whole = weights[name]
        index = tuple(slice(min(3, n - 1), max(min(3, n - 1) + 1, n - 2)) for n in whole.shape)
        assert torch.equal(weights.read(name, index), whole[index]), name


def test_rotate_half_reorders_each_heads_pairs_by_hand():
    from scaletrain.model.families.llama4_text import interleaved, rotate_half

    rows = torch.arange(12.0)[:, None]  # two heads of 6 rows: pairs (0, 1) (2, 3) (4, 5) in each
    assert rotate_half(rows, 2).flatten().tolist() == [0, 2, 4, 1, 3, 5, 6, 8, 10, 7, 9, 11]
    assert torch.equal(interleaved(rotate_half(rows, 2), 2), rows)


@given(start=st.integers(0, 24), length=st.integers(0, 24), cols=st.sampled_from([slice(None), slice(1, 3)]))
def test_a_part_of_q_or_k_read_from_the_checkpoint_is_that_part_of_the_whole(start, length, cols):
    """Tensor parallelism reads q/k rows a shard at a time, shards that need not cut at a head: the
    view reads the whole heads around the part, reorders them and cuts the part out (an empty part
    included)."""
    from scaletrain.model.families.llama4_text import Llama4View, rotate_half

    cfg = ModelConfig(dim=24, n_heads=4, n_kv_heads=2, position="rope", norm="rmsnorm", activation="swiglu")
    q, k = torch.randn(24, 4), torch.randn(12, 4)  # heads of 6 rows
    source = {"model.layers.0.self_attn.q_proj.weight": q, "model.layers.0.self_attn.k_proj.weight": k}
    view = Llama4View(source, cfg, "model.layers")
    for key, whole, heads in (("q_proj", q, 4), ("k_proj", k, 2)):
        rows = slice(min(start, len(whole)), min(start + length, len(whole)))
        part = view.read(f"model.layers.0.self_attn.{key}.weight", (rows, cols))
        assert torch.equal(part, rotate_half(whole, heads)[rows, cols])
