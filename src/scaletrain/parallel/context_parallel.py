"""Context parallelism: every sequence is cut into 2 × cp chunks and cp rank i holds chunks i and
2cp-1-i (its true positions: RoPE and learned positions follow them). Under causal attention a
late chunk attends to many keys and an early one to few; pairing the two balances the work.

Everything outside attention is per token and needs nothing. Attention needs every earlier key,
and three methods bring them (parallel.cp_method):

  ring       each rank's K/V block travels around the cp ranks (cp - 1 point-to-point shifts per
             layer); each block's partial attention comes with its log-sum-exp, and the partial
             results are merged exactly. Backward passes the blocks round again, each with
             its dK/dV accumulator. Memory: two K/V blocks at a time.
  allgather  the K/V of all cp ranks gathered once per layer (backward: gathered again, their
             gradients reduce-scattered back). Memory: the whole sequence's K/V on every rank,
             during the layer's forward and backward only.

Ring and allgather are each one autograd.Function that keeps for backward only the rank's own
q, k, v, the output and its log-sum-exp, and recomputes the scores there (as flash attention
does), TILE query rows at a time.
  ulysses    an all-to-all swaps sequence shards for head shards: each rank attends over the whole
             sequence for heads/cp of the heads, and a second all-to-all swaps back. Needs the
             heads (per tensor-parallel rank) divisible by cp; K/V heads fewer than cp are copied.

Attention sinks (gpt-oss, model/sinks.py) join each query's denominator once: ring and allgather
fold them into the merged output and its log-sum-exp after the last block (and give the sinks
their gradient from that log-sum-exp in backward); Ulysses runs the one-process kernel with the
sinks of the heads it holds.

A window (sliding or chunked, model/window.py) narrows each method's mask at the tokens' true
positions: ring skips the scores of a block the window excludes whole (its K/V still passes on),
allgather masks the gathered keys, and Ulysses runs the one-process windowed kernel on its heads.

Saves: activations per rank fall as 1/cp (the sequence dimension of every activation is cut;
the score matrices as 1/cp² for ring). Costs: the K/V exchange per layer, forward and backward,
and one all-reduce of the gradients over the cp ranks per step (they hold the same weights and
see different tokens of the same batch: their gradients are summed by the step hook
`ContextParallelStep`, which also cuts each rank's tokens in the data loader).

The model keeps plain code: Attention's one `attend` step is replaced per block, the rotary
tables are cut to this rank's positions, and the learned position lookup is redirected to them.
A mixture of experts routes the rank's own tokens; its per-sequence Switch loss takes the whole
sequence's expert counts (`MoE.sequence_counts`, summed over cp: B × experts numbers per layer),
so the ranks' parts add up to one process's loss. Its load counters are summed over cp by the
step hook (parallel/moe_balance.py).
"""

from __future__ import annotations

import math
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from scaletrain.hooks import StepHook, sum_gradients
from scaletrain.model.mla import LatentAttention
from scaletrain.model.moe import MoE
from scaletrain.model.sinks import fold_sink, sink_attention, sink_gradient
from scaletrain.model.transformer import Attention
from scaletrain.model.window import Window, causal_allows, local_attention
from scaletrain.parallel.moe_balance import summed_over
from scaletrain.vocab import CP_METHODS, unknown

# --------------------------------------------------------------------------------------------
# The split of a sequence


