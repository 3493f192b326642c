"""Muon (Jordan et al. 2024; Liu et al. 2025, "Muon is Scalable for LLM Training"): momentum
orthogonalised by Newton-Schulz iterations, for the hidden matrices; AdamW for the rest.

Per step, for each hidden matrix W (A x B) with gradient G and momentum buffer M (as torch.optim.Muon):

    M <- mu M + (1 - mu) G                    (lerp)
    U <- (1 - mu) G + mu M  (Nesterov) or M
    O <- NS(U): U / |U|_F, then ns_steps of X <- aX + b(XX')X + c(XX')^2 X  (X' X when A > B)
    W <- W (1 - lr wd) - lr adj(A, B) O       adj = 0.2 sqrt(max(A, B)) (match_rms_adamw) | sqrt(max(1, A/B))

What it keeps: one fp32 buffer per matrix value (4 bytes; AdamW keeps 8), sharded like the parameter.
What it costs: Newton-Schulz's FLOPs, about ns_steps x (4 m^2 n + 2 m^3) per m x n matrix (m the shorter
side); and where a matrix is sharded, its pieces gathered to an owner and the result sent back
(optim/whole.py: what each layout moves). Which parameters it takes: every matrix of 2 or more
dimensions but the embeddings and the output head (AUTO_EXCLUDE), an expert tensor (E, A, B) as E
matrices; optim.muon.params and optim.muon.exclude change that by name. Query, key and value are
separate matrices here (wq, wk, wv), as in the Hugging Face Llama layout: each is orthogonalised apart.
"""

from __future__ import annotations

import fnmatch
import math

import torch
from torch.distributed.tensor import DTensor

from scaletrain.config import MuonConfig, ns_coefficients
from scaletrain.errors import ConfigError
from scaletrain.optim.whole import WholeMatrices

# the embeddings and the output head (scaletrain's names, and the usual ones of a custom module)
AUTO_EXCLUDE = ("tok_emb.*", "pos_emb.*", "output.*", "*embed*", "*lm_head*")
NS_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def newton_schulz(g: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float,
                  dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The orthogonalised (A, B) matrix g, in `dtype`: g over its Frobenius norm, then `steps` quintic
    iterations on the wide orientation (the Gram matrix is the smaller side's)."""
    if g.ndim != 2:
        raise ValueError(f"Newton-Schulz takes a matrix, got shape {tuple(g.shape)}")
    a, b, c = coefficients
    x = g.to(dtype, copy=True)
    tall = g.size(0) > g.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=eps))  # singular values now in [0, 1]
    for _ in range(steps):
        gram = x @ x.T  # (m, m), m the shorter side
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)  # b XX' + c (XX')^2
        x = torch.addmm(x, poly, x, beta=a)  # a X + poly X
    return x.T if tall else x


def adjusted_lr(lr: float, how: str, shape: torch.Size) -> float:
    """The learning rate of a matrix of `shape` (its last two dimensions: the whole matrix's, not a shard's)."""
    rows, cols = shape[-2], shape[-1]
    if how == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    if how == "original":
        return lr * math.sqrt(max(1.0, rows / cols))
    if how == "none":
        return lr
    raise ValueError(f"unknown optim.muon.adjust_lr {how!r}")


