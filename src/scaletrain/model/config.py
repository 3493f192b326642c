"""The model's config: the shape of a decoder-only transformer (GPT-2 and Llama families), with
the checks that concern the model alone. scaletrain.config imports it into the job's config
tree; nothing under model/ imports scaletrain.config.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from scaletrain.errors import ConfigError
from scaletrain.options import build_section, divisors, option


@dataclass
class ModelConfig:
    preset: str = option("", "a built-in shape (see `scaletrain.model.presets`); keys set here override it")
    from_hf: str = option("", "a Hugging Face model folder (or its config.json) whose shape to take; keys set "
                              "here override it")
    init_from: str = option("", "start a new run from these weights: a Hugging Face model folder, a .safetensors "
                                "file or a scaletrain export; empty = initialise from (train.seed, parameter name)")
    vocab_size: int = option(256, "tokens in the vocabulary; 256 for the byte-level tokenizer; 0 = the one data.path "
                                  "was prepared with (a Hugging Face model's own, padding included)", min=2)
    dim: int = option(256, "width of the residual stream", min=1)
    n_layers: int = option(4, "number of transformer blocks", min=1)
    n_heads: int = option(4, "attention heads; must divide dim unless head_dim is set", min=1)
    n_kv_heads: int = option(0, "key/value heads for grouped-query attention; 0 = n_heads", min=0)
    head_dim: int = option(0, "width of each attention head; 0 = dim / n_heads (Qwen3 sets it apart)", min=0)
    ffn_dim: int = option(0, "hidden width of the MLP; 0 = 4*dim (gelu) or 8/3*dim rounded up to 64 (swiglu)", min=0)
    norm: str = option("layernorm", "normalisation layer", choices=("layernorm", "rmsnorm"))
    norm_placement: str = option("pre", "where each block normalises: before each sub-block (GPT-2, Llama), after "
                                        "each sub-block's output, before the residual add (OLMo 2), or both "
                                        "(Gemma 2 and 3)", choices=("pre", "post", "both"))
    norm_unit_offset: bool = option(False, "model.norm=rmsnorm scales by (1 + weight), the weight starting at 0 "
                                           "(Gemma)")
    norm_eps: float = option(1e-5, "epsilon of the normalisation layers", min=0.0)
    activation: str = option("gelu", "MLP type: GELU with the tanh approximation (GPT-2), exact GELU (GPT-NeoX, "
                                     "Pythia), SwiGLU (Llama), GeGLU, gated by tanh-GELU (Gemma), or gpt-oss's "
                                     "clamped SwiGLU (swiglu_clamped: see swiglu_alpha and swiglu_limit)",
                             choices=("gelu", "gelu_exact", "swiglu", "geglu", "swiglu_clamped"))
    swiglu_alpha: float = option(1.702, "activation=swiglu_clamped: the gate's sigmoid gain, "
                                        "g * sigmoid(alpha * g) (gpt-oss's swiglu_alpha)", min=0.0)
    swiglu_limit: float = option(7.0, "activation=swiglu_clamped: the gate is clamped above at this, the up "
                                      "projection to [-limit, limit], and the product is (up + 1) * gated "
                                      "(gpt-oss's swiglu_limit)", min=0.0)
    parallel_residual: bool = option(False, "attention and MLP both read the block's input and their outputs are "
                                            "added to it together (GPT-NeoX, Pythia); false = one after the other")
    embed_scale: bool = option(False, "multiply the token embeddings by sqrt(dim) (Gemma)")
    position: str = option("learned", "position encoding: learned table (GPT-2) or rotary (Llama)",
                           choices=("learned", "rope"))
    rope_theta: float = option(10000.0, "rotary base frequency", min=1.0)
    rotary_fraction: float = option(1.0, "share of each head's width that the rotation turns, the rest left as is "
                                         "(GPT-NeoX's rotary_pct, Phi's partial_rotary_factor)", min=0.0, max=1.0)
    rope_scaling: str = option("none", "stretch the rotary frequencies for long contexts: linear (all divided by "
                                       "rope_factor), llama3 (Llama 3.1: low frequencies only) or yarn (YaRN: a ramp "
                                       "between the two by rotations per original context, the rotated part scaled by "
                                       "its attention factor; DeepSeek-V3, gpt-oss)",
                               choices=("none", "linear", "llama3", "yarn"))
    rope_factor: float = option(1.0, "rope_scaling: how much longer the context gets", min=1.0)
    rope_low_freq_factor: float = option(1.0, "rope_scaling=llama3: wavelengths above original/this are divided "
                                              "by rope_factor", min=0.0)
    rope_high_freq_factor: float = option(4.0, "rope_scaling=llama3: wavelengths below original/this are kept",
                                          min=0.0)
    rope_original_max_seq_len: int = option(8192, "rope_scaling=llama3 or yarn: the context length trained before "
                                                  "scaling", min=1)
    rope_beta_fast: float = option(32.0, "rope_scaling=yarn: pairs turning more than this many times over the "
                                         "original context keep their speed", min=0.0)
    rope_beta_slow: float = option(1.0, "rope_scaling=yarn: pairs turning fewer times than this are divided by "
                                        "rope_factor; those between blend the two", min=0.0)
    rope_truncate: bool = option(True, "rope_scaling=yarn: round the blend's bounds to whole pairs (false: "
                                       "gpt-oss)")
    rope_mscale: float = option(0.0, "rope_scaling=yarn: the attention factor on the rotated part is "
                                     "(1 + 0.1 mscale ln factor) / (1 + 0.1 mscale_all_dim ln factor) when both are "
                                     "set; 0 = 1 + 0.1 ln factor (DeepSeek-V3: 1)", min=0.0)
    rope_mscale_all_dim: float = option(0.0, "rope_scaling=yarn: see rope_mscale; with latent attention the softmax "
                                             "scale is also multiplied by (1 + 0.1 mscale_all_dim ln factor)^2 "
                                             "(DeepSeek-V3: 1)", min=0.0)
    max_seq_len: int = option(128, "longest sequence the position encoding covers", min=1)
    sliding_window: int = option(0, "sliding-window attention (Mistral, Gemma): a query sees itself and the "
                                    "window - 1 tokens before it; 0 = the whole sequence", min=0)
    attn_chunk: int = option(0, "chunked attention (Llama 4's attention_chunk_size): the sequence is cut into chunks "
                                "of this many tokens and a query sees the earlier tokens of its own chunk; 0 = none",
                             min=0)
    global_every: int = option(0, "every n-th block (counting from 1) attends to the whole sequence and the others "
                                  "within model.sliding_window (Gemma 2: 2, Gemma 3: 6) or model.attn_chunk (Llama 4: "
                                  "4); 0 = every block alike", min=0)
    nope_every: int = option(0, "every n-th block (counting from 1) has no rotary positions: its queries and keys "
                                "are not turned (Llama 4's no_rope_layers, every 4th; with model.attn_chunk these are "
                                "the global blocks); 0 = every block rotates", min=0)
    qk_l2_norm: bool = option(False, "scale each head of the queries and keys to unit RMS, without a weight, after the "
                                     "rotation, in the rotary blocks only (Llama 4's use_qk_norm)")
    attn_temperature: float = option(0.0, "the no-rope blocks (model.nope_every) multiply the query at position p by "
                                          "1 + this * log(1 + floor((p + 1) / attn_temperature_floor)) (Llama 4's "
                                          "attn_scale with attn_temperature_tuning); 0 = off", min=0.0)
    attn_temperature_floor: int = option(8192, "model.attn_temperature: positions per step of the query scale "
                                               "(Llama 4's floor_scale)", min=1)
    rope_local_theta: float = option(0.0, "rotary base of the sliding-window blocks, which rope_scaling leaves "
                                          "unscaled (Gemma 3's rope_local_base_freq); 0 = rope_theta and scaling "
                                          "alike in every block", min=0.0)
    attn_scale_dim: int = option(0, "the attention scores are divided by sqrt(this) rather than sqrt(head_dim) "
                                    "(Gemma's query_pre_attn_scalar); 0 = head_dim", min=0)
    attn_sinks: bool = option(False, "a learned logit per query head joins each softmax's denominator as a key "
                                     "with no value, so a query may attend to nothing (gpt-oss's attention sinks)")
    attn_softcap: float = option(0.0, "soft-cap the attention scores to (-c, c): c * tanh(score / c) before the "
                                      "softmax (Gemma 2); 0 = off. Attention then runs as plain matmuls, not "
                                      "scaled_dot_product_attention", min=0.0)
    logit_softcap: float = option(0.0, "soft-cap the output logits likewise: c * tanh(logit / c) (Gemma 2); 0 = off",
                                  min=0.0)
    mla_kv_rank: int = option(0, "multi-head latent attention (DeepSeek-V2/V3): keys and values come up from one "
                                 "compressed latent of this width per token (the cache keeps it, not the heads); "
                                 "head_dim is then each query/key head's width, of which mla_rope_dim rotate; "
                                 "0 = ordinary attention", min=0)
    mla_q_rank: int = option(0, "model.mla_kv_rank: the queries also come up from a latent of this width, "
                                "normalised (DeepSeek-V3: 1536); 0 = one query projection", min=0)
    mla_rope_dim: int = option(64, "model.mla_kv_rank: the rotated part of each query/key head, its key shared by "
                                   "all heads and cached beside the latent", min=2)
    mla_v_dim: int = option(0, "model.mla_kv_rank: each value head's width; 0 = head_dim - mla_rope_dim", min=0)
    attn_gate: bool = option(False, "the query projection is twice as wide: each head's second half, through a "
                                    "sigmoid, gates that head's attention output before wo (Qwen3-Next)")
    linear_heads: int = option(0, "Gated DeltaNet linear attention (Qwen3-Next; model/deltanet.py): the key heads "
                                  "of the linear-attention blocks, which keep a state of fixed size instead of a "
                                  "key/value cache; 0 = every block full attention", min=0)
    linear_value_heads: int = option(0, "model.linear_heads: the value heads (a multiple of linear_heads, which "
                                        "each serve linear_value_heads / linear_heads of); 0 = linear_heads", min=0)
    linear_head_dim: int = option(128, "model.linear_heads: the width of each key (and query) head", min=1)
    linear_value_dim: int = option(0, "model.linear_heads: the width of each value head; 0 = linear_head_dim",
                                   min=0)
    linear_conv: int = option(4, "model.linear_heads: the length of the causal depthwise convolution over the "
                                 "queries, keys and values (Qwen3-Next's linear_conv_kernel_dim)", min=1)
    full_every: int = option(4, "model.linear_heads: every n-th block (counting from 1) attends by full "
                                "attention, the others by linear attention (Qwen3-Next's full_attention_interval)",
                             min=1)
    linear_chunk: int = option(64, "model.linear_heads: the positions of each chunk of the chunked delta rule in "
                                   "training (any sequence length: the last chunk may be shorter)", min=1)
    tie_embeddings: bool = option(True, "share the input embedding with the output head")
    bias: bool = option(False, "add biases to linear layers and LayerNorm")
    qkv_bias: bool = option(False, "add biases to the query, key and value projections only (Qwen2)")
    qk_norm: bool = option(False, "RMSNorm over each head of the queries and keys before the rotation (Qwen3)")
    qk_norm_scope: str = option("head", "what model.qk_norm normalises: each head apart, with one weight of head_dim "
                                        "(Qwen3), or the whole query and key projections, each with its own weight "
                                        "(OLMoE, OLMo 2)", choices=("head", "projection"))
    export_as: str = option("auto", "the Hugging Face family `scaletrain export --format hf` writes where several "
                                    "compute this model: auto = the plainest (Llama for a Llama-like), or phi3 "
                                    "(q/k/v and gate/up fused in one tensor each; an import of Phi-3 sets it)",
                            choices=("auto", "phi3"))
    moe_experts: int = option(0, "routed experts of each mixture-of-experts block; 0 = dense MLPs everywhere", min=0)
    moe_top_k: int = option(2, "experts each token is sent to", min=1)
    moe_shared_experts: int = option(0, "experts every token passes through besides its routed ones (DeepSeek, "
                                        "Qwen2-MoE): one MLP of moe_shared_experts * moe_hidden", min=0)
    moe_hidden: int = option(0, "hidden width of each expert; 0 = the dense MLP's (ffn_dim)", min=0)
    moe_shared_hidden: int = option(0, "the shared experts' MLP width, if not moe_shared_experts * moe_hidden "
                                       "(Qwen3-Next's shared_expert_intermediate_size)", min=0)
    moe_shared_gate: bool = option(False, "the shared experts' output is scaled by sigmoid of a learned linear of the "
                                          "token (Qwen3-Next's shared_expert_gate)")
    moe_every: int = option(1, "every n-th block (counted after moe_first_dense) is a mixture of experts", min=1)
    moe_first_dense: int = option(0, "the first blocks that keep a dense MLP (DeepSeek-V3: 3)", min=0)
    moe_groups: int = option(0, "group-limited routing (DeepSeek-V3's n_group): the experts are cut into this many "
                                "groups of consecutive ones, a token chooses its experts within its best "
                                "moe_topk_groups groups, a group's score the sum of its two best (biased) scores; "
                                "0 = all experts open", min=0)
    moe_topk_groups: int = option(0, "model.moe_groups: the groups each token may choose in (DeepSeek-V3: 4)", min=0)
    moe_score: str = option("sigmoid", "router score of each expert: an independent sigmoid (DeepSeek-V3, the "
                                       "scores model.moe_bias_rate was made for: a softmax's scores of the experts a "
                                       "collapsed router neglects shrink, and the bias cannot lift them; "
                                       "docs/benchmarks.md) or a softmax over experts (Mixtral, Qwen3-MoE)",
                            choices=("softmax", "sigmoid"))
    moe_renorm: bool = option(False, "rescale the chosen experts' scores to sum to 1 (Mixtral, Qwen3-MoE)")
    moe_route_scale: float = option(1.0, "factor on the routed experts' weighted sum (DeepSeek-V3's "
                                         "routed_scaling_factor)", min=0.0)
    moe_bias: bool = option(False, "biases on the router's scores and on each expert's matrices (gpt-oss)")
    moe_scale_input: bool = option(False, "the router's weight multiplies each chosen expert's input rather than its "
                                          "output (Llama 4); through the expert's nonlinearity the two differ")
    moe_capacity_factor: float = option(0.0, "tokens an expert takes per micro-batch, as a multiple of an even "
                                             "share (tokens * top_k / experts); the rest are dropped and counted; "
                                             "0 = dropless", min=0.0)
    moe_bias_rate: float = option(1e-2, "load balancing without a loss (DeepSeek-V3): each optimizer step moves "
                                        "every expert's routing bias by this much towards an even load; 0 = off. "
                                        "It must close a collapsed router's score gap (0.07-0.2) within a few steps "
                                        "after the warm-up: DeepSeek-V3's 1e-3 takes 35-105 (docs/benchmarks.md)",
                                  min=0.0)
    moe_aux_loss: float = option(0.0, "coefficient of the Switch load-balancing loss (0.01 is usual); 0 = off",
                                 min=0.0)
    moe_z_loss: float = option(0.0, "coefficient of the router z-loss (ST-MoE; 0.001 is usual); 0 = off", min=0.0)
    mtp_depth: int = option(0, "multi-token prediction (DeepSeek-V3): this many extra modules, each a block with "
                               "the shared embedding and head, predict the tokens 2 .. depth + 1 ahead in training "
                               "(model/mtp.py); generation and evaluation ignore them; 0 = off", min=0)
    mtp_loss_weight: float = option(0.3, "model.mtp_depth: the training loss is the main loss plus this / depth "
                                         "times the sum of the depths' losses (DeepSeek-V3: 0.3, later 0.1)",
                                    min=0.0)
    dropout: float = option(0.0, "dropout on attention weights and residual branches", min=0.0, max=1.0, open_max=True)
    init_std: float = option(0.02, "std of the normal init; residual projections get std/sqrt(2*n_layers)", min=0.0)

    def __hash__(self) -> int:  # configs are not changed after loading: usable as cache keys
        return hash(tuple(self.__dict__.values()))  # the fields (the planner hashes it in its inner loop)

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_size(self) -> int:
        """The width of each attention head in use: head_dim, or dim / n_heads."""
        return self.head_dim or self.dim // self.n_heads

    @property
    def gated(self) -> bool:
        """Whether the MLP is gated (three matrices: SwiGLU, GeGLU) rather than plain (two)."""
        return self.activation in ("swiglu", "geglu", "swiglu_clamped")

    @property
    def rotary_dim(self) -> int:
        """How many of each head's coordinates the rotation turns (all but with rotary_fraction < 1;
        latent attention: its rotated part, mla_rope_dim)."""
        if self.mla_kv_rank:
            return self.mla_rope_dim
        return int(self.head_size * self.rotary_fraction)

    @property
    def value_dim(self) -> int:
        """The width of each value head: head_size, or latent attention's mla_v_dim."""
        if self.mla_kv_rank:
            return self.mla_v_dim or self.head_size - self.mla_rope_dim
        return self.head_size

    @property
    def expert_hidden(self) -> int:
        return self.moe_hidden or self.hidden_dim

    def is_local_block(self, index: int) -> bool:
        """Whether block `index` is a local (sliding-window or chunked) block of model.global_every rather
        than a global one."""
        return bool(self.global_every) and (index + 1) % self.global_every != 0

    def is_nope_block(self, index: int) -> bool:
        """Whether block `index` attends without rotary positions (model.nope_every)."""
        return bool(self.nope_every) and (index + 1) % self.nope_every == 0

    def is_linear_block(self, index: int) -> bool:
        """Whether block `index` attends by linear attention (model.linear_heads) rather than full."""
        return bool(self.linear_heads) and (index + 1) % self.full_every != 0

    @property
    def linear_v_heads(self) -> int:
        return self.linear_value_heads or self.linear_heads

    @property
    def linear_v_dim(self) -> int:
        return self.linear_value_dim or self.linear_head_dim

    @property
    def shared_hidden(self) -> int:
        """The shared experts' MLP width (model.moe_shared_hidden, or moe_shared_experts experts' worth)."""
        return self.moe_shared_hidden or self.moe_shared_experts * self.expert_hidden

    def is_moe_block(self, index: int) -> bool:
        """Whether block `index` holds a mixture of experts rather than a dense MLP."""
        return bool(self.moe_experts) and index >= self.moe_first_dense and \
            (index - self.moe_first_dense) % self.moe_every == 0

    @property
    def moe_blocks(self) -> int:
        return sum(self.is_moe_block(i) for i in range(self.n_layers))

    @property
    def hidden_dim(self) -> int:
        if self.ffn_dim:
            return self.ffn_dim
        if self.gated:
            return 64 * math.ceil(8 * self.dim / 3 / 64)
        return 4 * self.dim


