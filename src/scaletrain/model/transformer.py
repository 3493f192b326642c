"""A decoder-only transformer covering the GPT-2 and Llama families, in plain PyTorch; any of its
blocks may hold a mixture of experts (model/moe.py) instead of a dense MLP.

It runs on one device and knows nothing of parallelism; `scaletrain.parallel` transforms it.
Two choices make that possible:

* Blocks live in a `ModuleDict` keyed by their global index ("0", "1", ...), so a pipeline stage
  can delete the blocks it does not own and keep the names (and so the checkpoint keys) of the
  rest. The embedding, final norm and head may likewise be set to None on middle stages.
* Attention infers its local head count from the tensor shapes (`view(B, T, -1, head_dim)`),
  so the same code runs when tensor parallelism shards the projections by heads.

Initial values are a function of the parameter's name alone (see `init_rule` and
`scaletrain.parallel.init`), so every layout starts from the same weights.

Documents packed in one window (data.document_mask): with `separator` set, a query attends only
to the keys of its own document, a document being what lies after a separator token up to and
including the next one, and positions (rotary and learned) restart at each document's first
token, as Hugging Face's packing with position_ids does. The mask is an explicit boolean one
through scaled_dot_product_attention (exact on CPU and GPU); generation with the key/value cache
does not use it.

Local attention (model.sliding_window, model.attn_chunk; with model.global_every, in some blocks
only): each such block's Attention holds its Window, and attention, its key/value cache and
context parallelism's methods all ask the window's one rule (model/window.py).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from scaletrain.model.config import ModelConfig
from scaletrain.model.deltanet import GatedDeltaNet
from scaletrain.model.kv_cache import KVCache
from scaletrain.model.layers import RMSNorm, apply_rope
from scaletrain.model.mla import LatentAttention
from scaletrain.model.mlp import MLP
from scaletrain.model.moe import MoE
from scaletrain.model.mtp import MTPDepth, tokens_ahead
from scaletrain.model.nope import QueryScale, l2_heads, temperature_table
from scaletrain.model.sinks import sink_attention
from scaletrain.model.window import Window, block_window, causal_allows, local_attention
from scaletrain.model.yarn import attention_factor, yarn_frequencies


def make_norm(cfg: ModelConfig) -> nn.Module:
    if cfg.norm == "rmsnorm":
        return RMSNorm(cfg.dim, cfg.norm_eps, cfg.norm_unit_offset)
    if cfg.norm == "layernorm":
        return nn.LayerNorm(cfg.dim, eps=cfg.norm_eps, bias=cfg.bias)
    raise ValueError(f"unknown norm {cfg.norm!r}")


def rope_frequencies(cfg: ModelConfig, device=None) -> torch.Tensor:
    """The rotation speed of each pair of a head, (head_size // 2,) in fp32: theta^(-2i/d),
    stretched by `rope_scaling` for contexts longer than the model was first trained on."""
    d = cfg.rotary_dim  # (a head's first rotary_dim coordinates turn, the rest do not)
    freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, device=device, dtype=torch.float32) / d))
    if cfg.rope_scaling == "linear":  # positions / factor, the same as frequencies / factor
        return freq / cfg.rope_factor
    if cfg.rope_scaling == "llama3":
        # Llama 3.1: pairs that turn fast (wavelength < original / high) keep their speed, slow
        # ones (wavelength > original / low) slow down by `factor`, those between blend the two
        original, low, high = cfg.rope_original_max_seq_len, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
        wavelength = 2 * math.pi / freq
        blend = ((original / wavelength - low) / (high - low)).clamp(0.0, 1.0)  # 1 = keep, 0 = divide
        scaled = (1 - blend) * freq / cfg.rope_factor + blend * freq
        scaled = torch.where(wavelength < original / high, freq, scaled)
        return torch.where(wavelength > original / low, freq / cfg.rope_factor, scaled)
    if cfg.rope_scaling == "yarn":
        return yarn_frequencies(cfg, freq)
    return freq


def rope_tables(cfg: ModelConfig, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary angles, each (max_seq_len, rotary_dim // 2), in fp32 (times YaRN's
    attention factor, which so scales the rotated coordinates)."""
    angles = torch.outer(torch.arange(cfg.max_seq_len, device=device, dtype=torch.float32),
                         rope_frequencies(cfg, device))
    factor = attention_factor(cfg)
    if factor != 1.0:
        return angles.cos() * factor, angles.sin() * factor
    return angles.cos(), angles.sin()


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, window: Window | None = None):
        """`window`: the keys each query sees (sliding or chunked, model/window.py); None: all before it."""
        super().__init__()
        self.window = window
        self.head_dim = cfg.head_size
        self.dropout = cfg.dropout
        self.scale = cfg.attn_scale_dim ** -0.5 if cfg.attn_scale_dim else None  # None: 1 / sqrt(head_dim)
        self.softcap = cfg.attn_softcap
        qkv_bias = cfg.bias or cfg.qkv_bias
        # Qwen3-Next: each head's rows of wq are [query | gate], the gate's sigmoid scaling the head's output
        self.gated = cfg.attn_gate
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * self.head_dim * (2 if self.gated else 1), bias=qkv_bias)
        self.wk = nn.Linear(cfg.dim, cfg.kv_heads * self.head_dim, bias=qkv_bias)
        self.wv = nn.Linear(cfg.dim, cfg.kv_heads * self.head_dim, bias=qkv_bias)
        self.wo = nn.Linear(cfg.n_heads * self.head_dim, cfg.dim, bias=cfg.bias)
        # Qwen3: one RMSNorm weight of head_dim shared by all heads, so it is the same on every
        # tensor-parallel rank whatever heads the rank holds. OLMoE: one norm over the whole
        # projection (every head's rows at once), a weight per row
        self.norm_heads = cfg.qk_norm_scope == "head"
        q_width, k_width = (self.head_dim,) * 2 if self.norm_heads else (cfg.n_heads * self.head_dim,
                                                                         cfg.kv_heads * self.head_dim)
        self.q_norm = RMSNorm(q_width, cfg.norm_eps, cfg.norm_unit_offset) if cfg.qk_norm else None
        self.k_norm = RMSNorm(k_width, cfg.norm_eps, cfg.norm_unit_offset) if cfg.qk_norm else None
        # gpt-oss: a learned logit per query head in each softmax's denominator (model/sinks.py)
        self.sinks = nn.Parameter(torch.zeros(cfg.n_heads)) if cfg.attn_sinks else None
        self.l2_eps = cfg.norm_eps if cfg.qk_l2_norm else None  # Llama 4's weightless q/k norm (model/nope.py)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                cache: tuple[KVCache, str] | None = None, *, mask: torch.Tensor | None = None) -> torch.Tensor:
        """`cache`: (the KVCache, this block's name): x holds the positions after those cached;
        rope's tables start at the first of them. `mask` (B, 1, T, T) bool: which keys each query
        sees (packed documents, `document_mask`), in place of the causal mask; the window, if any,
        narrows it further."""
        B, T, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds only its share of the heads
        q, k = self.wq(x), self.wk(x)
        gate = None
        if self.gated:  # (B, T, heads * head_dim) each
            q, gate = (t.flatten(2) for t in q.view(B, T, -1, 2 * self.head_dim).chunk(2, dim=-1))
        if self.q_norm is not None and not self.norm_heads:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(B, T, -1, self.head_dim)  # (B, T, n_heads, head_dim)
        k = k.view(B, T, -1, self.head_dim)  # (B, T, n_kv_heads, head_dim)
        v = self.wv(x).view(B, T, -1, self.head_dim)
        if self.q_norm is not None and self.norm_heads:
            q, k = self.q_norm(q), self.k_norm(k)
        if isinstance(rope, QueryScale):  # a no-rope block's query temperature (Llama 4)
            q = rope.apply(q)
        elif rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
            if self.l2_eps is not None:  # (Llama 4: after the rotation, in the rotary blocks only)
                q, k = l2_heads(q, self.l2_eps), l2_heads(k, self.l2_eps)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, heads, T, head_dim)
        if cache is not None:
            y = self._cached(q, k, v, *cache)
        else:
            y = self.attend(q, k, v, mask, mask is None)  # (B, heads, T, head_dim)
        y = y.transpose(1, 2).flatten(2)  # (B, T, heads * head_dim)
        return self.wo(y if gate is None else y * torch.sigmoid(gate))  # (B, T, dim)

    def _cached(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache, block: str) -> torch.Tensor:
        """Generation: the queries of positions past.. after the cached ones, against the keys the
        cache keeps (a local block's: only those its window can still reach)."""
        past, T = cache.length, q.shape[2]
        k, v, first = cache.append(block, k, v, self.window)  # keys of positions first .. past + T - 1
        if T == 1:  # a single new token sees every key kept
            return self._kernel(q, k, v, None, False)
        if first == 0 and past == 0 and self.window is None:
            return self._kernel(q, k, v, None, True)
        allowed = causal_allows(self.window, torch.arange(past, past + T, device=q.device),
                                torch.arange(first, first + k.shape[2], device=q.device))
        return self._kernel(q, k, v, allowed, False)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
               causal: bool) -> torch.Tensor:
        """softmax(q kᵀ / √head_dim) v, k and v with as many or fewer (grouped) heads than q, each
        query seeing the keys `mask` (or causality) and the block's window allow. The one step a
        transformation may replace on an instance (context parallelism brings the keys of other
        ranks here), so it stays a method of its own."""
        if self.window is not None:  # (training: queries and keys of the same positions)
            return local_attention(q, k, v, self.window, mask, self._kernel)
        return self._kernel(q, k, v, mask, causal)

    def _kernel(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                causal: bool) -> torch.Tensor:
        """Attention over the keys given, as `mask` or causality allow. Soft-capped scores (Gemma 2)
        are computed as plain matmuls, as transformers' eager attention does: no fused kernel caps them;
        so are scores with sinks (model/sinks.py)."""
        if self.sinks is not None:
            return sink_attention(q, k, v, self.sink_logits(), mask, causal, scale=self.scale, softcap=self.softcap,
                                  dropout=self.dropout if self.training else 0.0)
        if self.softcap:
            return self._capped(q, k, v, mask, causal)
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, dropout_p=self.dropout if self.training else 0.0,
            enable_gqa=q.shape[1] != k.shape[1], scale=self.scale)

    def sink_logits(self) -> torch.Tensor:
        """The sinks of the query heads this module computes (tensor parallelism replaces this
        method on the instance with its rank's share)."""
        return self.sinks

    def _capped(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                causal: bool) -> torch.Tensor:
        if k.shape[1] != q.shape[1]:  # grouped-query: each K/V head serves q_heads / kv_heads query heads
            k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
        scores = q @ k.transpose(-2, -1) * (self.scale or self.head_dim ** -0.5)
        scores = self.softcap * torch.tanh(scores / self.softcap)
        T, S = scores.shape[-2:]
        if mask is None and causal:  # query i sees keys up to S - T + i
            mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(diagonal=S - T)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        weights = F.dropout(torch.softmax(scores.float(), dim=-1).type_as(q), self.dropout, self.training)
        return weights @ v


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int = 0):
        """`index`: the block's place in the model (which blocks are mixtures of experts)."""
        super().__init__()
        # norm_placement: pre-norms normalise each sub-block's input (attn_norm, mlp_norm), post-norms
        # its output before the residual add (attn_post_norm, mlp_post_norm; OLMo 2, Gemma)
        pre, post = cfg.norm_placement in ("pre", "both"), cfg.norm_placement in ("post", "both")
        self.attn_norm = make_norm(cfg) if pre else None
        if cfg.is_linear_block(index):  # Qwen3-Next's linear-attention blocks (model/deltanet.py)
            self.attn = GatedDeltaNet(cfg)
        else:
            self.attn = LatentAttention(cfg) if cfg.mla_kv_rank else Attention(cfg, block_window(cfg, index))
        self.attn_post_norm = make_norm(cfg) if post else None
        self.mlp_norm = make_norm(cfg) if pre else None
        self.mlp_post_norm = make_norm(cfg) if post else None
        self.parallel_residual = cfg.parallel_residual
        # a mixture of experts is `moe`, a dense MLP `mlp`: their weights differ in name and shape
        if cfg.is_moe_block(index):
            self.moe = MoE(cfg)
        else:
            self.mlp = MLP(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    @property
    def ffn(self) -> nn.Module:
        return self.moe if hasattr(self, "moe") else self.mlp

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                cache: tuple[KVCache, str] | None = None, *, mask: torch.Tensor | None = None) -> torch.Tensor:
        h = _maybe(self.attn_norm, x)
        # the cache (generation) and the documents' mask go by keyword: tensor parallelism's input plans
        # lay out (x, rope) alone and pass keywords on as they are
        a = self.attn(h, rope, mask=mask) if cache is None else self.attn(h, rope, cache=cache)
        a = _maybe(self.attn_post_norm, a)
        if self.parallel_residual:  # GPT-NeoX: x + attn(norm1(x)) + mlp(norm2(x))
            return x + self.drop(a) + self.drop(self.ffn(self.mlp_norm(x)))
        x = x + self.drop(a)
        return x + self.drop(_maybe(self.mlp_post_norm, self.ffn(_maybe(self.mlp_norm, x))))


