"""Local SGD / DiLoCo at the points where a bug hides (parallel/local_sgd.py, replica_average.py).

The average over the workers is checked against the plain mean computed here, never through
`reference_average`'s own encoding: with chunks whose magnitudes differ by up to 10^6, each
chunk's error bounded by its own int8 scale, and with values that int8 carries exactly, equal to
the mean bit for bit. The distributed path (`ReplicaAverage.average`: all-to-all, the receiver's
sum and scales, all-gather) runs over real gloo process groups, one per worker, on threads of
this process. Every outer optimizer is held to steps worked out by hand, momentum ≠ 0.
"""

from __future__ import annotations

import threading
from datetime import timedelta

import numpy as np
import pytest
import torch
import torch.distributed as dist

from scaletrain.parallel.local_sgd import OuterSync
from scaletrain.parallel.replica_average import CHUNK, ReplicaAverage, SimulatedWorkers, reference_average
from test_local_sgd import _step

# ------------------------------------------------------------------------------------------
# The average over the workers


def wire_average(buffers: list[torch.Tensor], dtype: str) -> list[torch.Tensor]:
    """What each worker gets from `ReplicaAverage.average` when worker w holds buffers[w]: one
    gloo process group per worker (a store shared in memory), each worker on its own thread."""
    workers, store = len(buffers), dist.HashStore()
    out: list[torch.Tensor | None] = [None] * workers
    errors: list[BaseException] = []

    def worker(rank: int) -> None:
        try:
            prefixed = dist.PrefixStore("average", store)
            gloo = dist.ProcessGroupGloo(prefixed, rank, workers, timedelta(seconds=60))
            group = dist.ProcessGroup(prefixed, rank, workers)
            group._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
            group._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, gloo)
            out[rank] = ReplicaAverage(group, workers, dtype).average(buffers[rank].clone(), group)
        except BaseException as e:  # re-raised in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    if errors:
        raise errors[0]
    assert all(o is not None for o in out), "a worker did not finish"
    return out


def magnitudes(n_chunks: int, worker: int) -> np.ndarray:
    """A magnitude per chunk from 1e-4 to 1e4: 10^-3 .. 10^3 by chunk, in a scrambled order (the
    scales a worker sends for a segment are not those it receives), times 10^-1, 1 or 10 by worker."""
    return 10.0 ** ((np.arange(n_chunks) * 5) % 7 - 3 + worker % 3 - 1)