# the model keys that model.from_hf may fill (a saved config gives them all: then it is not read)
MODEL_SHAPE = tuple(f for f in dataclasses.fields(ModelConfig)
                     if f.name not in ("preset", "from_hf", "init_from", "dropout", "init_std"))


def check_model(m: ModelConfig) -> list[str]:
    """Problems among the model's own keys, one line each."""
    errors = []
    if m.dim % m.n_heads and not m.head_dim:
        errors.append(f"model.n_heads={m.n_heads} must divide model.dim={m.dim} (or set model.head_dim); "
                      f"try n_heads in {divisors(m.dim, limit=64)}")
    if m.n_kv_heads and m.n_heads % m.n_kv_heads:
        errors.append(f"model.n_kv_heads={m.n_kv_heads} must divide model.n_heads={m.n_heads}; "
                      f"try one of {divisors(m.n_heads)}")
    if m.position == "rope" and (m.head_dim or m.dim % m.n_heads == 0) and m.head_size % 2:
        errors.append(f"model.position=rope needs an even head dimension, but "
                      f"{'head_dim' if m.head_dim else 'dim/n_heads'} = {m.head_size}")
    if m.rotary_fraction != 1.0 and m.position != "rope":
        errors.append(f"model.rotary_fraction={m.rotary_fraction} says how much of each head rotates; it needs "
                      "model.position=rope")
    elif m.position == "rope" and m.rotary_fraction != 1.0 and (m.head_dim or m.dim % m.n_heads == 0) and \
            (m.rotary_dim < 2 or m.rotary_dim % 2):  # the whole head: the even head dimension's line above
        errors.append(f"model.rotary_fraction={m.rotary_fraction} rotates {m.rotary_dim} of the {m.head_size} "
                      "coordinates of each head; it must be an even number of at least 2")
    if m.norm_unit_offset and m.norm != "rmsnorm":
        errors.append("model.norm_unit_offset=true scales RMSNorm by (1 + weight); it needs model.norm=rmsnorm")
    if m.parallel_residual and m.norm_placement != "pre":
        errors.append(f"model.parallel_residual=true feeds attention and MLP the one normalised input; it needs "
                      f"model.norm_placement=pre, not {m.norm_placement}")
    if m.global_every and not (m.sliding_window or m.attn_chunk):
        errors.append(f"model.global_every={m.global_every} makes the other blocks sliding-window ones, but "
                      "model.sliding_window=0; set the window (or model.attn_chunk), or drop global_every")
    if m.sliding_window and m.attn_chunk:
        errors.append(f"model.sliding_window={m.sliding_window} and model.attn_chunk={m.attn_chunk} are two kinds of "
                      "local attention; set one of them")
    if m.rope_local_theta and not (m.global_every and m.position == "rope"):
        errors.append(f"model.rope_local_theta={m.rope_local_theta:g} is the rotary base of the sliding-window blocks; "
                      "it needs model.position=rope and model.global_every")
    if m.rope_scaling != "none" and m.position != "rope":
        errors.append(f"model.rope_scaling={m.rope_scaling} scales rotary positions; it needs model.position=rope")
    if m.rope_scaling == "none" and m.rope_factor != 1.0:
        errors.append(f"model.rope_factor={m.rope_factor} does nothing without model.rope_scaling; "
                      "set rope_scaling to linear or llama3, or drop rope_factor")
    for kind, keys in (("llama3", ("rope_low_freq_factor", "rope_high_freq_factor")),
                       ("yarn", ("rope_beta_fast", "rope_beta_slow", "rope_truncate", "rope_mscale",
                                 "rope_mscale_all_dim")),
                       ("llama3 or yarn", ("rope_original_max_seq_len",))):
        only = [f"model.{k}" for k in keys if getattr(m, k) != getattr(ModelConfig, k)]
        if m.rope_scaling not in kind.split(" or ") and only:
            errors.append(f"{', '.join(only)} apply to model.rope_scaling={kind} only; set it, or drop them")
    if m.activation != "swiglu_clamped" and (m.swiglu_alpha, m.swiglu_limit) != (ModelConfig.swiglu_alpha,
                                                                                  ModelConfig.swiglu_limit):
        errors.append("model.swiglu_alpha and model.swiglu_limit shape activation=swiglu_clamped only; set it, or "
                      "drop them")
    errors += _latent_errors(m) + _group_errors(m)
    if m.rope_scaling == "llama3" and not 0 < m.rope_low_freq_factor < m.rope_high_freq_factor:
        errors.append(f"model.rope_scaling=llama3 needs 0 < rope_low_freq_factor < rope_high_freq_factor, got "
                      f"{m.rope_low_freq_factor} and {m.rope_high_freq_factor}")
    errors += _nope_errors(m)
    errors += _linear_errors(m)
    if m.qk_norm_scope != "head" and not m.qk_norm:
        errors.append(f"model.qk_norm_scope={m.qk_norm_scope} says what the q/k norms cover, but model.qk_norm=false; "
                      "set model.qk_norm=true, or drop qk_norm_scope")
    if m.moe_experts and m.activation not in ("gelu", "swiglu", "swiglu_clamped"):
        errors.append(f"model.activation={m.activation}: the experts of a mixture compute gelu, swiglu or "
                      "swiglu_clamped; "
                      "set one of those, or model.moe_experts=0")
    if m.moe_experts and m.moe_top_k > m.moe_experts:
        errors.append(f"model.moe_top_k={m.moe_top_k} chooses more experts than model.moe_experts={m.moe_experts}; "
                      f"set moe_top_k to at most {m.moe_experts}")
    moe_only = [f"model.{f.name}" for f in dataclasses.fields(ModelConfig)
                if f.name.startswith("moe_") and f.name != "moe_experts" and getattr(m, f.name) != f.default
                and f.name != "moe_bias_rate"]
    if not m.moe_experts and moe_only:
        errors.append(f"{', '.join(moe_only)} configure mixtures of experts, but model.moe_experts=0 (a dense "
                      "model); set model.moe_experts, or drop them")
    if m.moe_experts and not m.moe_blocks:
        errors.append(f"model.moe_first_dense={m.moe_first_dense} leaves no block of the {m.n_layers} a mixture of "
                      f"experts; lower it below {m.n_layers}")
    if not m.mtp_depth and m.mtp_loss_weight != ModelConfig.mtp_loss_weight:
        errors.append(f"model.mtp_loss_weight={m.mtp_loss_weight:g} weighs multi-token prediction, but "
                      "model.mtp_depth=0; set mtp_depth, or drop mtp_loss_weight")
    if m.vocab_size > 2**32:
        errors.append(f"model.vocab_size={m.vocab_size} is larger than uint32 token ids allow")
    return errors


