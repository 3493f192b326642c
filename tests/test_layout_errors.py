"""Layouts that cannot run on the world given, or on the model and data given: refused in one
line before any rank starts (tests/conftest.py: assert_one_clear_line)."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import Case, assert_one_clear_line, train_args

BAD_INPUT = [
    Case("tp-not-dividing-heads", train_args("--nproc", "2", "--parallel.tp=2", "--model.dim=96", "--model.n_heads=3"),
         ("parallel.tp=2 must divide model.n_heads=3", "use tp in [1, 3]")),
    Case("tp-not-dividing-vocab", train_args("--nproc", "2", "--parallel.tp=2", "--model.vocab_size=257"),
         ("parallel.tp=2 must divide model.vocab_size=257", "pad the vocabulary")),
    Case("pp-above-layers", train_args("--nproc", "2", "--parallel.pp=2", "--model.n_layers=1",
                                       "--model.tie_embeddings=false", "--train.micro_batch=4"),
         ("need at least 2 layers, but model.n_layers=1",)),
    Case("cp-seq-len-not-a-multiple", train_args("--nproc", "2", "--parallel.cp=2", "--data.seq_len=30"),
         ("parallel.cp=2 splits each sequence into 2 × cp = 4 equal chunks", "data.seq_len=30 is not a multiple of 4")),
    Case("cp-above-seq-len", train_args("--nproc", "32", "--parallel.cp=32"),
         ("parallel.cp=32 splits each sequence into 2 × cp = 64 chunks, but data.seq_len=32 has fewer tokens",
          "lower parallel.cp to at most 16")),
    Case("cp-ulysses-heads", train_args("--nproc", "4", "--parallel.cp=4", "--parallel.cp_method=ulysses",
                                        "--model.n_heads=2"),
         ("cp_method=ulysses swaps sequence shards for head shards", "must divide by parallel.cp=4",
          "use cp_method=ring or allgather")),
    Case("cp-with-dropout", train_args("--nproc", "2", "--parallel.cp=2", "--model.dropout=0.1"),
         ("model.dropout=0.1: attention dropout is not supported under context parallelism",)),
    Case("cp-unknown-method", train_args("--nproc", "2", "--parallel.cp=2", "--parallel.cp_method=rings"),
         ("parallel.cp_method", "did you mean ring?")),
    Case("pp-zero-bubble-with-tied-embeddings", train_args("--nproc", "2", "--parallel.pp=2", "--train.micro_batch=2",
                                                           "--model.n_layers=4", "--parallel.pp_schedule=zero-bubble",
                                                           "--parallel.pp_virtual_stages=2"),
         ("which the zero-bubble V puts on one rank", "set model.tie_embeddings=false")),
    Case("pp-split-not-numbers", train_args("--nproc", "2", "--parallel.pp=2", "--model.tie_embeddings=false",
                                            "--train.micro_batch=4", "--parallel.pp_split=1,x"),
         ("parallel.pp_split='1,x' must list 2 positive layer counts", "e.g. 1,1")),
    Case("interleaved-without-virtual", train_args("--nproc", "2", "--parallel.pp=2", "--model.tie_embeddings=false",
                                                   "--train.micro_batch=4", "--parallel.pp_schedule=interleaved-1f1b"),
         ("needs parallel.pp_virtual_stages >= 2",)),
    Case("virtual-stages-without-pp", train_args("--parallel.pp_virtual_stages=2"), ("they need parallel.pp > 1",)),
    Case("zero3-on-one-rank", train_args("--parallel.zero=3"),
         ("parallel.zero=3 shards model states over the dp_shard ranks, but there is only 1", "use parallel.zero=0")),
    Case("zero1-on-one-rank", train_args("--parallel.zero=1"), ("parallel.zero=1", "use parallel.zero=0")),
    Case("zero2-on-replicas-only", train_args("--nproc", "2", "--parallel.zero=2", "--parallel.dp_replicate=2"),
         ("parallel.zero=2", "there is only 1")),
    Case("sp-without-tp", train_args("--nproc", "2", "--parallel.sp=true"), ("it needs parallel.tp > 1",)),
    Case("global-batch-vs-micro", train_args("--train.global_batch=10", "--train.micro_batch=4"),
         ("train.global_batch=10 is not divisible by micro_batch × data-parallel size", "a multiple of 4")),
    Case("global-batch-vs-triad", train_args("--train.global_batch=10", "--train.micro_batch=4",
                                             "--train.grad_accum=2"),
         ("train.global_batch=10 but micro_batch × grad_accum × data-parallel size", "= 8")),
    Case("global-batch-vs-ranks", train_args("--nproc", "2", "--train.global_batch=7"),
         ("train.global_batch=7 is not divisible", "a multiple of 2")),
    Case("accum-vs-pp-microbatches", train_args("--nproc", "2", "--parallel.pp=2", "--model.tie_embeddings=false",
                                                "--train.grad_accum=2", "--parallel.pp_microbatches=4"),
         ("name the same count under pipelining", "give one of them")),
    Case("world-smaller-than-layout", train_args("--nproc", "2", "--parallel.dp_shard=4"),
         ("= 4 ranks, but the world has 2", "launch 4 processes")),
    Case("tp-without-ranks", train_args("--parallel.tp=2"), ("= 2 ranks, but the world has 1", "--nproc")),
    Case("replicas-not-dividing-world", train_args("--nproc", "2", "--parallel.dp_replicate=3"),
         ("= 3 ranks, but the world has 2",)),
    Case("dp-shard-zero", train_args("--parallel.dp_shard=0"), ("parallel.dp_shard=0 is not a size", "use -1")),
    Case("ep-not-dividing-experts", train_args("--nproc", "4", "--parallel.ep=4", "--model.moe_experts=6"),
         ("parallel.ep=4 must divide model.moe_experts=6", "use ep in [1, 2, 3, 6]")),
    Case("ep-not-dividing-dp-shard", train_args("--nproc", "4", "--parallel.ep=3", "--model.moe_experts=6"),
         ("parallel.ep=3 borrows its ranks from the dp_shard × cp × tp ranks, so it must divide "
          "dp_shard × cp × tp = 4 × 1 × 1 = 4; use an ep in [2, 4]",)),
    Case("ep-on-a-dense-model", train_args("--nproc", "2", "--parallel.ep=2"),
         ("parallel.ep=2 splits the experts of a mixture of experts, but the model is dense",)),
    # refused where the job is settled, once, before any rank starts (each rank said it before)
    Case("qat-with-tp", train_args("--nproc", "2", "--parallel.tp=2", "--train.qat=int8-dynamic"),
         ("train.qat=int8-dynamic with parallel.tp=2", "set parallel.tp=1")),
    Case("fp8-with-cp", train_args("--nproc", "2", "--parallel.cp=2", "--precision.mode=fp8",
                                   "--precision.fp8_min_dim=16"),
         ("precision.mode=fp8 with parallel.cp=2: not supported yet",)),
    Case("auto-layout-with-fixed-zero", train_args("--parallel.layout=auto", "--parallel.zero=3"),
         ("parallel.layout=auto chooses the layout itself", "parallel.layout=manual")),
]


@pytest.mark.parametrize("case", BAD_INPUT, ids=[c.id for c in BAD_INPUT])
def test_bad_input_gives_one_clear_line(case: Case, workdir: Path, capsys):
    assert_one_clear_line(case, workdir, capsys)