def per_chunk_bound_report(got: torch.Tensor, buffers: list[torch.Tensor]) -> tuple[float, str]:
    """The worst chunk's error against the exact mean, over its own int8 bound: half a step of
    each worker's scale for that chunk (on the way there), averaged, plus half a step of the
    mean's scale (on the way back), plus fp32 rounding. Returns (worst ratio, a line saying
    where)."""
    x = torch.stack([b.double() for b in buffers])
    workers, n = x.shape
    mean = x.mean(0)
    worst, where = 0.0, ""
    for c in range(-(-n // CHUNK)):
        sl = slice(c * CHUNK, min(n, (c + 1) * CHUNK))
        there = (x[:, sl].abs().amax(1) / 127 / 2).sum().item() / workers
        back = (mean[sl].abs().max().item() + there) / 127 / 2
        bound = there + back + 1e-6 * mean[sl].abs().max().item()
        err = (got[sl].double() - mean[sl]).abs().max().item()
        if err / bound > worst:
            worst, where = err / bound, f"chunk {c}: error {err:.3e} = {err / bound:.3g}x tolerance {bound:.3e}"
    return worst, where


def test_int8_chunks_of_very_different_magnitudes_each_within_their_own_scale():
    """3 workers, 10 chunks of magnitudes 1e-3 .. 1e3 (the last one partial, the segments padded):
    the wire's average and the simulation's are the same bits, and each chunk is within its own
    scale's rounding of the exact mean, so a chunk of 1e-3 beside one of 1e3 is not rounded away."""
    workers, n = 3, 9 * CHUNK + 100
    g = torch.Generator().manual_seed(3)
    chunks = -(-n // CHUNK)
    buffers = []
    for w in range(workers):
        scale = torch.from_numpy(np.repeat(magnitudes(chunks, w), CHUNK)[:n]).float()
        buffers.append(torch.randn(n, generator=g) * scale)
    simulated = reference_average(buffers, "int8")
    for w, got in enumerate([*wire_average(buffers, "int8"), simulated]):
        worst, where = per_chunk_bound_report(got, buffers)
        assert worst <= 1.0, f"{f'worker {w}' if w < workers else 'simulation'}: {where}"
        assert torch.equal(got, simulated), f"worker {w}: the wire and the simulation differ"
    # the bound is a chunk's own, not the tensor's: the small chunks are that much finer
    mean = torch.stack(buffers).double().mean(0)
    small = [c for c in range(chunks - 1) if max(magnitudes(chunks, w)[c] for w in range(workers)) <= 1e-2]
    assert small, "no small chunk"
    for c in small:
        sl = slice(c * CHUNK, (c + 1) * CHUNK)
        assert (simulated[sl].double() - mean[sl]).abs().max() < 1e-4, c  # the tensor's bound would be ~10


def exact_buffers(workers: int, n: int, seed: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Buffers whose int8 average is exact: in chunk c every worker holds integers of [-127, 127]
    times 2^e_c (e_c from -20 to 10), the largest 127, and their mean is such integers too (the
    workers differ from it by offsets that sum to 0 and keep every value in range)."""
    rng = np.random.default_rng(seed)
    chunks = -(-n // CHUNK)
    m = rng.integers(-60, 61, size=chunks * CHUNK)
    m[::CHUNK] = 127  # each chunk's largest value, in the mean and in every worker
    d = rng.integers(-20, 21, size=(workers - 1, chunks * CHUNK))
    d = np.concatenate([d, -d.sum(0, keepdims=True)])  # the offsets sum to 0
    d[:, ::CHUNK] = 0
    exponent = np.repeat((np.arange(chunks) * 7) % 31 - 20, CHUNK)
    assert np.abs(m[None] + d).max() == 127  # every worker's values: integers of [-127, 127] times 2^e_c
    values = [torch.from_numpy(np.ldexp((m + d[w]).astype(np.float64), exponent)[:n]).float() for w in range(workers)]
    mean = torch.from_numpy(np.ldexp(m.astype(np.float64), exponent)[:n]).float()
    return values, mean


@pytest.mark.parametrize("dtype", ["fp32", "int8"])
def test_the_average_is_the_mean_bit_for_bit_where_the_format_carries_it(dtype):
    """4 workers, chunks 2^-20 .. 2^10 apart: every value a multiple of its chunk's scale, so the
    average is the exact mean on every worker. A scale off by any factor on the receiving side,
    or a mean over the wrong number of workers, changes it."""
    workers, n = 4, 8 * CHUNK - 5
    buffers, mean = exact_buffers(workers, n, seed=1)
    assert (buffers[0] - mean).abs().max() > 0  # the workers differ
    got = wire_average(buffers, dtype)
    simulated = reference_average(buffers, dtype)
    for w, values in enumerate([simulated, *got]):
        wrong = (values != mean).sum().item()
        assert wrong == 0, f"{'simulation' if w == 0 else f'worker {w - 1}'}: {wrong} values differ from the mean"


# ------------------------------------------------------------------------------------------
# The outer optimizers, step by step


def one_worker_outer(mode: str, **outer) -> tuple[torch.nn.Parameter, OuterSync]:
    """One worker (the mean of one is its own pseudo-gradient) that syncs after every step."""
    p = torch.nn.Parameter(torch.zeros(2))
    return p, OuterSync([("layers.0.w", p)], mode=mode, sync_every=1, fragments=1, delay=0, n_blocks=1,
                        comm=SimulatedWorkers(1, "fp32").member(0), **outer)


# pseudo-gradients Δ_k of the rounds (the worker steps by −Δ_k from the outer weights); outer lr
# 0.5 and momentum 0.75, every figure exact in binary floating point
DELTAS = [4.0, -2.0, 8.0, 1.0]
BY_HAND = {
    # buf_k = 0.75 buf_{k-1} + Δ_k = 4, 1, 8.75, 7.5625; update Δ_k + 0.75 buf_k = 7, -1.25, 14.5625, 6.671875
    ("diloco", "nesterov", 0.75): [-3.5, -2.875, -10.15625, -13.4921875],
    # the same buffers, the update buf_k itself
    ("diloco", "sgd", 0.75): [-2.0, -2.5, -6.875, -10.65625],
    # no momentum: θ_k = θ_{k-1} − 0.5 Δ_k, whichever optimizer is named
    ("diloco", "sgd", 0.0): [-2.0, -1.0, -5.0, -5.5],
    ("diloco", "nesterov", 0.0): [-2.0, -1.0, -5.0, -5.5],
    # local SGD: the outer weights become the (one) worker's weights, whatever lr and momentum say
    ("local_sgd", "nesterov", 0.75): [-4.0, -2.0, -10.0, -11.0],
}


@pytest.mark.parametrize("mode,optimizer,momentum", list(BY_HAND), ids=["-".join(map(str, k)) for k in BY_HAND])
def test_every_outer_optimizer_takes_the_steps_worked_out_by_hand(mode, optimizer, momentum):
    p, sync = one_worker_outer(mode, outer_optimizer=optimizer, outer_lr=0.5, outer_momentum=momentum)
    got = []
    for delta in DELTAS:
        with torch.no_grad():
            p.sub_(delta)
        assert sync.after_step()
        got.append(p[0].item())
        assert p[1].item() == got[-1] and sync.params[0].outer[0].item() == got[-1]
    assert got == BY_HAND[mode, optimizer, momentum]


def test_two_workers_step_on_their_mean_and_a_delayed_sync_adds_what_each_learnt():
    """Two workers, Nesterov, momentum 0.75, lr 0.5, syncing every 2 steps, the average applied
    one step late: the outer weights follow the hand-worked sequence on the workers' mean, and
    each worker adds the step it took while the average travelled."""
    shared = SimulatedWorkers(2, "fp32")
    params = [torch.nn.Parameter(torch.zeros(1)) for _ in range(2)]
    syncs = [OuterSync([("layers.0.w", p)], mode="diloco", sync_every=2, fragments=1, delay=1, n_blocks=1,
                       comm=shared.member(w), outer_lr=0.5, outer_momentum=0.75) for w, p in enumerate(params)]

    def step(moves):  # each worker moves, then every sync begins and finishes (test_local_sgd's step)
        return _step(params, syncs, moves)

    assert step([-1.0, -3.0]) == [False, False]
    assert step([-2.0, -2.0]) == [False, False]  # Δ = (3, 5): mean 4, sent after step 2
    assert step([1.0, 3.0]) == [True, True]  # applied after step 3: outer −3.5, plus each one's step 3
    assert [p.item() for p in params] == [-2.5, -0.5]
    assert step([0.0, 0.0]) == [False, False]  # Δ = (−3.5 − (−2.5), −3.5 − (−0.5)) = (−1, −3): mean −2
    assert step([0.5, 0.25]) == [True, True]  # buf 1, update −1.25: outer −2.875, plus 0.5 and 0.25
    assert [p.item() for p in params] == [-2.375, -2.625]
