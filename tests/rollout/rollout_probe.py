"""A probe run on forked ranks (tests/rollout/test_rollout.py): the colocated engine on the training module
as a 2-rank layout shards it (ZeRO-3, tp 2, ...), each rank sampling its share of the prompts."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

PROMPTS = [[10, 20, 30, 40, 50], [60, 70, 80], [5, 6, 7, 8, 9], [100, 101], [33, 34, 35, 36, 37, 38, 39]]
PARAMS = dict(n=3, max_new_tokens=9, temperature=0.8, top_p=0.95, top_k=40, stop_token_ids=(101,), seed=7)


def share(rank: int, world: int, split: bool) -> tuple[int, list[list[int]]]:
    """(first_index, prompts) of this rank: uneven shares (2 and 3 prompts) when the ranks split them."""
    if not split:
        return 0, PROMPTS
    cut = 2 if world == 2 else len(PROMPTS)
    return (0, PROMPTS[:cut]) if rank == 0 else (cut, PROMPTS[cut:])


def sample(module, group, split: bool, rank: int, world: int, use_cache: bool = True, multiple: int = 1) -> dict:
    from scaletrain.rollout import SamplingParams
    from scaletrain.rollout.local import LocalEngine, logprobs_of

    first, prompts = share(rank, world, split)
    engine = LocalEngine(module, group=group, use_cache=use_cache, length_multiple=multiple)
    r = engine.generate(prompts, SamplingParams(**PARAMS), first_index=first)
    # the trainer's side on the same tokens, every rank of the group together
    rows = max_rows(len(r), group)
    trainer_side = []
    for k in range(rows):
        b = min(k, len(r) - 1)
        trainer_side.append(logprobs_of(module, r.prompt_ids[b], r.completion_ids[b], PARAMS["temperature"],
                                        length_multiple=multiple).tolist())
    return {"prompt_index": [first + i for i in r.prompt_index], "completions": r.completion_ids,
            "logprobs": [lp.tolist() for lp in r.logprobs], "finished": r.finished, "forwards": r.forwards,
            "trainer": trainer_side[:len(r)], "sampling_gap": r.sampling_gap,
            "text": sample_text_of(module, group is not None, multiple)}


def sample_text_of(module, all_ranks: bool, multiple: int) -> str:
    """The trainer's sample after training (model.generate.sample_text, with its cache)."""
    import contextlib

    from scaletrain.data.tokenizer import ByteTokenizer
    from scaletrain.model.generate import sample_text

    return sample_text(module, ByteTokenizer(), "Hello", 12, window=32, seed=3, device=torch.device("cpu"),
                       autocast=contextlib.nullcontext, all_ranks=all_ranks, interrupted=lambda: False,
                       length_multiple=multiple)


def max_rows(mine: int, group) -> int:
    if group is None:
        return mine
    t = torch.tensor([mine])
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t)


def main(out_path: str, overrides_json: str, split: str) -> None:
    from scaletrain.config import load_config
    from scaletrain.runtime import init_worker
    from scaletrain.train.trainer import Trainer

    torch.set_num_threads(1)
    cfg = load_config(None, json.loads(Path(overrides_json).read_text()))
    rt = init_worker(cfg)
    trainer = Trainer(cfg, rt, stream=open(os.devnull, "w"))
    rank, world = dist.get_rank(), dist.get_world_size()
    multiple = trainer.pm.length_multiple
    got = sample(trainer.pm.dp.module, dist.group.WORLD, split == "split", rank, world, multiple=multiple)
    gathered = [None] * world
    dist.all_gather_object(gathered, got)
    if rank == 0:
        Path(out_path).write_text(json.dumps(gathered))
    dist.barrier()
