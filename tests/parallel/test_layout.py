from __future__ import annotations

from pathlib import Path

import pytest

from scaletrain.config import load_config
from scaletrain.errors import ConfigError
from scaletrain.layout import MESH_AXES, Layout

from conftest import Case, assert_one_clear_line, train_args


def dims(world, **kw):
    return Layout.from_config(load_config(None, {f"parallel.{k}": v for k, v in kw.items()}), world)


def test_dp_shard_minus_one_takes_the_remaining_ranks():
    d = dims(8, dp_replicate=2)
    assert (d.pp, d.dp_replicate, d.dp_shard, d.tp) == (1, 2, 4, 1)
    assert d.dp == 8 and d.mesh_shape == (1, 2, 4, 1, 1) and MESH_AXES == ("pp", "dp_replicate", "dp_shard", "cp", "tp")


def test_layout_must_use_the_world():
    with pytest.raises(ConfigError, match="needs a multiple of dp_replicate × tp × pp = 3"):
        dims(4, dp_replicate=3)
    with pytest.raises(ConfigError, match="= 2 ranks, but the world has 4"):
        dims(4, dp_shard=2)
    assert dims(4, dp_shard=2, dp_replicate=2).dp == 4


def test_model_parallel_checks():
    def check(world, **kw):
        cfg = load_config(None, {"model.tie_embeddings": False, **kw})
        Layout.from_config(cfg, world).check(cfg.model)

    with pytest.raises(ConfigError, match="parallel.tp=3 must divide model.n_heads=4"):
        check(3, **{"parallel.tp": 3, "model.n_heads": 4})
    check(4, **{"parallel.tp": 4, "model.n_kv_heads": 2})  # fewer K/V heads than tp: each replicated on 2 ranks
    with pytest.raises(ConfigError, match=r"must divide the key/value heads \(3\), or be a multiple of them"):
        check(2, **{"parallel.tp": 2, "model.dim": 96, "model.n_heads": 12, "model.n_kv_heads": 3})
    with pytest.raises(ConfigError, match="at least 8 layers, but model.n_layers=4"):
        check(4, **{"parallel.pp": 4, "parallel.pp_schedule": "interleaved-1f1b", "parallel.pp_virtual_stages": 2,
                    "train.grad_accum": 4})
    with pytest.raises(ConfigError, match="needs parallel.pp_virtual_stages=2"):
        check(2, **{"parallel.pp": 2, "parallel.pp_schedule": "zero-bubble"})
    with pytest.raises(ConfigError, match="must list 2 positive layer counts summing to model.n_layers=4"):
        check(2, **{"parallel.pp": 2, "parallel.pp_split": "1,2", "train.grad_accum": 2})
    with pytest.raises(ConfigError, match="needs parallel.tp > 1"):
        check(2, **{"parallel.sp": True})
    tied = load_config(None, {"parallel.pp": 2}).model  # the first and the last stage each hold the weight...
    Layout(pp=2, grad_accum=2).check(tied)
    with pytest.raises(ConfigError, match="which the zero-bubble V puts on one rank"):  # ...not on one rank
        Layout(pp=2, grad_accum=2, pp_schedule="zero-bubble", pp_virtual_stages=2).check(tied)
    with pytest.raises(ConfigError, match="name the same count under pipelining"):
        check(2, **{"parallel.pp": 2, "parallel.pp_microbatches": 4, "train.grad_accum": 2})
    check(2, **{"parallel.pp": 2, "parallel.pp_split": "3,1", "train.grad_accum": 2})  # a hand split that adds up


def test_balanced_split_accounts_for_the_head():
    from scaletrain.parallel.pipeline import balanced_split_counts, layer_ranges, stage_indices

    assert balanced_split_counts(8, 4) == [2, 2, 2, 2]
    assert balanced_split_counts(8, 2, head_cost=2.0) == [5, 3]  # the head weighs 2 blocks
    assert [list(r) for r in layer_ranges(load_config(None, {"model.n_layers": 4}).model, 2, "3,1")] == [[0, 1, 2], [3]]
    assert stage_indices("interleaved-1f1b", 1, 2, 2) == [1, 3]
    assert stage_indices("zero-bubble", 0, 2, 2) == [0, 3]


def test_the_rules_derived_from_a_layout():
    """Chunks per rank, the data-parallel engine and who keeps fp32 weights, read by the
    trainer, parallelize and the planner alike."""
    assert Layout(pp=2, pp_schedule="interleaved-1f1b", pp_virtual_stages=3).chunks_per_rank == 3
    assert Layout(pp=2, pp_schedule="1f1b").num_stages == 2
    engines = {(dp, zero, tp): Layout(dp_shard=dp, zero=zero, tp=tp).dp_engine
               for dp, zero, tp in ((1, 0, 1), (2, 0, 1), (2, 0, 2), (2, 1, 1), (2, 2, 1), (2, 3, 1))}
    assert engines == {(1, 0, 1): "none", (2, 0, 1): "ddp", (2, 0, 2): "replicate", (2, 1, 1): "zero1",
                       (2, 2, 1): "zero2", (2, 3, 1): "fsdp"}
    assert [Layout(dp_shard=2, zero=z).keeps_fp32_weights for z in range(4)] == [False, True, True, True]
    assert not Layout().keeps_fp32_weights
    lay = Layout.from_config(load_config(None, {"train.global_batch": 32, "train.micro_batch": 4}), 4)
    assert (lay.dp, lay.micro_batch, lay.grad_accum, lay.global_batch) == (4, 4, 2, 32)