def chunk_positions(seq_len: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """The true positions of cp rank `rank`'s tokens: chunks rank and 2cp-1-rank of 2cp."""
    c = seq_len // (2 * cp)
    first, second = rank * c, (2 * cp - 1 - rank) * c
    return torch.cat([torch.arange(first, first + c, device=device), torch.arange(second, second + c, device=device)])


def shard_sequence(t: torch.Tensor, cp: int, rank: int) -> torch.Tensor:
    """This cp rank's tokens of (B, T, ...) `t` (inputs or targets of the same batch)."""
    return t.index_select(1, chunk_positions(t.shape[1], cp, rank, device=t.device))


def all_positions(seq_len: int, cp: int, device=None) -> torch.Tensor:
    """The true positions of the tokens of all cp ranks, in rank order (how gathers lay them out)."""
    return torch.cat([chunk_positions(seq_len, cp, r, device) for r in range(cp)])


# --------------------------------------------------------------------------------------------
# Differentiable communication (each backward is the adjoint of its forward)


def _shift(x: torch.Tensor, group, to: int, frm: int) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty_like(x)
    for req in dist.batch_isend_irecv([dist.P2POp(dist.isend, x, to, group), dist.P2POp(dist.irecv, out, frm, group)]):
        req.wait()
    return out


def _gather(x: torch.Tensor, group, n: int) -> torch.Tensor:
    """(n, *x.shape): every rank's x, in rank order."""
    out = x.new_empty((n * x.shape[0], *x.shape[1:]))  # the ranks' tensors one after the other
    dist.all_gather_single(out, x.contiguous(), group=group)
    return out.unflatten(0, (n, x.shape[0]))


def _reduce_scatter(x: torch.Tensor, group) -> torch.Tensor:
    """x (n, ...): part j summed over the ranks, arriving at rank j."""
    out = x.new_empty(x.shape[1:])
    dist.reduce_scatter_single(out, x.flatten(0, 1).contiguous(), group=group)
    return out


class _AllToAll(torch.autograd.Function):
    """x (n, ...): part j goes to rank j, and part j of the result came from rank j. Its own
    adjoint: the gradient takes the same way back."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = torch.empty_like(x.contiguous())
        dist.all_to_all_single(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out = torch.empty_like(grad.contiguous())
        dist.all_to_all_single(out, grad.contiguous(), group=ctx.group)
        return out, None


# --------------------------------------------------------------------------------------------
# Attention of local queries against keys at known positions


def _repeat_kv(t: torch.Tensor, heads: int) -> torch.Tensor:
    """(B, kv_heads, T, D) -> (B, heads, T, D): grouped-query attention's sharing made explicit."""
    return t if t.shape[1] == heads else t.repeat_interleave(heads // t.shape[1], dim=1)


def _scores(q, k, allowed) -> torch.Tensor:
    """(B, H, Tq, Tk) q kᵀ/√d in fp32, a disallowed key's score the lowest float (not -inf: a
    query that sees no key of a block gets a finite log-sum-exp, and weight 0 in the merge)."""
    scores = (q.float() @ k.float().transpose(-2, -1)) / math.sqrt(q.shape[-1])
    return scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)


TILE = 512  # query rows whose scores exist at once: the transient memory is TILE × keys per head


def _fold_kv(d: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """The adjoint of _repeat_kv: (B, heads, T, D) gradients summed into (B, kv_heads, T, D)."""
    return d if d.shape[1] == kv_heads else d.unflatten(1, (kv_heads, -1)).sum(2)


def _block_forward(q, k, v, allowed) -> tuple[torch.Tensor, torch.Tensor]:
    """One K/V block's partial attention in fp32, TILE query rows at a time: (output normalised
    within the block (B, H, Tq, D), its log-sum-exp (B, H, Tq, 1)). k, v have q's heads."""
    outs, lses = [], []
    for i in range(0, q.shape[2], TILE):
        scores = _scores(q[:, :, i:i + TILE], k, allowed[i:i + TILE])  # (B, H, tile, Tk)
        lse = scores.logsumexp(-1, keepdim=True)
        outs.append(torch.exp(scores - lse) @ v.float())
        lses.append(lse)
    return torch.cat(outs, 2), torch.cat(lses, 2)


def _block_backward(q, k, v, allowed, lse, d_out, delta, d_q) -> tuple[torch.Tensor, torch.Tensor]:
    """One K/V block's share of the gradients of the whole attention, from the scores recomputed
    TILE query rows at a time. lse is the log-sum-exp over all keys (so p = exp(s - lse) is the
    block's part of the full softmax) and delta = rowsum(dO ⊙ o) of the full output:
        dv = pᵀ dO,  ds = p ⊙ (dO vᵀ - delta),  dq = ds k / √d,  dk = dsᵀ q / √d.
    Adds dq into d_q (fp32, in place); returns (dk, dv) in fp32 with k's heads (those of q)."""
    scale = 1 / math.sqrt(q.shape[-1])
    kf, vf = k.float(), v.float()
    d_k, d_v = torch.zeros_like(kf), torch.zeros_like(vf)
    for i in range(0, q.shape[2], TILE):
        rows = slice(i, i + TILE)
        p = torch.exp(_scores(q[:, :, rows], k, allowed[rows]) - lse[:, :, rows])  # (B, H, tile, Tk)
        d_v += p.transpose(-2, -1) @ d_out[:, :, rows]
        d_s = p * (d_out[:, :, rows] @ vf.transpose(-2, -1) - delta[:, :, rows])
        d_q[:, :, rows] += (d_s @ kf) * scale
        d_k += (d_s.transpose(-2, -1) @ q[:, :, rows].float()) * scale
    return d_k, d_v


def _merge(out, lse, block_out, block_lse):
    """Two partial attentions over disjoint keys as one: each weighted by its share of the
    softmax denominator, exp(its log-sum-exp - the merged one)."""
    if out is None:
        return block_out, block_lse
    merged = torch.logaddexp(lse, block_lse)
    return out * torch.exp(lse - merged) + block_out * torch.exp(block_lse - merged), merged


def _allowed(seq: int, n: int, rank: int, block: int, device, window: Window | None) -> torch.Tensor:
    """(T_local, T_local) causal mask (within `window`, if any) of cp rank `rank`'s queries against
    cp rank `block`'s keys, at their true positions."""
    return causal_allows(window, chunk_positions(seq, n, rank, device), chunk_positions(seq, n, block, device))


class _RingAttention(torch.autograd.Function):
    """Causal attention of this rank's queries over the whole sequence, the K/V blocks passed
    around the ring. Keeps for backward only this rank's q, k, v, the merged output and its
    log-sum-exp (no other rank's K/V, no per-block output): backward passes the K/V blocks
    around the ring again, recomputes each block's scores, and the block's dK/dV accumulator
    travels with it, one more shift bringing each to its owner."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, group, rank, n, ranks, window):
        ctx.group, ctx.rank, ctx.n, ctx.ranks, ctx.window = group, rank, n, ranks, window
        seq, heads = q.shape[2] * n, q.shape[1]
        kv = torch.stack((k, v))  # one message per shift: (2, B, kv_heads, T_local, D)
        out = lse = None
        for step in range(n):  # at step s this rank holds the block of rank (rank - s) mod n
            if step:
                kv = _shift(kv, group, ranks[(rank + 1) % n], ranks[(rank - 1) % n])
            allowed = _allowed(seq, n, rank, (rank - step) % n, q.device, window)
            if not allowed.any():  # a block the window (or causality) excludes whole: no scores
                continue
            out, lse = _merge(out, lse, *_block_forward(q, _repeat_kv(kv[0], heads), _repeat_kv(kv[1], heads), allowed))
        if sinks is not None:  # once, after every block: the sink is per query, not per block
            out, lse = fold_sink(out, lse, sinks)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, d_out):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        group, rank, n, ranks = ctx.group, ctx.rank, ctx.n, ctx.ranks
        nxt, prev = ranks[(rank + 1) % n], ranks[(rank - 1) % n]
        seq, heads, kv_heads = q.shape[2] * n, q.shape[1], k.shape[1]
        d_out = d_out.float()
        delta = (d_out * out).sum(-1, keepdim=True)  # (B, H, T_local, 1)
        d_q = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = torch.stack((k, v))
        d_kv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)  # the gradient of the block held
        for step in range(n):
            if step:  # the block and its gradient so far move on together
                kv, d_kv = _shift(kv, group, nxt, prev), _shift(d_kv, group, nxt, prev)
            allowed = _allowed(seq, n, rank, (rank - step) % n, q.device, ctx.window)
            if not allowed.any():  # (its gradient passes on unchanged)
                continue
            d_k, d_v = _block_backward(q, _repeat_kv(kv[0], heads), _repeat_kv(kv[1], heads), allowed, lse, d_out,
                                       delta, d_q)
            d_kv[0] += _fold_kv(d_k, kv_heads)
            d_kv[1] += _fold_kv(d_v, kv_heads)
        if n > 1:  # this rank holds rank + 1's block; the previous rank holds this rank's
            d_kv = _shift(d_kv, group, nxt, prev)
        d_sinks = sink_gradient(sinks, lse, delta) if sinks is not None else None
        return d_q.to(q.dtype), d_kv[0].to(k.dtype), d_kv[1].to(v.dtype), d_sinks, None, None, None, None, None


def ring_attention(q, k, v, *, group, rank: int, n: int, ranks: list[int], window: Window | None = None,
                   sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention (within `window`, if any; with the heads' `sinks`, if any) of this rank's
    queries over the whole sequence; (B, H, T_local, D) each (k and v may have fewer heads)."""
    return _RingAttention.apply(q, k, v, sinks, group, rank, n, ranks, window)


class _AllGatherAttention(torch.autograd.Function):
    """Causal attention of this rank's queries over the whole sequence's K/V, gathered from the
    cp ranks. Keeps for backward only this rank's q, k, v, the output and its log-sum-exp:
    backward gathers the K/V again, recomputes the scores, and reduce-scatters dK/dV to their
    owners."""

    @staticmethod
    def _whole(k, v, group, n):
        kv = _gather(torch.stack((k, v)), group, n)  # (n, 2, B, kv_heads, T_local, D)
        return kv.permute(1, 2, 3, 0, 4, 5).flatten(3, 4)  # (2, B, kv_heads, seq, D), the ranks' tokens in rank order

    @staticmethod
    def forward(ctx, q, k, v, sinks, group, rank, n, window):
        ctx.group, ctx.rank, ctx.n, ctx.window = group, rank, n, window
        seq, heads = q.shape[2] * n, q.shape[1]
        kv = _AllGatherAttention._whole(k, v, group, n)
        allowed = causal_allows(window, chunk_positions(seq, n, rank, q.device), all_positions(seq, n, q.device))
        # one block: every key
        out, lse = _block_forward(q, _repeat_kv(kv[0], heads), _repeat_kv(kv[1], heads), allowed)
        if sinks is not None:
            out, lse = fold_sink(out, lse, sinks)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, d_out):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        group, rank, n = ctx.group, ctx.rank, ctx.n
        seq, heads, kv_heads = q.shape[2] * n, q.shape[1], k.shape[1]
        kv = _AllGatherAttention._whole(k, v, group, n)
        allowed = causal_allows(ctx.window, chunk_positions(seq, n, rank, q.device), all_positions(seq, n, q.device))
        d_out = d_out.float()
        d_q = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        delta = (d_out * out).sum(-1, keepdim=True)
        d_k, d_v = _block_backward(q, _repeat_kv(kv[0], heads), _repeat_kv(kv[1], heads), allowed, lse, d_out,
                                   delta, d_q)
        d_kv = torch.stack((_fold_kv(d_k, kv_heads), _fold_kv(d_v, kv_heads)))  # (2, B, kv_heads, seq, D)
        # (n, 2, B, kv_heads, T_local, D): part j is rank j's
        d_kv = d_kv.unflatten(3, (n, -1)).permute(3, 0, 1, 2, 4, 5)
        d_kv = _reduce_scatter(d_kv, group)
        d_sinks = sink_gradient(sinks, lse, delta) if sinks is not None else None
        return d_q.to(q.dtype), d_kv[0].to(k.dtype), d_kv[1].to(v.dtype), d_sinks, None, None, None, None


def allgather_attention(q, k, v, *, group, rank: int, n: int, ranks: list[int], window: Window | None = None,
                        sinks: torch.Tensor | None = None) -> torch.Tensor:
    return _AllGatherAttention.apply(q, k, v, sinks, group, rank, n, window)


def _to_heads(x: torch.Tensor, group, n: int) -> torch.Tensor:
    """(B, H, T_local, D) sequence shard -> (B, H/n, n × T_local, D) head shard (ranks' tokens in rank order)."""
    B, H, T, D = x.shape
    parts = x.reshape(B, n, H // n, T, D).movedim(1, 0)  # part j: the heads rank j takes
    got = _AllToAll.apply(parts, group)  # part j: rank j's tokens of this rank's heads
    return got.movedim(0, 2).reshape(B, H // n, n * T, D)


def _to_sequence(x: torch.Tensor, group, n: int) -> torch.Tensor:
    """The inverse of _to_heads."""
    B, h, S, D = x.shape
    parts = x.reshape(B, h, n, S // n, D).movedim(2, 0)  # part j: rank j's tokens
    got = _AllToAll.apply(parts, group)  # part j: this rank's tokens of rank j's heads
    return got.movedim(0, 1).reshape(B, n * h, S // n, D)


def _sdpa(q, k, v, mask, causal) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                          enable_gqa=q.shape[1] != k.shape[1])


def ulysses_attention(q, k, v, *, group, rank: int, n: int, ranks: list[int], window: Window | None = None,
                      sinks: torch.Tensor | None = None) -> torch.Tensor:
    seq = q.shape[2] * n
    if k.shape[1] % n:  # fewer K/V heads than cp ranks (or not a multiple): each query head gets its own copy
        k, v = _repeat_kv(k, q.shape[1]), _repeat_kv(v, q.shape[1])
    # the whole sequence for heads/cp of the heads, put in true order: plain causal attention (in
    # the window's tiles, if any: the one-process kernel)
    order = all_positions(seq, n, q.device).argsort()  # token at true position t: order[t]
    q, k, v = (_to_heads(t, group, n).index_select(2, order) for t in (q, k, v))
    kernel = _sdpa if sinks is None else partial(_sink_kernel, sinks.view(n, -1)[rank])  # this rank's heads' sinks
    y = kernel(q, k, v, None, True) if window is None else local_attention(q, k, v, window, None, kernel)
    return _to_sequence(y.index_select(2, order.argsort()), group, n)


def _sink_kernel(sinks, q, k, v, mask, causal) -> torch.Tensor:
    return sink_attention(q, k, v, sinks, mask, causal)


METHODS = {"ring": ring_attention, "allgather": allgather_attention, "ulysses": ulysses_attention}
assert tuple(METHODS) == CP_METHODS


def _attend(method, owner: nn.Module, q, k, v, mask, causal, **where):
    if mask is not None or not causal:  # generation with a cache: the trainer never samples under cp
        raise RuntimeError("context-parallel attention is causal attention over a whole sequence (no cache)")
    # (where: the group, this rank, and the block's window; the sinks asked for now, as data
    # parallelism may have swapped the parameter since)
    sinks = owner.sink_logits() if getattr(owner, "sinks", None) is not None else None  # (latent attention: none)
    return method(q, k, v, sinks=sinks, **where)


def _attend_narrow_values(method, owner: nn.Module, q, k, v, mask, causal, factor: float = 1.0, **where):
    """Latent attention (model/mla.py), whose values are narrower than its queries and keys: the
    values padded with zeros to the keys' width (the methods send K and V as one tensor), the
    output's extra columns (zeros) cut off. Costs the padding's share of V's bytes more. Its
    softmax scale, `factor` times the methods' 1/√head_dim (YaRN's mscale²), goes into q."""
    width = v.shape[-1]
    v = F.pad(v, (0, k.shape[-1] - width))
    if factor != 1.0:
        q = q * factor
    return _attend(method, owner, q, k, v, mask, causal, **where)[..., :width]


# --------------------------------------------------------------------------------------------
# Applying it


def apply_context_parallel(model: nn.Module, cp_mesh, method: str, seq_len: int) -> None:
    """Make `model` (a whole Transformer or a pipeline chunk, materialized) compute on this cp
    rank's chunks of sequences of `seq_len` tokens, in place."""
    if method not in METHODS:
        raise unknown("context-parallel method", method, CP_METHODS)
    group, n, rank = cp_mesh.get_group(), cp_mesh.size(), cp_mesh.get_local_rank()
    where = {"group": group, "rank": rank, "n": n, "ranks": [dist.get_global_rank(group, r) for r in range(n)]}
    for module in model.modules():  # (blocks may be wrapped for activation checkpointing)
        if isinstance(module, Attention):
            module.attend = partial(_attend, METHODS[method], module, window=module.window, **where)
        if isinstance(module, LatentAttention):  # its scale over the methods' 1/√head_dim: YaRN's mscale²
            module.attend = partial(_attend_narrow_values, METHODS[method], module, window=module.window,
                                    factor=module.scale * math.sqrt(module.head_dim), **where)
        if isinstance(module, MoE):  # the Switch loss's counts are those of whole sequences
            module.sequence_counts = partial(summed_over, previous=module.sequence_counts, group=group)
    device = next(iter(model.buffers()), torch.empty(0)).device
    positions = chunk_positions(seq_len, n, rank, device)
    if getattr(model, "rope_cos", None) is not None:
        # row t of the tables is the angle of the rank's t-th token: its true position
        model.rope_cos, model.rope_sin = model.rope_cos[positions], model.rope_sin[positions]
    if getattr(model, "rope_local_cos", None) is not None:  # (Gemma 3's sliding-window blocks)
        model.rope_local_cos, model.rope_local_sin = model.rope_local_cos[positions], model.rope_local_sin[positions]
    if getattr(model, "attn_temp", None) is not None:  # (Llama 4's no-rope blocks: a query factor per position)
        model.attn_temp = model.attn_temp[positions]
    if getattr(model, "pos_emb", None) is not None:
        model.pos_emb.register_forward_pre_hook(lambda module, args: (positions.to(args[0].device)[args[0]],))


def shard_batch(batch: tuple, cp: int, rank: int) -> tuple:
    """This cp rank's tokens of a batch's (inputs, targets): cut in the data loader, as the
    sampler cuts each data-parallel rank's sequences. What follows them (a preference batch's
    example ids) is per sequence: passed on whole."""
    inputs, targets, *rest = batch
    return (shard_sequence(inputs, cp, rank), shard_sequence(targets, cp, rank), *rest)


class ContextParallelStep(StepHook):
    """The cp ranks' shares of the same batch: each rank reads its chunks of every sequence, and
    their gradients are summed (the loss is over all tokens of the batch). Experts split by
    expert parallelism (`exclude`, ids) are not copies over cp: their own engine averages them."""

    phase = "the context-parallel gradient all-reduce"

    def __init__(self, cp_mesh, exclude: frozenset[int] = frozenset()):
        self.group, self.exclude = cp_mesh.get_group(), exclude
        self.batch_share = partial(shard_batch, cp=cp_mesh.size(), rank=cp_mesh.get_local_rank())

    def reduce_gradients(self, named) -> None:
        sum_gradients([p for _, p in named if id(p) not in self.exclude], self.group)