def _maybe(norm: nn.Module | None, x: torch.Tensor) -> torch.Tensor:
    return x if norm is None else norm(x)


@dataclass(frozen=True)
class InitRule:
    """How a parameter starts: normal(0, std), or a constant."""

    kind: str  # "normal" | "zeros" | "ones"
    std: float = 0.0


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, separator: int | None = None):
        """`separator`: the token id that ends each document of packed inputs (data.document_mask):
        attention stays within documents and positions restart at each; None: one sequence a window."""
        super().__init__()
        self.cfg = cfg
        self.separator = separator
        self.tok_emb: nn.Embedding | None = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.pos_emb: nn.Embedding | None = (
            nn.Embedding(cfg.max_seq_len, cfg.dim) if cfg.position == "learned" else None)
        self.drop = nn.Dropout(cfg.dropout)
        self.layers = nn.ModuleDict({str(i): Block(cfg, i) for i in range(cfg.n_layers)})
        self.norm: nn.Module | None = make_norm(cfg)
        self.output: nn.Linear | None = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_emb.weight
        # multi-token prediction (model/mtp.py): depth j + 1's module, its block numbered after the last
        self.mtp: nn.ModuleDict | None = nn.ModuleDict({
            str(j): MTPDepth(cfg.dim, Block(cfg, cfg.n_layers + j), lambda: make_norm(cfg))
            for j in range(cfg.mtp_depth)}) if cfg.mtp_depth else None
        if cfg.position == "rope":
            cos, sin = rope_tables(cfg)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)
        if cfg.rope_local_theta:  # Gemma 3: the sliding-window blocks turn at their own base, unscaled
            cos, sin = rope_tables(local_rope(cfg))
            self.register_buffer("rope_local_cos", cos, persistent=False)
            self.register_buffer("rope_local_sin", sin, persistent=False)
        if cfg.attn_temperature:  # Llama 4: the no-rope blocks' query factor of each position
            self.register_buffer("attn_temp", temperature_table(cfg), persistent=False)

    def init_buffers(self, device: torch.device | str | None = None) -> None:
        """After `to_empty` from the meta device: re-tie the head to the embedding (`to_empty`
        gives each module its own new tensor) and recompute non-persistent buffers."""
        if self.cfg.tie_embeddings and self.output is not None and self.tok_emb is not None:
            self.output.weight = self.tok_emb.weight
        if self.cfg.position == "rope":
            cos, sin = rope_tables(self.cfg, device=device or self.rope_cos.device)
            self.rope_cos, self.rope_sin = cos, sin
        if self.cfg.rope_local_theta:
            self.rope_local_cos, self.rope_local_sin = rope_tables(local_rope(self.cfg), device=self.rope_cos.device)
        if self.cfg.attn_temperature:
            self.attn_temp = temperature_table(self.cfg, device=self.rope_cos.device)
        for m in self.modules():
            if isinstance(m, MoE):
                m.reset_state()

    def init_rule(self, name: str) -> InitRule:
        """The initial distribution of parameter `name` (a canonical name, no wrapper prefixes)."""
        leaf = name.rsplit(".", 1)[-1]
        if name.endswith(("attn.z_norm.weight", "attn.dt_bias")):  # (linear attention's: a plain scale, 1)
            return InitRule("ones")
        if name.endswith("attn.A_log"):  # a decay rate of exp(0) = 1
            return InitRule("zeros")
        if "norm" in name.rsplit(".", 2)[-2]:  # (a (1 + w) RMSNorm is the identity at w = 0)
            ones = leaf == "weight" and not (self.cfg.norm_unit_offset and self.cfg.norm == "rmsnorm")
            return InitRule("ones") if ones else InitRule("zeros")
        if leaf in ("bias", "b1", "b2", "b3"):  # (b1, b2, b3: the experts' biases, gpt-oss)
            return InitRule("zeros")
        if name.endswith(("attn.wo.weight", "attn.out.weight", "mlp.w2.weight", "moe.w2", "shared.w2.weight")):
            # GPT-2: scale the projections into the residual stream by 1/sqrt(2 * n_layers)
            return InitRule("normal", self.cfg.init_std / math.sqrt(2 * self.cfg.n_layers))
        return InitRule("normal", self.cfg.init_std)

    def forward(self, tokens: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        """tokens (B, T) int64 -> logits (B, T, vocab). A pipeline stage without the embedding
        takes hidden states (B, T, dim) instead, and one without the head returns them.

        `cache` (generation): tokens are the positions after the `cache.length` already cached;
        their keys and values are added to it, so each new token costs one position."""
        past = cache.length if cache is not None else 0
        # token ids are embedded; hidden states (a later pipeline stage's input) go on as they are. A
        # last stage of a tied model holds the embedding too, for its weight (the head's) alone
        embed = self.tok_emb is not None and not tokens.is_floating_point()
        mask = positions = None
        if self.separator is not None and cache is None:  # packed documents (training, evaluation)
            if tokens.is_floating_point():  # (config loading refuses pipeline stages with document masks)
                raise ValueError("document masks are built from token ids; this model was given hidden states")
            docs = document_ids(tokens, self.separator)
            mask, positions = document_mask(docs), document_positions(docs)
        h = self.tok_emb(tokens) if embed else tokens  # (B, T, dim)
        if embed and self.cfg.embed_scale:  # Gemma: sqrt(dim), rounded to the activations' dtype as it does
            h = h * torch.tensor(self.cfg.dim ** 0.5, dtype=h.dtype)
        if self.pos_emb is not None and embed:
            h = h + self.pos_emb(torch.arange(past, past + h.shape[1], device=h.device) if positions is None
                                 else positions)
        if embed:
            h = self.drop(h)
        rope = _tables(getattr(self, "rope_cos", None), getattr(self, "rope_sin", None), past, positions)
        local = _tables(getattr(self, "rope_local_cos", None), getattr(self, "rope_local_sin", None), past,
                        positions) if self.cfg.rope_local_theta else rope
        nope = _query_scale(getattr(self, "attn_temp", None), past, positions)
        tables = {"rope": rope, "local": local, "nope": nope}
        for name, block in self.layers.items():
            r = self._tables_of(int(name), tables)
            if cache is not None:
                h = block(h, r, cache=(cache, name))
            else:
                h = block(h, r) if mask is None else block(h, r, mask=mask)
        if cache is not None:
            cache.advance(tokens.shape[1])
        if self.mtp is not None and self.training and cache is None and embed and self.output is not None:
            # training with multi-token prediction: the main head's logits, then each depth's, along the sequence
            return self._head(torch.cat([self.norm(h), *self._depths(h, tokens, tables, mask)], dim=1))
        if self.norm is not None:
            h = self.norm(h)
        return self._head(h) if self.output is not None else h

    def _tables_of(self, index: int, tables: dict) -> object:
        """What block `index` turns its queries and keys by: the rotary tables, a local block's own, or a
        no-rope block's query scale."""
        if self.cfg.is_nope_block(index):
            return tables["nope"]
        return tables["local"] if self.cfg.is_local_block(index) else tables["rope"]

    def _depths(self, h: torch.Tensor, tokens: torch.Tensor, tables: dict, mask: torch.Tensor | None) -> list:
        """Multi-token prediction (model/mtp.py): each depth's normalised hidden states (B, T, dim), depth k
        from depth k - 1's (the main model's last block output for k = 1) and the embeddings of the tokens k
        ahead."""
        out = []
        for j, depth in self.mtp.items():
            k = int(j) + 1
            ahead = self.tok_emb(tokens_ahead(tokens, k))  # (B, T, dim): Emb(t_{i+k})
            if self.cfg.embed_scale:
                ahead = ahead * torch.tensor(self.cfg.dim ** 0.5, dtype=ahead.dtype)
            h = depth(h, ahead, self._tables_of(self.cfg.n_layers + int(j), tables), mask)
            out.append(depth.head_norm(h))
        return out

    def _head(self, h: torch.Tensor) -> torch.Tensor:
        h = self.output(h)  # (B, T, vocab)
        if self.cfg.logit_softcap:  # Gemma 2
            h = self.cfg.logit_softcap * torch.tanh(h / self.cfg.logit_softcap)
        return h


def _tables(cos: torch.Tensor | None, sin: torch.Tensor | None, past: int,
            positions: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Rotary tables from position `past` on, or (B, T, rotary_dim/2) rows of each sequence's own
    `positions`; None for a model without rotary positions."""
    if cos is None:
        return None
    return (cos[past:], sin[past:]) if positions is None else (cos[positions], sin[positions])


def _query_scale(table: torch.Tensor | None, past: int, positions: torch.Tensor | None) -> QueryScale | None:
    """What a no-rope block gets in place of rotary tables: its query temperature from position
    `past` on (or at each sequence's own `positions`), or None (no temperature: nothing at all)."""
    if table is None:
        return None
    return QueryScale(table[past:] if positions is None else table[positions])


def document_ids(tokens: torch.Tensor, separator: int) -> torch.Tensor:
    """(B, T) the document of each position of packed token ids: the separators before it (a
    separator belongs to the document it ends), as torchtitan derives them from EOS tokens."""
    ends = (tokens == separator).long()
    return ends.cumsum(1) - ends


def document_positions(docs: torch.Tensor) -> torch.Tensor:
    """(B, T) each position's place within its document: 0 at the window's start and at each
    document's first token."""
    t = torch.arange(docs.shape[1], device=docs.device).expand_as(docs)
    starts = torch.ones_like(docs, dtype=torch.bool)
    starts[:, 1:] = docs[:, 1:] != docs[:, :-1]
    return t - torch.where(starts, t, 0).cummax(1).values


def document_mask(docs: torch.Tensor) -> torch.Tensor:
    """(B, 1, T, T) bool: query i sees key j when j <= i and both are in one document."""
    T = docs.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=docs.device).tril()
    return ((docs[:, :, None] == docs[:, None, :]) & causal)[:, None]


def local_rope(cfg: ModelConfig) -> ModelConfig:
    """The rotary settings of the sliding-window blocks (Gemma 3): their own base, no scaling."""
    return dataclasses.replace(cfg, rope_theta=cfg.rope_local_theta, rope_scaling="none", rope_factor=1.0)


def count_params(cfg: ModelConfig) -> int:
    """Parameters of the model described by cfg, counted on the meta device (no memory)."""
    with torch.device("meta"):
        model = Transformer(cfg)
    return sum(p.numel() for p in model.parameters())