def _patterns(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def muon_split(named: list[tuple[str, torch.Tensor]], m: MuonConfig) -> tuple[list, list]:
    """(Muon's (name, param) pairs, the others'), in `named`'s order. A pattern of optim.muon.params
    that matches nothing, or that gives Muon a vector, is a ConfigError."""
    chosen = _patterns(m.params) if m.params != "auto" else None
    excluded = _patterns(m.exclude)
    problems = [f"optim.muon.params: {pat!r} matches no trainable parameter (names are as "
                f"{named[0][0] if named else '...'})" for pat in chosen or ()
                if not any(fnmatch.fnmatchcase(n, pat) for n, _ in named)]
    muon, rest = [], []
    for name, p in named:
        if chosen is None:
            take = p.ndim >= 2 and not any(fnmatch.fnmatchcase(name, pat) for pat in AUTO_EXCLUDE)
        else:
            take = any(fnmatch.fnmatchcase(name, pat) for pat in chosen)
        take = take and not any(fnmatch.fnmatchcase(name, pat) for pat in excluded)
        (muon if take else rest).append((name, p))
    if vectors := [(n, tuple(p.shape)) for n, p in muon if p.ndim < 2]:
        more = f" and {len(vectors) - 1} more" if len(vectors) > 1 else ""
        problems.append(f"optim.muon.params: {vectors[0][0]} has shape {vectors[0][1]}{more}; Muon orthogonalises "
                        "matrices: leave vectors to AdamW (narrow the pattern, or add them to optim.muon.exclude)")
    if problems:
        raise ConfigError(*problems)
    return muon, rest


def describe_split(muon: list, rest: list) -> str:
    """One line for the start of the run: how many parameters (and values) each optimizer steps."""
    def count(ps):
        return sum(p.numel() for _, p in ps)

    total = count(muon) + count(rest) or 1
    return (f"optim: Muon steps {len(muon)} matrices ({count(muon):,} values, {100 * count(muon) / total:.1f}%), "
            f"AdamW {len(rest)} other parameters ({count(rest):,}, {100 * count(rest) / total:.1f}%)")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class Muon(torch.optim.Optimizer):
    """Muon over the hidden matrices (plain or sharded as DTensors: see optim/whole.py), and a
    `fallback` optimizer (AdamW) over the rest, as one optimizer: one state, one list of groups
    (the fallback's groups are the same dicts, so set_lr and checkpoints see every parameter)."""

    note = ""  # one line for the start of a run: which parameters which optimizer steps (describe_split)

    def __init__(self, params: list[torch.Tensor], fallback: torch.optim.Optimizer | None, *, lr: float,
                 cfg: MuonConfig, weight_decay: float, lr_ratio: float = 1.0):
        super().__init__([{"params": params, "muon": True}],
                         {"lr": lr, "lr_ratio": lr_ratio, "weight_decay": weight_decay, "momentum": cfg.momentum,
                          "nesterov": cfg.nesterov, "ns_coefficients": ns_coefficients(cfg),
                          "ns_steps": cfg.ns_steps, "eps": cfg.eps, "adjust_lr": cfg.adjust_lr})
        self.ns_dtype = NS_DTYPES[cfg.ns_dtype]
        self.whole = WholeMatrices(list(params), self.ns_dtype)  # collective: every rank builds it at once
        self.fallback = fallback
        if fallback is not None:
            fallback.state = self.state  # one state: keyed by parameter, the two sets apart
            self.param_groups.extend(fallback.param_groups)

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            if group.get("muon"):
                self._muon_step(group)
        if self.fallback is not None:
            self.fallback.step()

    def _muon_step(self, group: dict) -> None:
        params = group["params"]
        momentum, lr = group["momentum"], group["lr"] * group["lr_ratio"]
        updates = []
        for p in params:
            state = self.state[p]
            if "momentum_buffer" not in state:  # sharded like the parameter
                state["momentum_buffer"] = torch.zeros_like(p)
            buf = _local(state["momentum_buffer"])
            if p.grad is None:  # it still takes part in the exchange (every rank sends alike), with zeros
                updates.append(torch.zeros_like(buf))
                continue
            grad = _local(p.grad)
            buf.lerp_(grad, 1 - momentum)
            updates.append(grad.lerp(buf, momentum) if group["nesterov"] else buf)

        def orthogonalize(m: torch.Tensor) -> torch.Tensor:
            return newton_schulz(m, group["ns_coefficients"], group["ns_steps"], group["eps"], self.ns_dtype)

        for p, o in zip(params, self.whole.apply(updates, orthogonalize, params), strict=True):
            if p.grad is None:
                continue
            local = _local(p)
            local.mul_(1 - lr * group["weight_decay"])
            local.add_(o, alpha=-adjusted_lr(lr, group["adjust_lr"], p.shape))