def test_a_layout_round_trips_through_the_config_keys():
    cfg = load_config(None, {"model.tie_embeddings": False, "parallel.pp": 2, "parallel.tp": 2, "parallel.sp": True,
                             "parallel.zero": 1, "parallel.pp_schedule": "interleaved-1f1b",
                             "parallel.pp_virtual_stages": 2, "train.global_batch": 16, "train.grad_accum": 4,
                             "memory.activation_checkpointing": "selective"})
    lay = Layout.from_config(cfg, 8).check(cfg.model)
    again = Layout.from_config(cfg.replace(**lay.config_overrides()), 8)
    assert again == lay
    assert lay.describe() == "dp 2 zero1, tp 2+sp, pp 2 interleaved-1f1b v2, mb 2x4, ac selective"


def test_check_lists_every_problem_at_once():
    with pytest.raises(ConfigError) as e:
        Layout(sp=True, zero=1, offload_optimizer=True).check()
    text = "\n".join(e.value.lines)
    assert len(e.value.lines) == 3
    assert "needs parallel.tp > 1" in text and "offloads the sharded" in text
    assert "shards model states over the dp_shard ranks" in text


def test_the_layouts_defaults_are_the_configs():
    """Defined once: a Layout field's default is its config key's (sizes and the batch triad
    aside: the config's -1 and 0 ask for derivation); so are the planner's sync defaults."""
    from dataclasses import fields

    from scaletrain.config import FaultToleranceConfig, MemoryConfig, ParallelConfig, SyncConfig, TrainConfig
    from scaletrain.plan import DEFAULT_SYNC

    s = SyncConfig()  # [parallel.sync] and [fault_tolerance]: the Layout's names of their keys
    config = {**vars(ParallelConfig()), **vars(MemoryConfig()), "batch_rampup": TrainConfig().batch_rampup,
              "dp_sync": s.mode, "sync_every": s.every, "sync_fragments": s.fragments, "sync_delay": s.delay,
              "sync_dtype": s.dtype, "fault_tolerance": FaultToleranceConfig().enabled}
    derived = {"dp_shard", "micro_batch", "grad_accum"}
    assert {f.name: f.default for f in fields(Layout) if f.name not in derived} == \
        {f.name: config[f.name] for f in fields(Layout) if f.name not in derived}
    sync = ("dp_sync", "sync_every", "sync_fragments", "sync_delay", "sync_dtype")
    assert DEFAULT_SYNC == {k: config[k] for k in sync}


def test_world_of_a_config_and_the_rules_of_sizes_live_in_layout():
    from scaletrain.config import ParallelConfig
    from scaletrain.verify import layout_world

    par = ParallelConfig(dp_replicate=2, tp=2, pp=2, cp=2)
    assert Layout.fixed_ranks(par) == Layout.config_world(par) == layout_world(par, None) == 16  # dp_shard -1
    par = ParallelConfig(dp_replicate=2, tp=2, pp=2, cp=2, dp_shard=3)
    assert Layout.config_world(par) == layout_world(par, None) == 48
    lay = dims(48, dp_replicate=2, tp=2, pp=2, cp=2, dp_shard=3)
    assert lay.world == 48 and lay.global_batch == lay.micro_batch * lay.grad_accum * 6
    # the cp chunks of a sequence: every engine's rule, the same sentence
    for engine in ("scaletrain", "megatron"):
        assert any("2 × cp = 8 equal chunks" in e for e in Layout(cp=4).errors(engine=engine, seq_len=100))
        assert not Layout(cp=4).errors(engine=engine, seq_len=128)


def test_local_sgd_fragments_are_checked_by_one_rule():
    lay = Layout(dp_replicate=2, dp_sync="diloco", sync_every=10, sync_fragments=3)
    text = "parallel.sync.fragments=3 splits the model's blocks into fragments, but model.n_layers=2"
    assert lay.fragment_errors(2) == [f"{text}; use at most 2 fragments"]
    assert lay.fragment_errors(2, of_config=False)[0].endswith("but it has 2; use at most 2 fragments")
    assert lay.fragment_errors(3) == [] and Layout(sync_fragments=3).fragment_errors(1) == []  # without local sync
    model = load_config(None, {"model.n_layers": 2}).model
    assert any(e.startswith(text) for e in lay.errors(model))


# --------------------------------------------------------------------------------------------------
# From test_layout_errors.py (merged here):
#
# Layouts that cannot run on the world given, or on the model and data given: refused in one
# line before any rank starts (tests/conftest.py: assert_one_clear_line).

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
