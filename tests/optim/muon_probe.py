"""A probe run on forked ranks (tests/optim/test_muon.py): optim.whole.WholeMatrices on DTensors
placed as ZeRO, FSDP, HSDP, tp and ep place them, against torch.optim.Muon's own Newton-Schulz on
the whole matrices, and the bytes its all-to-alls send."""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard
from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, EPS, _zeropower_via_newtonschulz

COEF = (DEFAULT_A, DEFAULT_B, DEFAULT_C)


def cases(flat, grid):
    """(name, global shape, mesh, placements): 4 ranks, as a line (flat) and as dp 2 x tp 2 (grid)."""
    return [
        ("rows over 4 (2,2,2,1)", (7, 5), flat, (Shard(0),)),
        ("columns over 4", (5, 9), flat, (Shard(1),)),
        ("3 rows over 4: a rank holds none", (3, 6), flat, (Shard(0),)),
        ("hsdp: replicate x rows", (6, 4), grid, (Replicate(), Shard(0))),
        ("tp columns, replicated over dp", (5, 7), grid, (Replicate(), Shard(1))),
        ("fsdp rows x tp columns", (7, 6), grid, (Shard(0), Shard(1))),
        ("fsdp strided rows x tp rows", (9, 4), grid, (_StridedShard(0, split_factor=2), Shard(0))),
        ("fsdp rows x tp rows, 11 rows", (11, 3), grid, (Shard(0), Shard(0))),
        ("fsdp columns x tp rows", (5, 11), grid, (Shard(1), Shard(0))),
        ("fsdp strided columns x tp columns", (3, 13), grid, (_StridedShard(1, split_factor=2), Shard(1))),
        ("3 matrices cut on both dims", (3, 7, 5), grid, (Shard(1), Shard(2))),
        ("2 experts over 4", (2, 5, 3), flat, (Shard(0),)),
        ("experts over dp, rows over tp", (4, 6, 5), grid, (Shard(0), Shard(1))),
        ("replicated", (4, 4), flat, (Replicate(),)),
    ]


def expected(full: torch.Tensor) -> torch.Tensor:
    """torch.optim.Muon's Newton-Schulz (bf16) on each whole matrix."""
    mats = full.reshape(-1, *full.shape[-2:])
    return torch.stack([_zeropower_via_newtonschulz(m, COEF, 5, EPS) for m in mats]).view(full.shape)


def main(out_path: str) -> int:
    from scaletrain.optim.muon import newton_schulz
    from scaletrain.optim.whole import WholeMatrices

    dist.init_process_group("gloo")
    flat = init_device_mesh("cpu", (4,), mesh_dim_names=("flat",))
    grid = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)  # the same whole tensors on every rank
    table = cases(flat, grid)
    fulls = [torch.randn(shape) for _, shape, _, _ in table]
    params = [distribute_tensor(f, mesh, pl, src_data_rank=None) for f, (_, _, mesh, pl) in zip(fulls, table)]
    whole = WholeMatrices(params, torch.bfloat16)  # (ZeRO x tp: an owner among the 4 ranks of dp x tp)
    got = whole.apply([p.to_local() for p in params],
                      lambda m: newton_schulz(m, COEF, 5, EPS, torch.bfloat16), params)
    mismatched = []
    for (name, *_), f, p, g in zip(table, fulls, params, got, strict=True):
        want = distribute_tensor(expected(f), p.device_mesh, p.placements, src_data_rank=None).to_local()
        if g.shape != want.shape or not torch.equal(g, want):
            mismatched.append(name)
    # bytes: even pieces (split four ways: rows over one axis of 4, rows x columns over dp 2 x tp 2), one
    # step, summed over the ranks; and on the grid, which rank ran Newton-Schulz on which matrix
    shapes = [(64, 48), (48, 64), (128, 32), (32, 32), (16, 40)]
    even = [distribute_tensor(torch.randn(r, c), flat, (Shard(0),), src_data_rank=None) for r, c in shapes]
    two = [distribute_tensor(torch.randn(r, c), grid, (Shard(0), Shard(1)), src_data_rank=None) for r, c in shapes]
    counted = {}
    for name, ps in (("flat", even), ("grid", two)):
        counter = WholeMatrices(ps, torch.bfloat16)
        ran: list = []

        def record(m, ran=ran):  # which whole matrices this rank orthogonalises
            ran.append(tuple(m.shape))
            return m

        counter.apply([p.to_local() for p in ps], record, ps)
        sent = torch.tensor([float(counter.sent_bytes)])
        dist.all_reduce(sent)
        every: list = [None] * 4
        dist.all_gather_object(every, ran)
        counted[name] = {"sent_bytes": sent.item(), "values": sum(p.numel() for p in ps), "ran": every,
                         "owners": [m.owner for m in counter.axes[0].matrices],
                         "group_ranks": dist.get_process_group_ranks(counter.axes[0].group)}
    mismatched_all: list = [None] * 4
    dist.all_gather_object(mismatched_all, mismatched)
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump({"mismatched": sorted({m for ms in mismatched_all for m in ms}), **counted}, f)
    dist.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