def _latent_errors(m: ModelConfig) -> list[str]:
    """Problems of latent attention's keys (model.mla_*)."""
    errors = []
    mla_only = [f"model.{k}" for k in ("mla_q_rank", "mla_v_dim") if getattr(m, k)]
    if not m.mla_kv_rank and mla_only:
        errors.append(f"{', '.join(mla_only)} shape latent attention, but model.mla_kv_rank=0; set it, or drop them")
    if m.mla_kv_rank:
        if m.position != "rope":
            errors.append("model.mla_kv_rank: latent attention rotates part of each head; it needs model.position=rope")
        if not m.head_dim or m.head_dim <= m.mla_rope_dim or m.mla_rope_dim % 2:
            errors.append(f"model.mla_kv_rank needs model.head_dim (each query/key head's width) above an even "
                          f"model.mla_rope_dim={m.mla_rope_dim}, got head_dim={m.head_dim}")
        if m.n_kv_heads not in (0, m.n_heads):
            errors.append(f"model.n_kv_heads={m.n_kv_heads}: latent attention brings up keys and values for every "
                          "head from its latent; drop n_kv_heads")
        ours = [f"model.{k}" for k in ("sliding_window", "attn_chunk", "attn_softcap", "attn_sinks", "qk_norm",
                                             "qk_l2_norm", "nope_every", "qkv_bias", "bias") if getattr(m, k)]
        if ours or m.rotary_fraction != 1.0:
            errors.append(f"{', '.join(ours) or 'model.rotary_fraction'}: not implemented with latent attention "
                          "(model.mla_kv_rank); drop it, or set mla_kv_rank=0")
    return errors


