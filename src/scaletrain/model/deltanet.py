"""Gated DeltaNet linear attention (Yang, Kautz and Hatamizadeh 2024; Qwen3-Next's linear-attention
blocks), in plain PyTorch: model.linear_heads > 0, in every block but each model.full_every-th.

Each value head keeps a state S, a (key_dim x value_dim) matrix, in place of a key/value cache.
At each position t, with the query and key of its key head (L2-normalised, the query also
divided by sqrt(key_dim)):

    S  <-  exp(g_t) · S                                  the decay, first
    S  <-  S + k_t (beta_t · (v_t - Sᵀ k_t))ᵀ             the delta rule: write what S mispredicts
    o_t =  Sᵀ q_t

with beta_t = sigmoid(b_t) and the decay g_t = -exp(A_log) · softplus(a_t + dt_bias) <= 0 (b and
a are per value head, projected from the token). Before that, the queries, keys and values pass a
short causal depthwise convolution (model.linear_conv taps, then SiLU); after it, each head's
output is RMS-normalised, scaled by a weight shared by all heads and gated by SiLU(z), z another
projection of the token, before the output projection.

    x ─ in_qkvz ─ per key head [q | k | v (ratio heads) | z (ratio heads)]
    x ─ in_ba   ─ per key head [b (ratio) | a (ratio)]
    [q | k | v] ─ causal conv (+ SiLU) ─ L2 q, k ─ gated delta rule ─ z_norm(·, z) ─ out ─> dim

The projections keep the Hugging Face checkpoint's rows (grouped by key head), so a contiguous
share of the rows is whole key heads with their value heads: tensor parallelism splits in_qkvz
and in_ba column-wise and out row-wise. The convolution's channels are kept in the same
per-key-head order (the import reorders Hugging Face's [all q | all k | all v]); the per-head
parameters (the convolution, A_log, dt_bias) and the shared norm weight are read through `own`
and `whole`, which tensor parallelism replaces on the instance with the rank's rows (gradients
summed over its ranks).

Two forms of the same rule: `chunked_delta_rule` (training and prompts: chunks of
model.linear_chunk positions, inside each a triangular solve instead of a loop; any length, the
last chunk shorter) and `recurrent_delta_rule` (generation: one position at a time). Generation
keeps, per block, the convolution's last (taps - 1) inputs and the state S (scaletrain.model.
kv_cache): a fixed size whatever the context. Costs: the state is heads x key_dim x value_dim per
sequence; the chunked form's FLOPs grow as T x chunk, not T².

Context parallelism would have to pass the state from rank to rank in sequence; it is refused
(scaletrain.legality), as are packed documents' masks (the state would carry across documents).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from scaletrain.model.config import ModelConfig
from scaletrain.model.kv_cache import KVCache

L2_EPS = 1e-6  # the queries' and keys' L2 norm (FLA's and transformers' epsilon)


class GatedRMSNorm(nn.Module):
    """RMSNorm of each head's output (a weight of head width shared by all heads, starting at ones),
    times SiLU of the gate z."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        y = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x)
        return (weight * y * F.silu(z.float())).type_as(x)


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.window = None  # (what context parallelism and the cache ask of an attention)
        hk, hv = cfg.linear_heads, cfg.linear_v_heads
        self.dk, self.dv, self.ratio = cfg.linear_head_dim, cfg.linear_v_dim, hv // hk
        self.taps, self.chunk = cfg.linear_conv, cfg.linear_chunk
        group = 2 * self.dk + 2 * self.ratio * self.dv  # a key head's rows of in_qkvz
        self.in_qkvz = nn.Linear(cfg.dim, hk * group, bias=False)
        self.in_ba = nn.Linear(cfg.dim, 2 * hv, bias=False)
        # (channels, 1, taps): the depthwise convolution of [q | k | v], channels grouped by key head
        self.conv = nn.Parameter(torch.empty(hk * (2 * self.dk + self.ratio * self.dv), 1, self.taps))
        self.A_log = nn.Parameter(torch.empty(hv))
        self.dt_bias = nn.Parameter(torch.empty(hv))
        self.z_norm = GatedRMSNorm(self.dv, cfg.norm_eps)
        self.out = nn.Linear(hv * self.dv, cfg.dim, bias=False)

    def own(self, t: torch.Tensor) -> torch.Tensor:
        """A per-head parameter (rows grouped by key head) as this module's heads use it: all of it.
        Tensor parallelism replaces this with the rank's share of the rows."""
        return t

    def whole(self, t: torch.Tensor) -> torch.Tensor:
        """A parameter every head shares (the norm's weight), as it is; tensor parallelism replaces
        this with one whose gradient is summed over its ranks."""
        return t

    def forward(self, x: torch.Tensor, rope=None, cache: tuple[KVCache, str] | None = None, *,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """As Attention.forward (`rope` unused: no positions but the order); `cache` holds the
        block's convolution inputs and state after the positions before x's."""
        if mask is not None:
            raise ValueError("linear attention carries its state across documents; packed document masks are "
                             "refused with model.linear_heads")
        B, T, _ = x.shape
        dk, dv, r = self.dk, self.dv, self.ratio
        # -1: under tensor parallelism the rank's own key heads
        q, k, v, z = self.in_qkvz(x).view(B, T, -1, 2 * dk + 2 * r * dv).split([dk, dk, r * dv, r * dv], dim=-1)
        b, a = self.in_ba(x).view(B, T, -1, 2 * r).split([r, r], dim=-1)
        state = cache[0].linear_state(cache[1]) if cache is not None else None
        mixed, conv_state = self.convolve(torch.cat((q, k, v), dim=-1).flatten(2), state)
        q, k, v = mixed.view(B, T, -1, 2 * dk + r * dv).split([dk, dk, r * dv], dim=-1)
        v, z = v.reshape(B, T, -1, dv), z.reshape(B, T, -1, dv)  # (B, T, value heads, dv)
        beta = torch.sigmoid(b.reshape(B, T, -1)).float()  # (B, T, value heads)
        g = -self.own(self.A_log).float().exp() * F.softplus(a.reshape(B, T, -1).float() + self.own(self.dt_bias))
        q, k = (_l2(t).repeat_interleave(r, dim=2) for t in (q, k))  # each key head serves r value heads
        q = q * dk ** -0.5
        if cache is None:
            y, _ = chunked_delta_rule(q, k, v.float(), g, beta, None, self.chunk)
        else:  # a prompt in chunks, each new token by the recurrence, from the state kept
            before = state[1] if state is not None else None
            y, s = (recurrent_delta_rule(q, k, v.float(), g, beta, before) if T == 1 else
                    chunked_delta_rule(q, k, v.float(), g, beta, before, self.chunk))
            cache[0].keep_linear_state(cache[1], conv_state, s)
        y = self.z_norm(y.to(x.dtype), z, self.whole(self.z_norm.weight))
        return self.out(y.flatten(2))

    def convolve(self, x: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor] | None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """x (B, T, channels) through the causal depthwise convolution and SiLU; the inputs before
        the first position are the cached ones (`state`'s first), zeros without. Returns the output
        and the last (taps - 1) inputs, for the next position."""
        x = x.transpose(1, 2)  # (B, channels, T)
        before = state[0] if state is not None else x.new_zeros(*x.shape[:2], self.taps - 1)
        whole = torch.cat((before.to(x.dtype), x), dim=-1)
        weight = self.own(self.conv)
        y = F.silu(F.conv1d(whole, weight.to(x.dtype), groups=weight.shape[0]))
        return y.transpose(1, 2), whole[..., whole.shape[-1] - (self.taps - 1):]


def _l2(x: torch.Tensor) -> torch.Tensor:
    """x over its L2 norm along the last dim, in fp32."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + L2_EPS)


def recurrent_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                         state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule a position at a time: q, k (B, T, H, dk), v (B, T, H, dv), g and beta
    (B, T, H), state (B, H, dk, dv) or None (zeros). Returns the outputs (B, T, H, dv) and the state."""
    B, T, H, dk = k.shape
    s = state if state is not None else v.new_zeros(B, H, dk, v.shape[-1])
    out = []
    for t in range(T):
        s = s * g[:, t].exp()[..., None, None]  # decay before the update
        predicted = torch.einsum("bhkv,bhk->bhv", s, k[:, t])
        write = beta[:, t, :, None] * (v[:, t] - predicted)  # (B, H, dv)
        s = s + k[:, t, :, :, None] * write[:, :, None, :]
        out.append(torch.einsum("bhkv,bhk->bhv", s, q[:, t]))
    return torch.stack(out, dim=1), s


def chunked_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       state: torch.Tensor | None, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same rule over chunks of `chunk` positions (the last may be shorter). Within a chunk,
    with G_i the cumulative log-decay from its start and S0 the state before it, unrolling the
    recurrence gives the writes U (rows u_i = beta_i (v_i - ...)) as a lower-triangular system,

        (I + A) U = beta·V - (beta·exp(G)·K) S0,   A_ij = beta_i exp(G_i - G_j) k_i·k_j   (j < i)

    then o_i = exp(G_i) q_i S0 + sum_{j<=i} exp(G_i - G_j) (q_i·k_j) u_j, and the state after it
    exp(G_last) S0 + sum_j exp(G_last - G_j) k_j u_jᵀ. Same arguments and results as the recurrent form."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, T, d)
    g, beta = g.transpose(1, 2), beta.transpose(1, 2)  # (B, H, T)
    B, H, T, dk = k.shape
    s = state if state is not None else v.new_zeros(B, H, dk, v.shape[-1])
    out = []
    for start in range(0, T, chunk):
        qc, kc, vc = (t[:, :, start:start + chunk] for t in (q, k, v))
        bc, G = beta[:, :, start:start + chunk, None], g[:, :, start:start + chunk].cumsum(-1)
        c = G.shape[-1]
        seen = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()  # j <= i
        decay = (G[..., :, None] - G[..., None, :]).masked_fill(~seen, float("-inf")).exp()  # exp(G_i - G_j)
        system = torch.eye(c, device=q.device) + ((kc * bc) @ kc.transpose(-1, -2) * decay).tril(-1)
        rhs = torch.cat((vc * bc, kc * bc * G.exp()[..., None]), dim=-1)
        solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
        u = solved[..., :vc.shape[-1]] - solved[..., vc.shape[-1]:] @ s  # (B, H, c, dv)
        out.append((qc * G.exp()[..., None]) @ s + (qc @ kc.transpose(-1, -2) * decay) @ u)
        last = G[..., -1:]
        s = s * last.exp()[..., None] + (kc * (last - G).exp()[..., None]).transpose(-1, -2) @ u
    return torch.cat(out, dim=2).transpose(1, 2), s
