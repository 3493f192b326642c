"""A probe run on forked ranks (tests/model/test_attention_matrix.py): each context-parallel attention
(ring, allgather, Ulysses) with each mask kind it takes (causal, sliding and chunked windows), on the
rank's load-balanced chunks of one set of queries, keys and values; the ranks' outputs gathered back into
sequence order, and rank 0 writes each against attention written as a loop (test_attention_properties)."""

from __future__ import annotations

import json
import sys

import numpy as np
import torch
import torch.distributed as dist

from scaletrain.model.window import Window
from scaletrain.parallel.context_parallel import METHODS, all_positions, chunk_positions
from test_attention_properties import attention_by_hand

# windows that divide neither the sequence (20) nor a rank's chunks (5)
CP_KINDS = {"causal": None, "sliding": Window(3), "chunked": Window(7, chunked=True)}
SEQ, HEADS, KV_HEADS, DIM = 20, 4, 2, 8


def inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    q = torch.randn(2, HEADS, SEQ, DIM, generator=g)
    return q, torch.randn(2, KV_HEADS, SEQ, DIM, generator=g), torch.randn(2, KV_HEADS, SEQ, DIM, generator=g)


def main(out_path: str) -> None:
    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    q, k, v = inputs()
    mine = chunk_positions(SEQ, n, rank)
    errors = {}
    for method, attend in METHODS.items():
        for kind, window in CP_KINDS.items():
            local = attend(*(t.index_select(2, mine) for t in (q, k, v)), group=dist.group.WORLD, rank=rank, n=n,
                           ranks=list(range(n)), window=window)
            parts = [torch.empty_like(local) for _ in range(n)]
            dist.all_gather(parts, local.contiguous())
            whole = torch.empty_like(q).index_copy_(2, all_positions(SEQ, n), torch.cat(parts, dim=2))
            if rank == 0:
                expected = attention_by_hand(q, k, v, None, True, 0.0, 0, window)
                errors[f"{kind} x cp-{method}"] = float(np.abs(whole.double().numpy() - expected).max())
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(errors, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
