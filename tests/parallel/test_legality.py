"""The one legality check (scaletrain.legality): the planner's search asks it as the job's settling
does, so every layout `plan` ranks is one `scaletrain train` accepts, under the techniques that
narrow the legal layouts (QLoRA, fp8, QAT, a mixture of experts with a capacity)."""

from __future__ import annotations

import pytest
import torch

from scaletrain.config import load_config
from scaletrain.errors import ConfigError
from scaletrain.launch.job import settle
from scaletrain.layout import Layout
from scaletrain.legality import Techniques, job_errors
from scaletrain.plan import plan

# a mixture whose experts keep at most 1.25 × their share of tokens: cp and sp are refused (without the
# capacity the planner ranks them for this model and sequence: test_the_check_narrows_the_search)
MOE = {"dim": 4096, "n_layers": 16, "n_heads": 32, "vocab_size": 32768, "max_seq_len": 32768, "moe_experts": 8,
       "moe_top_k": 2, "moe_capacity_factor": 1.25}

# (model: a preset or model.* keys, what the job runs on top of its layout as config keys, the plan()
# arguments of the same settings, sequence length, global batch)
CASES = {
    "qlora-70b": ("llama-70b", {"adapter.kind": "lora", "adapter.base_dtype": "nf4"},
                  {"adapter": "lora", "base_dtype": "nf4"}, 4096, 32),
    "fp8-8b": ("llama-8b", {"precision.mode": "fp8"}, {"precision": "fp8"}, 4096, 64),
    "qat-8b": ("llama-8b", {"train.qat": "int8-dynamic"}, {"qat": "int8-dynamic"}, 4096, 64),
    "moe-capacity": (MOE, {}, {}, 32768, 8),
}


def job_config(model, keys: dict, seq_len: int, tmp_path, layout: Layout | None = None):
    shape = {"model.preset": model} if isinstance(model, str) else {f"model.{k}": v for k, v in model.items()}
    return load_config(None, {**shape, **keys, "data.seq_len": seq_len, "log.run_dir": str(tmp_path / "run"),
                              **(layout.config_overrides() if layout is not None else {})})


@pytest.mark.parametrize("case", CASES)
def test_every_layout_the_planner_ranks_is_one_settle_accepts(case, tmp_path):
    model, keys, plan_args, seq_len, batch = CASES[case]
    cfg = job_config(model, keys, seq_len, tmp_path)
    result = plan(cfg.model, hardware="H100-SXM", nodes=1, gpus_per_node=8, seq_len=seq_len, global_batch=batch,
                  top_k=40, **plan_args)
    ranked = [e.layout for e in result["layouts"]]
    assert len(ranked) >= 10, [layout.describe() for layout in ranked]
    for layout in ranked:
        job = job_config(model, {**keys, "train.global_batch": batch}, seq_len, tmp_path, layout)
        settled, settled_layout = settle(job, 8, torch.device("cuda"))  # (nothing touches a GPU: it checks)
        assert settled_layout == layout, layout.describe()


def test_the_check_narrows_the_search():
    """The fault a user found: a Llama-70B QLoRA on 8 H100s planned tp 2 in all ten top layouts,
    which nf4 refuses. Without the technique the planner does rank what it refuses (the check
    narrows the search; the cases above are not blind)."""
    from dataclasses import replace

    from scaletrain.model.config import ModelConfig

    def ranked(model, seq_len, batch, **args):
        return plan(model, hardware="H100-SXM", gpus_per_node=8, seq_len=seq_len, global_batch=batch, top_k=40,
                    **args)["layouts"]

    assert all(e.layout.tp == 1 for e in ranked("llama-70b", 4096, 32, adapter="lora", base_dtype="nf4"))
    assert any(e.layout.tp > 1 for e in ranked("llama-70b", 4096, 32))
    assert all(e.layout.tp == 1 for e in ranked("llama-8b", 4096, 64, qat="int8-dynamic"))
    assert any(e.layout.tp > 1 for e in ranked("llama-8b", 4096, 64))
    assert all(e.layout.cp == 1 and not e.layout.sp for e in ranked(ModelConfig(**MOE), 32768, 8))
    dropless = ranked(replace(ModelConfig(**MOE), moe_capacity_factor=0), 32768, 8)
    assert any(e.layout.cp > 1 for e in dropless) and any(e.layout.sp for e in dropless)


