"""Properties of the mixture-of-experts layer's capacity and dispatch (model/moe.py) for generated
shapes: token counts, experts, top_k and capacity factors whose products do not divide, experts
no token chooses, every token on one expert. The layer's routing is given (its `route` replaced
on the instance by generated choices and weights), so what is under test is what follows it:
the capacity, which slots each expert keeps, the weighted sum back per token and the load counts,
each against a plain loop over the tokens in numpy (float64)."""

from __future__ import annotations

import math

import numpy as np
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from scaletrain.model.config import ModelConfig
from scaletrain.model.moe import MoE

D = H = 8  # model and expert width: fp32 rows of 32 bytes, so the grouped matmul path runs


@st.composite
def routings(draw):
    """(tokens B x T, experts, top_k, capacity factor in hundredths (0 = dropless), each token's
    choices in the router's order, a seed for the weights and inputs)."""
    experts = draw(st.integers(1, 6))
    top_k = draw(st.integers(1, experts))
    B, T = draw(st.integers(1, 3)), draw(st.integers(1, 9))
    # a favourite expert that about half the tokens put first: capacities then drop
    favourite = draw(st.integers(0, experts - 1))
    chosen = []
    for _ in range(B * T):
        order = draw(st.permutations(range(experts)))
        if draw(st.booleans()):
            order = [favourite] + [e for e in order if e != favourite]
        chosen.append(list(order[:top_k]))
    hundredths = draw(st.sampled_from([0]) | st.integers(1, 300))
    return B, T, experts, top_k, hundredths, chosen, draw(st.integers(0, 2**16))


def gelu_tanh(h: np.ndarray) -> np.ndarray:
    return 0.5 * h * (1 + np.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h ** 3)))


def by_hand(x, chosen, weights, w1, w2, capacity):
    """The layer's output and load written token by token: the slots in order (token i's j-th
    choice, i then j), each expert keeping the first `capacity` that reach it (None: all)."""
    out = np.zeros_like(x)
    reached = np.zeros(w1.shape[0], dtype=np.int64)
    for i, experts in enumerate(chosen):
        for j, e in enumerate(experts):
            reached[e] += 1
            if capacity is not None and reached[e] > capacity:
                continue  # dropped: the token gets nothing from this expert
            out[i] += weights[i, j] * (w2[e] @ gelu_tanh(w1[e] @ x[i]))
    dropped = 0 if capacity is None else int(np.maximum(reached - capacity, 0).sum())
    return out, reached, dropped


@given(routings())
# moe_capacity_factor=1.1 over 50 slots and 5 experts: an even share of 10, so a capacity of 11; the layer
# computed 1.1 * 50 / 5 in floats (11.000000000000002) and kept 12
@example((2, 25, 5, 1, 110, [[i % 5] for i in range(25)] + [[0]] * 25, 0))
def test_each_expert_keeps_its_first_capacity_slots_and_counts_every_choice(case):
    B, T, E, k, hundredths, chosen, seed = case
    n = B * T
    cfg = ModelConfig(dim=D, n_layers=1, n_heads=2, moe_experts=E, moe_hidden=H, moe_top_k=k,
                      moe_capacity_factor=hundredths / 100)
    m = MoE(cfg).train()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    m.reset_state()
    weights = torch.rand(n, k, generator=g) + 0.1
    given_choice = torch.tensor(chosen, dtype=torch.long).view(n, k)
    m.route = lambda flat: (torch.zeros(len(flat), E), given_choice, weights)
    x = torch.randn(B, T, D, generator=g)

    # the capacity by hand: ceil(factor * slots / experts), the factor a decimal, in integers
    capacity = -(-hundredths * n * k // (100 * E)) if hundredths else None
    want, reached, dropped = by_hand(x.view(n, D).double().numpy(), chosen, weights.double().numpy(),
                                     m.w1.detach().double().numpy(), m.w2.detach().double().numpy(), capacity)
    got = m(x)  # a training forward: it counts the load
    np.testing.assert_allclose(got.detach().view(n, D).double().numpy(), want, rtol=1e-5, atol=1e-5)
    assert m.stats[:E].tolist() == reached.tolist()  # every choice, kept or dropped
    assert m.stats[E].item() == dropped
    if capacity is not None:
        assert dropped == sum(max(c - capacity, 0) for c in np.bincount(np.ravel(chosen), minlength=E))