def _group_errors(m: ModelConfig) -> list[str]:
    """Problems of group-limited routing (model.moe_groups, moe_topk_groups)."""
    if not m.moe_groups and not m.moe_topk_groups:
        return []
    if not m.moe_groups or not m.moe_topk_groups or m.moe_topk_groups > m.moe_groups:
        return [f"model.moe_topk_groups={m.moe_topk_groups} must be between 1 and model.moe_groups={m.moe_groups}; "
                "set both (DeepSeek-V3: 8 and 4), or neither"]
    if m.moe_experts % m.moe_groups or m.moe_experts // m.moe_groups < 2:
        return [f"model.moe_groups={m.moe_groups} must divide model.moe_experts={m.moe_experts} into groups of at "
                f"least 2 (a group's score is its two best); try one of "
                f"{[g for g in divisors(m.moe_experts) if m.moe_experts // g >= 2]}"]
    if m.moe_score != "sigmoid":
        return ["model.moe_groups: group-limited routing is DeepSeek-V3's, over sigmoid scores; set "
                "model.moe_score=sigmoid"]
    if m.moe_top_k > m.moe_topk_groups * (m.moe_experts // m.moe_groups):
        return [f"model.moe_top_k={m.moe_top_k} is more than the {m.moe_topk_groups} open groups of "
                f"{m.moe_experts // m.moe_groups} experts hold; raise moe_topk_groups or lower moe_top_k"]
    return []


def _linear_errors(m: ModelConfig) -> list[str]:
    """Problems of the linear-attention blocks (model.linear_*) and the shared experts' gate."""
    errors = []
    keys = ("linear_value_heads", "linear_head_dim", "linear_value_dim", "linear_conv", "full_every", "linear_chunk")
    only = [f"model.{k}" for k in keys if getattr(m, k) != getattr(ModelConfig, k)]
    if not m.linear_heads and only:
        errors.append(f"{', '.join(only)} shape linear attention, but model.linear_heads=0; set it, or drop them")
    if m.linear_heads and m.linear_v_heads % m.linear_heads:
        errors.append(f"model.linear_value_heads={m.linear_value_heads} must be a multiple of model.linear_heads="
                      f"{m.linear_heads} (each key head serves the same number of value heads)")
    if m.linear_heads and m.mla_kv_rank:
        errors.append("model.linear_heads and model.mla_kv_rank: the full-attention blocks of a linear-attention "
                      "model are not latent ones; set one of them")
    if (m.moe_shared_hidden or m.moe_shared_gate) and not m.moe_shared_experts:
        errors.append("model.moe_shared_hidden and model.moe_shared_gate shape the shared experts, but "
                      "model.moe_shared_experts=0; set it, or drop them")
    return errors


def _nope_errors(m: ModelConfig) -> list[str]:
    """Problems of the no-rope blocks, the weightless q/k norm and the query temperature (Llama 4)."""
    errors = []
    if m.nope_every and m.position != "rope":
        errors.append(f"model.nope_every={m.nope_every} leaves some blocks without rotary positions; it needs "
                      "model.position=rope")
    if m.qk_l2_norm and m.position != "rope":
        errors.append("model.qk_l2_norm=true normalises the rotated queries and keys; it needs model.position=rope")
    if m.qk_l2_norm and m.qk_norm:
        errors.append("model.qk_l2_norm and model.qk_norm are two q/k norms; set one of them")
    if m.attn_temperature and not m.nope_every:
        errors.append(f"model.attn_temperature={m.attn_temperature:g} scales the queries of the no-rope blocks, but "
                      "model.nope_every=0; set nope_every, or drop attn_temperature")
    if m.attn_temperature_floor != ModelConfig.attn_temperature_floor and not m.attn_temperature:
        errors.append(f"model.attn_temperature_floor={m.attn_temperature_floor} applies to model.attn_temperature "
                      "only; set it, or drop attn_temperature_floor")
    return errors


def model_config(values: Mapping[str, Any], source: str = "model") -> ModelConfig:
    """A validated ModelConfig from a mapping of its keys (Python values): every problem at once."""
    errors: list[str] = []
    m = build_section("model", ModelConfig, values, set(), errors)
    errors += [] if errors else check_model(m)
    if errors:
        raise ConfigError(*errors)
    return m