@pytest.mark.parametrize("tech,layout,first_words", [
    (Techniques(adapter="lora", base_dtype="nf4"), Layout(tp=2), "adapter.base_dtype=nf4 with parallel.tp=2"),
    (Techniques(adapter="lora", base_dtype="int8"), Layout(dp_shard=2, zero=3),
     "adapter.base_dtype=int8 with parallel.zero=3"),
    (Techniques(adapter="lora"), Layout(dp_shard=2, ep=2), "adapter.kind=lora with parallel.ep=2"),
    (Techniques(adapter="lora", qat="int8-dynamic"), Layout(), "adapter.kind=lora with train.qat=int8-dynamic"),
    (Techniques(qat="int8-int4"), Layout(tp=2), "train.qat=int8-int4 with parallel.tp=2"),
    (Techniques(fp8=True), Layout(cp=2), "precision.mode=fp8 with parallel.cp=2"),
    (Techniques(custom_module=True), Layout(cp=2), "parallel.cp=2: context parallelism splits the attention"),
    (Techniques(document_mask=True), Layout(pp=2, grad_accum=2), "data.document_mask with parallel.pp=2"),
    (Techniques(document_mask=True), Layout(fault_tolerance=True),
     "data.document_mask with fault_tolerance.enabled is not supported"),
    (Techniques(device_type="cpu"), Layout(dp_shard=2, zero=3, offload_optimizer=True),
     "memory.offload_optimizer moves model states"),
])
def test_each_technique_rule_refuses_in_one_line_what_its_layout_cannot_run(tech, layout, first_words):
    [line] = job_errors(layout, None, tech)
    assert line.startswith(first_words), line
    assert job_errors(layout, None, Techniques()) == []  # the same layout is legal without the technique


def test_settle_lists_every_problem_of_a_job_at_once(tmp_path):
    cfg = job_config("llama-8b", {"train.qat": "int8-dynamic"}, 4096, tmp_path,
                     Layout(tp=2, pp=2, dp_shard=2, grad_accum=2))
    with pytest.raises(ConfigError) as e:
        settle(cfg, 8, torch.device("cuda"))
    assert [line.split(":")[0] for line in e.value.lines] == [
        "train.qat=int8-dynamic with parallel.tp=2", "train.qat=int8-dynamic with parallel.pp=2"]


def test_chat_data_under_replica_groups_is_refused_in_one_line_and_accepted_without_them():
    """The groups' average does not weigh each group's counted tokens: a loss mask is refused under
    fault tolerance (from the data, once opened), and only there."""
    from scaletrain.legality import data_errors

    [line] = data_errors(Layout(fault_tolerance=True), source="chat/", loss_mask=True)
    assert line.startswith("chat/ has a loss mask (chat data), and fault_tolerance.enabled averages")
    assert data_errors(Layout(), source="chat/", loss_mask=True) == []
    assert data_errors(Layout(fault_tolerance=True), source="plain/", loss_mask=False) == []


def test_a_layout_that_needs_more_ranks_than_one_process_names_nproc():
    """ep or ZeRO-3 on one process (issue 47): the line says to launch ranks with --nproc, not "use an ep
    in []"; with ranks to borrow or shard over, the ordinary rule."""
    [ep] = Layout(ep=2).errors()
    assert ep.startswith("parallel.ep=2 borrows its ranks") and "(--nproc 2)" in ep and "[]" not in ep
    [zero] = Layout(zero=3).errors()
    assert zero.endswith("or more data-parallel ranks (launch them with --nproc N)")
    assert Layout(ep=2, dp_shard=2).errors() == [] and Layout(zero=3, dp_shard=2).errors() == []
    [uneven] = Layout(ep=2, dp_shard=3).errors()
    assert uneven.endswith("use an ep in [3], or more of those ranks")
