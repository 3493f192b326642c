"""Plant known bugs, one at a time, on a copy of the tree, and check that the tests catch each.

    make test-mutations                      # every mutant (a few minutes on 2 cores)
    python tests/mutations.py NAME ...       # some of them
    python tests/mutations.py --list         # the mutants and the tests that must catch them

The tree (git's tracked and untracked-but-not-ignored files) is copied once into a temporary
folder. For each mutant one exact text replacement is made in one file of the copy (it fails
loudly if the text is not there exactly once, so a mutant cannot rot into a no-op when the code
around it changes), the named tests run there with PYTHONPATH at the copy, and the file is put
back. The table says which tests failed and by how much: the parity assertions (tests/conftest.py
assert_same_run, assert_same_weights) and the verify verdicts report "N x tolerance"; an exact
check (bit-for-bit equality, an expected error) has no margin to report.

A mutant is caught when at least one of its tests fails; the margin required is 100x the test's
tolerance, met by a failure that reports at least that, or by an exact check or an error. The
exit code is 1 if any mutant falls short. `make test` runs none of this (it takes minutes); what
it shows is that `make test` catches each bug. A new feature adds its mutant here (the bug its
tests exist for), and the table in docs/testing.md is this script's output.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
REQUIRED_MARGIN = 100.0


@dataclass(frozen=True)
class Mutant:
    name: str
    what: str  # the bug, in a line
    file: str  # relative to the repository
    old: str  # exactly once in the file
    new: str
    tests: tuple[str, ...]  # pytest node ids that must catch it


DP = "tests/parallel/test_data_parallel.py"
MP = "tests/parallel/test_model_parallel.py"
EP = "tests/parallel/test_expert_parallel.py"
LSC = "tests/parallel/test_local_sgd.py"
RC = "tests/train/test_batch_rampup.py"
MC = "tests/data/test_mix.py"
QC = "tests/quant/test_quantize.py"
CC = "tests/plan/test_calibrated_comm.py"
LO = "tests/model/test_lora.py"
AE = "tests/trained/test_adapter_export.py"
QL = "tests/quant/test_qlora.py"
PT = "tests/objectives/test_preference_training.py"
RT = "tests/objectives/test_rl_training.py"
RL = "tests/objectives/test_rl_layouts.py"
PL = "tests/objectives/test_preference_layouts.py"
HF = "tests/model/test_hf_families.py"
CH = "tests/data/test_chat.py"
FT = "tests/parallel/test_fault_tolerance.py"
FTL = "tests/parallel/test_ft_layouts.py"
DM = "tests/data/test_document_mask.py"
WIN = "tests/model/test_window.py"
AP = "tests/model/test_attention_properties.py"
WP = "tests/parallel/test_window_parallel.py"
ATTEND_BY_HAND = f"{AP}::test_attention_is_the_softmax_of_the_capped_scores_over_the_keys_each_query_sees"
WINDOW_HF = f"{WIN}::test_logits_and_generation_past_the_window_match_transformers"
WINDOW_PARITY = f"{WP}::test_windowed_models_train_alike_under_cp_tp_and_pp"
RO = "tests/rollout/test_local_engine.py"
RS = "tests/rollout/test_sampling.py"
ROL = "tests/rollout/test_rollout_layouts.py"
GO = "tests/model/families/test_gpt_oss.py"
GOP = "tests/model/families/test_gpt_oss_parallel.py"
MU = "tests/optim/test_muon.py"
DS = "tests/model/families/test_deepseek.py"
DSP = "tests/model/families/test_deepseek_parallel.py"
L4 = "tests/model/families/test_llama4.py"
L4_HF = f"{L4}::test_import_then_export_matches_transformers[interleaved]"
L4_GENERATE = f"{L4}::test_generation_through_the_cache_picks_transformers_tokens"
L4_PARITY = "tests/model/families/test_llama4_parallel.py::test_a_llama4_shaped_model_trains_alike_on_every_layout"
MUP = "tests/optim/test_muon_parallel.py"
QN = "tests/model/families/test_qwen3_next.py"
QN_HF = f"{QN}::test_import_then_export_matches_transformers[moe-grouped-values]"
QN_GENERATE = f"{QN}::test_generation_through_the_cache_equals_the_full_forward_and_picks_transformers_tokens"
QN_FORMS = f"{QN}::test_the_chunked_and_recurrent_forms_agree_with_transformers[13-4]"
QNP = "tests/model/families/test_qwen3_next_parallel.py"
QN_PARITY = f"{QNP}::test_a_qwen3_next_shaped_model_trains_alike_on_every_layout"
MTP = "tests/model/test_mtp.py"
MTP_HAND = f"{MTP}::test_the_loss_is_the_reports_by_hand[plain]"
DSM = "tests/model/families/test_deepseek_mtp.py"

MUTANTS = [
    Mutant("zero-no-dp-division", "ZeRO-1/2 bucket reduce without the 1/dp division",
           "src/scaletrain/parallel/zero.py",
           "        bucket.out.div_(self.dp)\n", "",
           (f"{DP}::test_parity_with_one_process[2ranks-zero1]", f"{DP}::test_parity_with_one_process[2ranks-zero2]",
            f"{DP}::test_parity_with_one_process[2ranks-zero2-sgd-noclip-accum]")),
    Mutant("fp16-scale-kept", "fp16 loss scale never divided out of the gradients",
           "src/scaletrain/precision.py",
           "torch.full((1,), times / self.scale, device=device)", "torch.full((1,), times / 1.0, device=device)",
           ("tests/train/test_precision.py::test_each_mode_tracks_fp32[16-mixed]",)),
    Mutant("pp-grads-divided-by-microbatches", "pipeline (1F1B) gradients divided by the micro-batch count",
           "src/scaletrain/parallel/pipeline.py",
           "Schedule1F1B(stages[0], n_microbatches, loss_fn=loss_fn, scale_grads=False)",
           "Schedule1F1B(stages[0], n_microbatches, loss_fn=loss_fn, scale_grads=True)",
           (f"{MP}::test_parity_with_one_process[dp2xpp2-ddp]", f"{MP}::test_parity_with_one_process[tp2xpp2]")),
    Mutant("tp-norm-over-replicated-axes", "gradient norm summed over the mesh axes a gradient is replicated on",
           "src/scaletrain/parallel/data_parallel.py",
           "for i, pl in enumerate(g.placements) if not pl.is_replicate())",
           "for i, pl in enumerate(g.placements))",
           (f"{MP}::test_parity_with_one_process[tp2xpp2]", f"{MP}::test_parity_with_one_process[dp2xtp2-zero1]",
            f"{MP}::test_parity_with_one_process[dp2xtp2-zero3]",
            f"{MP}::test_parity_with_one_process[dp2xtp2-zero0-sp]")),
    Mutant("checkpoint-sha256-not-compared", "the sha256 of checkpoint files computed but never compared",
           "src/scaletrain/train/checkpoint.py",
           '        if got["sha256"] != want["sha256"]:', "        if False:",
           ("tests/train/test_checkpoint.py::test_damaged_checkpoint_is_named_and_auto_resume_falls_back",)),
    Mutant("hf-rotary-inverted-on-sharded-reads", "HF rotary row permutation inverted when a rank reads a slice",
           "src/scaletrain/model/hf.py",
           "            t = rows_hf_to_ours(t, (hi - lo) // d, cfg.rotary_dim)",
           "            t = rows_ours_to_hf(t, (hi - lo) // d, cfg.rotary_dim)",
           ("tests/model/test_init_from.py::test_a_shard_reads_only_its_part_and_equals_the_full_tensor",
            "tests/model/test_init_from.py::test_fine_tuning_from_hf_passes_verify[dp2-zero3]",
            "tests/model/test_init_from.py::test_fine_tuning_from_hf_passes_verify[tp2]")),
    # DDP without no_sync costs communication, not correctness (its all-reduce is linear and the
    # accumulated part is already equal on every rank); ZeRO-1's engine reduces into the shard
    # rows of the full gradient, so reducing on every micro-step there is a wrong gradient
    Mutant("no-sync-dropped-under-accumulation", "ZeRO-1 reduces on every micro-step of an accumulated step",
           "src/scaletrain/parallel/zero.py",
           "self.sync = last or self.reduce_every_micro_step", "self.sync = True",
           (f"{DP}::test_parity_with_one_process[4ranks-zero1-accum]",
            f"{DP}::test_parity_with_one_process[4ranks-zero1-sgd-noclip-accum]")),
    Mutant("resume-data-order-off-by-one", "a resumed run reads the data of the step after the one it is at",
           "src/scaletrain/train/trainer.py",
           "build_loader(self.data.dataset, self.sampler(self.step),",
           "build_loader(self.data.dataset, self.sampler(self.step + (self.step > 0)),",
           (f"{DP}::test_checkpoints_reshard_across_layouts",
            "tests/train/test_checkpoint.py::test_stop_and_resume_gives_bitwise_identical_losses")),
    # (the input_layouts of the blocks' "attn" and "mlp" PrepareModuleInput are not this: their
    # input is already a DTensor, whose own placement wins, so changing them changes nothing)
    Mutant("sp-all-gather-wrong-dim", "sequence parallelism shards the residual stream along the batch, so its "
           "all-gathers (along the sequence) join different sequences end to end",
           "src/scaletrain/parallel/tensor_parallel.py",
           "desired_input_layouts=(Shard(1), None), use_local_output=True))",
           "desired_input_layouts=(Shard(0), None), use_local_output=True))",
           (f"{MP}::test_parity_with_one_process[tp2-sp]", f"{MP}::test_parity_with_one_process[dp2xtp2-zero2-sp]")),
    Mutant("ep-outputs-in-expert-order", "expert parallelism returns the experts' outputs grouped by local expert, "
           "not in the order the tokens arrived (the all-to-all's return permutation left out)",
           "src/scaletrain/parallel/expert_parallel.py",
           "    back = y[torch.argsort(order)]", "    back = y",
           (f"{EP}::test_parity_with_one_process[ep2-ddp]", f"{EP}::test_parity_with_one_process[ep4-zero3]")),
    Mutant("ep-expert-grads-not-scaled", "under expert parallelism the experts' gradients miss the cp·tp/ep (each "
           "already sums the tokens of the whole ep group)",
           "src/scaletrain/parallel/expert_parallel.py",
           "_ScaleGrad.apply(w.to_local(), grad_scale)", "_ScaleGrad.apply(w.to_local(), 1.0)",
           (f"{EP}::test_parity_with_one_process[ep2-ddp]",
            f"{EP}::test_parity_with_one_process[ep2-zero2-sgd-noclip]",
            f"{EP}::test_parity_with_one_process[ep4-zero3]")),
    Mutant("moe-tp-expert-grads-not-summed", "under tp the replicated experts' gradients are not summed over the tp "
           "ranks (each routed only its own sequence shard)",
           "src/scaletrain/parallel/tensor_parallel.py",
           '''if ".moe." in n and id(p) not in self.exclude]''',
           '''if ".moe." in n and ".moe.w" not in n and id(p) not in self.exclude]''',
           ("tests/parallel/test_moe_parallel.py::test_moe_parity_with_one_process[tp2]",
            "tests/parallel/test_moe_parallel.py::test_moe_parity_with_one_process[tp2-sp]")),
    Mutant("ep-grad-scale-ignores-borrowed-ranks", "the experts' gradient scale is 1/ep even where ep borrows cp or tp "
           "ranks (whose partial gradients the experts' average then undercounts)",
           "src/scaletrain/parallel/parallelize.py",
           "grad_scale=c.lay.token_ranks / c.lay.ep)", "grad_scale=1 / c.lay.ep)",
           (f"{EP}::test_parity_with_one_process[ep4xcp2]", f"{EP}::test_parity_with_one_process[ep2xtp2]")),
    Mutant("ep-experts-summed-over-cp", "the context-parallel gradient sum also sums the experts that ep splits "
           "over the cp ranks",
           "src/scaletrain/parallel/context_parallel.py",
           "sum_gradients([p for _, p in named if id(p) not in self.exclude], self.group)",
           "sum_gradients([p for _, p in named], self.group)",
           (f"{EP}::test_parity_with_one_process[ep2xcp2-zero3]",)),
    Mutant("ep-zero3-backward-without-regather", "under ZeRO-3 the experts freed after forward are not gathered "
           "again for their backward", "src/scaletrain/parallel/expert_parallel.py",
           "            y.register_hook(partial(shards.gather_for_backward, m))", "            pass",
           (f"{EP}::test_parity_with_one_process[ep2xcp2-zero3]",
            f"{EP}::test_parity_with_one_process[ep2xtp2-zero3]")),
    Mutant("ep-zero3-shards-views-of-freed-replicas", "under ZeRO-3 the experts' shards are views into the replicas "
           "whose storage is freed between uses", "src/scaletrain/parallel/zero.py",
           "is_view = dtype == p.dtype and not own_shards", "is_view = dtype == p.dtype",
           (f"{EP}::test_parity_with_one_process[ep2xcp2-zero3]",
            f"{EP}::test_zero3_keeps_a_shard_of_the_experts_between_steps[ep2xcp2-zero3]")),
    Mutant("moe-bias-from-one-micro-batch", "the expert bias moves from the last micro-batch's load, not the step's",
           "src/scaletrain/model/moe.py",
           "                self.stats[:E] += routed", "                self.stats[:E] = routed",
           (f"{EP}::test_parity_with_one_process[ep2-zero1-accum]",)),
    # the checks themselves: verify must hold the gradient norm, and what is logged as the
    # gradient norm must be the norm before clipping, or every assertion above is blind
    Mutant("verify-ignores-grad-norm", "scaletrain verify's verdict reads the losses only",
           "src/scaletrain/verify.py",
           "ok = worst_loss.loss_rel <= tol_loss and worst_norm.grad_norm_rel <= tol_norm",
           "ok = worst_loss.loss_rel <= tol_loss",
           ("tests/parallel/test_verify.py::test_a_wrong_loss_normalisation_fails_on_the_gradient_norm",
            "tests/parallel/test_verify.py::test_comparison_and_verdict")),
    Mutant("grad-norm-logged-after-clipping", "the logged gradient norm is the norm after clipping",
           "src/scaletrain/parallel/data_parallel.py",
           "                (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad).mul_(coef)\n    return norm",
           "                (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad).mul_(coef)\n"
           "    return norm.clamp(max=max_norm) if max_norm else norm",
           ("tests/train/test_training.py::test_gradient_clipping_by_global_norm",)),
    Mutant("local-sgd-pseudo-gradient-sign", "DiLoCo's pseudo-gradient taken as local - outer (a step away from "
           "where the workers went)", "src/scaletrain/parallel/local_sgd.py",
           "mine = torch.cat([(p.outer.to(p.local.device, non_blocking=True) - p.local).reshape(-1)",
           "mine = torch.cat([(p.local - p.outer.to(p.local.device, non_blocking=True)).reshape(-1)",
           ("tests/parallel/test_local_sgd.py::test_local_sgd_averages_the_weights_and_diloco_takes_a_nesterov_step",)),
    Mutant("cp-ring-no-lse-merge", "ring attention adds the K/V blocks' partial outputs without the log-sum-exp "
           "weights", "src/scaletrain/parallel/context_parallel.py",
           "    return out * torch.exp(lse - merged) + block_out * torch.exp(block_lse - merged), merged\n",
           "    return out + block_out, merged\n",
           (f"{MP}::test_parity_with_one_process[cp2-ring]", f"{MP}::test_parity_with_one_process[cp4-ring-llama]")),
    Mutant("cp-ring-grads-left-on-the-ring", "ring attention's backward leaves each K/V block's gradient with the "
           "rank that held it last (not sent back to its owner)", "src/scaletrain/parallel/context_parallel.py",
           "            d_kv = _shift(d_kv, group, nxt, prev)\n", "            pass\n",
           (f"{MP}::test_parity_with_one_process[cp2-ring]", f"{MP}::test_parity_with_one_process[cp4-ring-llama]")),
    Mutant("cp-allgather-grads-kept-local", "allgather attention's backward keeps its own queries' share of its "
           "K/V gradient (the other ranks' shares never reduce-scattered to it)",
           "src/scaletrain/parallel/context_parallel.py",
           "        d_kv = _reduce_scatter(d_kv, group)\n", "        d_kv = d_kv[rank]\n",
           (f"{MP}::test_parity_with_one_process[cp4-allgather]",
            f"{MP}::test_parity_with_one_process[cp2-allgather-llama]")),
    Mutant("cp-rope-contiguous-positions", "under cp the rotary tables start at 0 on every rank (positions not "
           "those of the rank's chunks)", "src/scaletrain/parallel/context_parallel.py",
           "model.rope_cos[positions], model.rope_sin[positions]",
           "model.rope_cos[:len(positions)], model.rope_sin[:len(positions)]",
           (f"{MP}::test_parity_with_one_process[cp2-allgather-llama]",
            f"{MP}::test_parity_with_one_process[cp4-ulysses-llama]")),
    Mutant("cp-grads-not-summed", "the context-parallel ranks' gradients never summed (each steps on its own "
           "tokens' share)", "src/scaletrain/parallel/context_parallel.py",
           "        sum_gradients([p for _, p in named if id(p) not in self.exclude], self.group)\n", "        pass\n",
           (f"{MP}::test_parity_with_one_process[cp2-ring]", f"{MP}::test_parity_with_one_process[dp2xcp2-zero3]")),
    Mutant("tp-replicated-kv-grads-not-summed", "with fewer K/V heads than tp, the replicated wk/wv gradients are "
           "not summed over the tp ranks", "src/scaletrain/parallel/tensor_parallel.py",
           "        sum_gradients([p for n, p in named if n.endswith(self.NAMES)], self.group)\n",
           "        pass\n",
           (f"{MP}::test_parity_with_one_process[tp4-kv1]", f"{MP}::test_parity_with_one_process[tp4-kv2-sp]")),
    Mutant("pp-tied-grads-not-summed", "a tied embedding under pipelining: the first and the last stage's gradients "
           "never summed", "src/scaletrain/parallel/pipeline.py",
           "        sum_gradients(self.tied, self.group)\n", "",
           (f"{MP}::test_parity_with_one_process[pp2-tied]",
            f"{MP}::test_tied_embedding_copies_stay_identical[pp2-tied]")),
    Mutant("pp-tied-copy-counted-twice", "the global gradient norm counts both pipeline stages' copies of a tied "
           "embedding", "src/scaletrain/parallel/parallelize.py",
           "copies=self.norm_copies())", "copies=())",
           (f"{MP}::test_parity_with_one_process[pp2-tied]",)),
    # the composition's step hooks and the one legality check (issue 46)
    Mutant("fp16-unscale-forgets-dp", "fp16's loss scale stands in for dp, the mean's factor, but unscaling does "
           "not multiply dp back", "src/scaletrain/parallel/parallelize.py",
           "        scaler.times = rt.layout.dp\n", "        scaler.times = 1\n",
           (f"{DP}::test_precision_composes_with_every_zero_stage",)),
    Mutant("planner-blind-to-techniques", "the planner's search checks layouts without the job's techniques "
           "(QLoRA, fp8, QAT, document masks)", "src/scaletrain/plan/search.py",
           "job_errors(layout, cfg, wl.techniques,", "job_errors(layout, cfg, type(wl.techniques)(),",
           ("tests/parallel/test_legality.py::test_every_layout_the_planner_ranks_is_one_settle_accepts",
            "tests/parallel/test_legality.py::test_the_check_narrows_the_search")),
    # quantization: a saved int8 weight rebuilt without its per-row scale (the integers taken as
    # the weights themselves)
    Mutant("quantized-scale-not-applied", "a quantized folder's int8 weights loaded without their scales",
           "src/scaletrain/quant/ptq.py",
           'return Int8Tensor(parts["qdata"], parts["scale"], [1, cols]',
           'return Int8Tensor(parts["qdata"], torch.ones_like(parts["scale"]), [1, cols]',
           ("tests/quant/test_quantize.py::test_the_folder_loads_without_unpickling_and_gives_the_same_logits[int8-weight]",
            "tests/quant/test_quantize.py::test_ptq_perplexity_is_within_tolerance_of_fp32_and_the_folder_is_smaller"
            "[int8-dynamic]")),
    # the calibrated planner: the engine's measured per-micro-batch cost (ZeRO-2's and FSDP's reductions,
    # the trainer's work on each micro-batch) paid once per step (accumulation would look free)
    Mutant("calibrated-engine-once-per-step", "the measured per-micro-batch engine cost not scaled by micro-batches",
           "src/scaletrain/plan/calibrated_time.py",
           "    return once + micro_batches * (", "    return once + (",
           ("tests/plan/test_calibration.py::test_a_measured_engine_replaces_the_modelled_communication_and_optimizer_step",)),
    # the calibration's probes summarised by their fastest call, not the median the measurement keeps
    Mutant("calibration-fastest-call", "a probe's figure is its fastest call (a busy machine's lucky one)",
           "src/scaletrain/bench/calibrate.py",
           "[statistics.median(row) for row in times]", "[min(row) for row in times]",
           ("tests/bench/test_bench.py::test_the_calibration_keeps_the_median_call_as_the_measurement_keeps_the_median_step",)),
    # the machine's pace since the calibration left out of the calibrated step
    Mutant("calibrated-pace-ignored", "the calibrated figures not scaled by the machine's slowdown",
           "src/scaletrain/plan/calibrated_time.py", "    k = cal.slowdown  #", "    k = 1.0  #",
           ("tests/plan/test_calibration.py::test_every_calibrated_figure_is_scaled_by_the_machines_slowdown_since_it_"
            "was_calibrated",)),
    # local SGD / DiLoCo, the batch ramp and mixtures where their boundaries land exactly
    Mutant("local-sgd-int8-sender-scales", "the receiver decodes the int8 values it received with the scales it "
           "sent, not those that came with them", "src/scaletrain/parallel/replica_average.py",
           "_encode(_reduce_segment(received, received_scales, dtype, workers)",
           "_encode(_reduce_segment(received, scales, dtype, workers)",
           (f"{LSC}::test_int8_chunks_of_very_different_magnitudes_each_within_their_own_scale",
            f"{LSC}::test_the_average_is_the_mean_bit_for_bit_where_the_format_carries_it[int8]")),
    Mutant("local-sgd-int8-one-scale-per-segment", "int8 on the wire with one scale per worker's segment (its "
           "largest value), not one per chunk", "src/scaletrain/parallel/replica_average.py",
           "    scale = chunks.abs().amax(-1) / 127.0\n",
           "    scale = chunks.abs().amax(-1).amax(-1, keepdim=True).expand(chunks.shape[:2]) / 127.0\n",
           (f"{LSC}::test_int8_chunks_of_very_different_magnitudes_each_within_their_own_scale",
            f"{LSC}::test_the_average_is_the_mean_bit_for_bit_where_the_format_carries_it[int8]")),
    Mutant("diloco-nesterov-stale-look-ahead", "DiLoCo's Nesterov step looks ahead with the momentum before this "
           "sync's pseudo-gradient is added to it", "src/scaletrain/parallel/local_sgd.py",
           "                p.momentum.mul_(self.momentum).add_(delta)\n"
           "                update = delta.add(p.momentum, alpha=self.momentum) if self.nesterov else p.momentum\n",
           "                update = delta.add(p.momentum, alpha=self.momentum) if self.nesterov else p.momentum\n"
           "                p.momentum.mul_(self.momentum).add_(delta)\n",
           (f"{LSC}::test_every_outer_optimizer_takes_the_steps_worked_out_by_hand[diloco-nesterov-0.75]",
            f"{LSC}::test_two_workers_step_on_their_mean_and_a_delayed_sync_adds_what_each_learnt")),
    Mutant("rampup-threshold-reached-a-step-late", "the batch ramp grows one step after the tokens seen reach an "
           "increment's threshold exactly", "src/scaletrain/schedule.py",
           "steps = -(-need // (batch * seq_len * n))", "steps = need // (batch * seq_len * n) + 1",
           (f"{RC}::test_each_steps_batch_where_the_tokens_land_on_a_threshold",
            f"{RC}::test_the_first_threshold_reached_exactly_is_where_the_describe_line_says")),
    Mutant("rampup-batch-reads-past-the-epoch-cut", "under a batch ramp, a step that runs past an epoch's end takes "
           "the windows the epoch's cut to whole batches leaves out", "src/scaletrain/data/loader.py",
           "take = min(count, per_epoch - within)", "take = count",
           (f"{RC}::test_a_ramp_across_epoch_ends_reads_each_steps_windows_in_order",)),
    Mutant("mix-permutation-kept-across-epochs", "a mixture's sampler that runs on keeps a source's first "
           "permutation for its later epochs (one built at the step reads the right one)",
           "src/scaletrain/data/mix.py",
           "if cached is None or cached[0] != epoch:", "if cached is None:",
           (f"{MC}::test_every_steps_windows_follow_the_definition_through_many_epochs_of_a_small_source",
            f"{MC}::test_a_sampler_resumed_past_a_small_sources_epochs_reads_what_a_straight_one_does")),
    Mutant("mix-epochs-in-one-order", "every epoch of a mixture's source read in the same order (the permutation "
           "not seeded by the epoch)", "src/scaletrain/data/mix.py",
           "np.random.default_rng([self.seed, d, int(epoch)])", "np.random.default_rng([self.seed, d])",
           (f"{MC}::test_every_steps_windows_follow_the_definition_through_many_epochs_of_a_small_source",)),
    Mutant("mix-weights-not-normalised", "a mixture's sampler takes its weights as shares of [0, 1), not as "
           "proportions (weights 70, 20, 10 draw from the first source only)", "src/scaletrain/data/mix.py",
           "int(round(c / cumulative[-1] * M))", "int(round(c * M))",
           (f"{MC}::test_weights_summing_to_one_or_more_draw_the_same_windows_in_proportion",)),
    # QAT's rounding against PTQ's, value for value and by hand (tests/quant/test_quantize.py)
    Mutant("qat-int8-weights-asymmetric", "QAT (int8-dynamic) rounds weights asymmetrically, PTQ symmetrically",
           "src/scaletrain/quant/qat.py",
           'weight = IntxFakeQuantizeConfig(torch.int8, "per_channel", is_symmetric=True)',
           'weight = IntxFakeQuantizeConfig(torch.int8, "per_channel", is_symmetric=False)',
           (f"{QC}::test_qat_trains_against_the_weight_ptq_stores[int8-dynamic]",)),
    Mutant("qat-int4-groups-of-64", "QAT (int8-int4) gives each 64 inputs one weight scale, PTQ each 32",
           "src/scaletrain/quant/qat.py",
           'return QATConfig(torchao_config(scheme), step="prepare")',
           'return QATConfig(activation_config=IntxFakeQuantizeConfig(torch.int8, "per_token", is_symmetric=False), '
           'weight_config=IntxFakeQuantizeConfig(torch.int4, group_size=64, is_symmetric=True), step="prepare")',
           (f"{QC}::test_qat_trains_against_the_weight_ptq_stores[int8-int4]",)),
    Mutant("qat-activations-not-quantized", "QAT (int8-dynamic) fake-quantizes the weights only, PTQ the "
           "activations too", "src/scaletrain/quant/qat.py",
           "return QATConfig(activation_config=act, weight_config=weight",
           "return QATConfig(activation_config=None, weight_config=weight",
           (f"{QC}::test_qat_rounds_activations_as_ptq_and_its_linears_give_ptq_outputs[int8-dynamic]",)),
    Mutant("qat-eval-without-fake-quantizers", "a QAT run evaluates with its fake quantizers switched off",
           "src/scaletrain/train/evaluate.py",
           "        m.eval()  # no dropout\n",
           "        m.eval()  # no dropout\n"
           "        m.apply(__import__('torchao.quantization.qat.linear', fromlist=['_']).disable_linear_fake_quant)\n",
           (f"{QC}::test_a_qat_model_is_evaluated_through_its_fake_quantizers",)),
    Mutant("qat-checkpoint-evaluated-plain", "scaletrain eval of a QAT checkpoint runs it without fake quantizers",
           "src/scaletrain/trained/evaluate.py",
           "        prepare_qat(model, what.cfg.train.qat)\n", "        pass\n",
           (f"{QC}::test_a_qat_model_is_evaluated_through_its_fake_quantizers",)),
    # the planner's collectives, each engine's derived by hand (tests/plan/test_calibrated_comm.py)
    Mutant("calibrated-zero-gather-as-all-reduce", "ZeRO-1/2's weight all-gather priced as an all-reduce",
           "src/scaletrain/plan/calibrated_time.py",
           'gather = cal.collective_s("all_gather", params * max(d.param, 4), n_shard, calls=buckets)',
           'gather = cal.collective_s("all_reduce", params * max(d.param, 4), n_shard, calls=buckets)',
           (f"{CC}::test_each_engines_communication_is_the_calibrated_collectives_by_hand[zero1]",
            f"{CC}::test_each_engines_communication_is_the_calibrated_collectives_by_hand[zero2-accum]")),
    Mutant("calibrated-fsdp-gathers-fp32", "FSDP's gathers priced in the stored dtype (fp32), not the compute dtype",
           "src/scaletrain/plan/calibrated_time.py",
           'gather = 2 * cal.collective_s("all_gather", params * d.compute, n_shard, calls=units + 1)',
           'gather = 2 * cal.collective_s("all_gather", params * d.param, n_shard, calls=units + 1)',
           (f"{CC}::test_each_engines_communication_is_the_calibrated_collectives_by_hand[fsdp-accum]",
            f"{CC}::test_each_engines_communication_is_the_calibrated_collectives_by_hand[hsdp]")),
    Mutant("all-to-all-with-all-reduce-bus-factor", "an all-to-all priced with the all-reduce's bus factor 2(n-1)/n",
           "src/scaletrain/plan/calibrate.py",
           '    if op == "all_reduce":', '    if op in ("all_reduce", "all_to_all"):',
           (f"{CC}::test_each_engines_communication_is_the_calibrated_collectives_by_hand[cp2-ulysses]",
            f"{CC}::test_the_catalog_prices_each_engines_collectives_at_the_measured_bus_bandwidth[cp2-ulysses]")),
    Mutant("calibrated-pp-send-whole-under-sp", "under sequence parallelism a pipeline send priced for the whole "
           "activation, not its tp shard", "src/scaletrain/plan/calibrated_time.py",
           "sent = act / (layout.tp if layout.sp else 1)", "sent = act",
           (f"{CC}::test_each_engines_communication_is_the_calibrated_collectives_by_hand[tp2-sp-pp2]",)),
    Mutant("tp-two-collectives-per-block", "tensor parallelism priced at two collectives per block, not four",
           "src/scaletrain/plan/time_model.py",
           "    return 4.0 * dense + (2.0 if layout.sp else 3.0) * moe",
           "    return 2.0 * dense + (2.0 if layout.sp else 3.0) * moe",
           (f"{CC}::test_the_catalog_prices_each_engines_collectives_at_the_measured_bus_bandwidth[tp2]",
            f"{CC}::test_the_catalog_prices_each_engines_collectives_at_the_measured_bus_bandwidth[tp4-sp]")),
    Mutant("lora-scale-twice", "the adapters' update scaled by alpha/rank twice",
           "src/scaletrain/model/lora.py",
           "self.lora_a.to(x.dtype)) * self.scale\n",
           "self.lora_a.to(x.dtype)) * self.scale * self.scale\n",
           (f"{LO}::test_numerics_match_peft[lora-False]",)),
    Mutant("lora-base-trains", "gradients reach the frozen base (every parameter left trainable)",
           "src/scaletrain/model/lora.py",
           "        p.requires_grad_(is_adapter_param(pname))\n", "        p.requires_grad_(True)\n",
           (f"{LO}::test_only_the_adapters_train_and_hold_optimizer_state[lora]",
            f"{LO}::test_a_frozen_base_gets_no_gradient_in_backward")),
    Mutant("lora-zero-shards-the-frozen-base", "ZeRO-1/2 gives the frozen base slots (gradient buckets, optimizer "
           "shards)", "src/scaletrain/parallel/parallelize.py",
           "if id(p) not in experts and p.requires_grad]", "if id(p) not in experts]",
           (f"{LO}::test_adapters_on_every_layout_match_one_process[lora-zero2]",
            f"{LO}::test_adapters_on_every_layout_match_one_process[dora-zero1]")),
    Mutant("peft-lora-b-rows-unpermuted", "the PEFT export leaves lora_B's rows of wq/wk in scaletrain's rotary "
           "order (the base's rows are reordered)", "src/scaletrain/trained/adapters.py",
           'if heads and leaf != "lora_a":  # the output rows follow', 'if heads and leaf == "lora_magnitude":  #',
           (f"{AE}::test_peft_and_merged_exports_give_scaletrains_logits[qwen3-lora-attention]",)),
    Mutant("peft-import-rows-unpermuted", "a PEFT folder read back without reordering lora_B's and the "
           "magnitudes' q/k rows", "src/scaletrain/trained/adapters.py",
           'if heads_of[name] and leaf != "lora_a":', "if False:",
           (f"{AE}::test_a_folder_saved_by_peft_itself_reads_back_onto_its_base",)),
    Mutant("merge-drops-the-scale", "merging adds B A without the alpha/rank scale",
           "src/scaletrain/model/lora.py",
           "w = self.weight.float() + self.delta_weight().float()", "w = self.weight.float() + (self.lora_b @ "
           "self.lora_a).float()",
           (f"{AE}::test_peft_and_merged_exports_give_scaletrains_logits[qwen3-lora-attention]",
            f"{LO}::test_merged_weight_computes_what_the_adapted_linear_does")),
    Mutant("lora-tp-plan-drops-the-adapters", "the tp plan leaves a column-parallel base's B whole (replicated), "
           "not split with the base's rows", "src/scaletrain/parallel/tensor_parallel.py",
           '"lora_a": Replicate(), "lora_b": Shard(0),', '"lora_a": Replicate(), "lora_b": Replicate(),',
           (f"{LO}::test_tensor_parallelism_splits_the_adapters_like_their_base[lora-tp2]",)),
    Mutant("dora-rowwise-norm-local", "DoRA's magnitude on a row-parallel base starts from the local columns' "
           "row norms, not the whole rows'", "src/scaletrain/model/lora.py",
           "torch.distributed.all_reduce(squares, group=w.device_mesh.get_group(axis))", "pass",
           (f"{LO}::test_adapters_on_every_layout_match_one_process[dora-tp2]",)),
    Mutant("lora-sp-unfreezes-the-base", "sequence parallelism's norms come back trainable (the frozen base "
           "not frozen again after the tp plan)", "src/scaletrain/parallel/tensor_parallel.py",
           "        if name in frozen:\n", "        if name in frozen and not sequence_parallel:\n",
           (f"{LO}::test_adapters_on_every_layout_match_one_process[lora-tp2-sp]",)),
    Mutant("qlora-nf4-shard-of-rank-0", "under ZeRO-3 every rank keeps the first row shard of the NF4 base",
           "src/scaletrain/quant/frozen_base.py",
           "whole = whole.split(rows)[offset[0] // rows]", "whole = whole.split(rows)[0]",
           (f"{LO}::test_adapters_on_every_layout_match_one_process[qlora-nf4-zero3]",)),
    Mutant("qlora-int8-backward-without-scale", "the int8 base's input gradient taken through its codes, not "
           "their dequantized values", "src/scaletrain/quant/frozen_base.py",
           "return grad @ _dense(kind, parts, sizes, stored, grad.dtype)", "return grad @ parts[0].to(grad.dtype)",
           (f"{QL}::test_a_quantized_base_computes_what_its_dequantized_weight_does[int8]",
            f"{LO}::test_adapters_on_every_layout_match_one_process[qlora-int8-zero2]")),
    Mutant("qlora-dense-base-kept-for-backward", "the quantized base dequantized outside its matmul's op: backward "
           "keeps a dense copy of every adapted weight (eager, and compiled)", "src/scaletrain/quant/frozen_base.py",
           "y = _frozen_linear(x.to(dtype), kind, parts, sizes, weight.dtype)",
           "y = F.linear(x.to(dtype), _dense(kind, parts, sizes, weight.dtype, dtype))",
           (f"{QL}::test_compiled_the_base_keeps_no_dense_weight_for_backward[nf4]",
            f"{QL}::test_compiled_the_base_keeps_no_dense_weight_for_backward[int8]")),
    Mutant("qlora-nf4-nibbles-swapped", "each byte's two NF4 codes read low nibble first (neighbouring weights "
           "swapped)", "src/scaletrain/quant/frozen_base.py",
           "torch.stack([high, low], dim=-1)", "torch.stack([low, high], dim=-1)",
           (f"{QL}::test_a_quantized_base_computes_what_its_dequantized_weight_does[nf4]",
            f"{QL}::test_only_the_adapters_train_over_a_quantized_base[nf4]")),
    Mutant("plan-frozen-base-has-optimizer-state", "the planner gives the frozen base gradients and optimizer "
           "state under adapters", "src/scaletrain/plan/memory_model.py",
           "out = model_state_memory(adapters.trainable, wl, layout, sh=sh)",
           "out = model_state_memory(counts, wl, layout, sh=sh)",
           (f"{QL}::test_the_planner_fits_a_70b_qlora_on_one_80gb_gpu_but_not_lora_or_full_fine_tuning",
            "tests/plan/test_planner_accuracy.py::test_adapter_prediction_matches_measurement[qlora nf4]")),
    # the Hugging Face families of model/families/ beyond GPT-2 and the Llama-likes (tests/model/test_hf_families.py)
    Mutant("olmo2-post-norms-swapped",
           "OLMo 2's post-attention and post-feedforward norms loaded into each other's place",
           "src/scaletrain/model/families/olmo2.py",
           '{**LLAMA_BLOCK, "attn_post_norm": "post_attention_layernorm",\n             "mlp_post_norm": '
           '"post_feedforward_layernorm"}',
           '{**LLAMA_BLOCK, "attn_post_norm": "post_feedforward_layernorm",\n             "mlp_post_norm": '
           '"post_attention_layernorm"}',
           (f"{HF}::test_import_export_and_generation_match_transformers[olmo2]",)),
    Mutant("post-norm-on-the-residual", "the norm after the MLP normalises the residual stream, not the MLP's output",
           "src/scaletrain/model/transformer.py",
           "return x + self.drop(_maybe(self.mlp_post_norm, self.ffn(_maybe(self.mlp_norm, x))))",
           "return _maybe(self.mlp_post_norm, x + self.drop(self.ffn(_maybe(self.mlp_norm, x))))",
           (f"{HF}::test_import_export_and_generation_match_transformers[olmo2]",
            f"{HF}::test_import_export_and_generation_match_transformers[gemma2]")),
    Mutant("neox-partial-rotary-over-all-dims",
           "partial rotary (GPT-NeoX's rotary_pct) turns every coordinate of a head",
           "src/scaletrain/model/transformer.py",
           "    d = cfg.rotary_dim  #", "    d = cfg.head_size  #",
           (f"{HF}::test_import_export_and_generation_match_transformers[neox-parallel]",
            f"{HF}::test_import_export_and_generation_match_transformers[phi4-partial]")),
    Mutant("neox-qkv-split-not-per-head", "GPT-NeoX's fused q/k/v split as [q; k; v] instead of per head",
           "src/scaletrain/model/families/gpt_neox.py",
           "[(h * 3 * d + j * d, h * 3 * d + (j + 1) * d) for h in range(cfg.n_heads)]",
           "[(j * cfg.dim + h * d, j * cfg.dim + (h + 1) * d) for h in range(cfg.n_heads)]",
           (f"{HF}::test_import_export_and_generation_match_transformers[neox-parallel]",
            f"{HF}::test_import_export_and_generation_match_transformers[neox-sequential]")),
    Mutant("neox-parallel-residual-in-turn",
           "the parallel residual's MLP reads the block input plus attention's output",
           "src/scaletrain/model/transformer.py",
           "self.drop(self.ffn(self.mlp_norm(x)))", "self.drop(self.ffn(self.mlp_norm(x + a)))",
           (f"{HF}::test_import_export_and_generation_match_transformers[neox-parallel]",)),
    Mutant("phi3-gate-up-swapped", "Phi-3's fused gate_up_proj split with the up rows taken as the gate",
           "src/scaletrain/model/families/phi3.py",
           '"mlp.gate_proj": ("mlp.gate_up_proj", (0, f)), "mlp.up_proj": ("mlp.gate_up_proj", (f, 2 * f))',
           '"mlp.gate_proj": ("mlp.gate_up_proj", (f, 2 * f)), "mlp.up_proj": ("mlp.gate_up_proj", (0, f))',
           (f"{HF}::test_import_export_and_generation_match_transformers[phi3]",)),
    Mutant("partial-rotary-rows-whole-head", "the rotate-half row permutation applied to the whole head under partial "
           "rotary (Phi-4, GPT-NeoX)", "src/scaletrain/model/hf.py",
           "rows_hf_to_ours(t, heads, cfg.rotary_dim) if heads else t", "rows_hf_to_ours(t, heads) if heads else t",
           (f"{HF}::test_import_export_and_generation_match_transformers[phi4-partial]",
            f"{HF}::test_import_export_and_generation_match_transformers[neox-parallel]")),
    Mutant("gemma-norm-weight-not-offset", "Gemma's RMSNorm scales by w, not (1 + w)",
           "src/scaletrain/model/layers.py",
           "return (y * (1.0 + self.weight.float())).type_as(x)", "return (y * self.weight.float()).type_as(x)",
           (f"{HF}::test_import_export_and_generation_match_transformers[gemma2]",
            f"{HF}::test_import_export_and_generation_match_transformers[gemma3]")),
    Mutant("gemma-query-scale-ignored", "the scores divided by sqrt(head_dim), not by sqrt(query_pre_attn_scalar)",
           "src/scaletrain/model/transformer.py",
           "self.scale = cfg.attn_scale_dim ** -0.5 if cfg.attn_scale_dim else None", "self.scale = None",
           (f"{HF}::test_import_export_and_generation_match_transformers[gemma2]",
            f"{HF}::test_import_export_and_generation_match_transformers[gemma3]")),
    Mutant("gemma3-local-rope-unused", "Gemma 3's sliding-window blocks turn at the global blocks' rotary base",
           "src/scaletrain/model/transformer.py",
           'return tables["local"] if self.cfg.is_local_block(index) else tables["rope"]', 'return tables["rope"]',
           (f"{HF}::test_import_export_and_generation_match_transformers[gemma3]",)),
    Mutant("sp-post-norm-grads-not-summed", "under sequence parallelism the norms after the sub-blocks (Gemma, OLMo 2) "
           "keep each rank's share of their weight's gradient", "src/scaletrain/parallel/tensor_parallel.py",
           '        plan.update({n: SequenceParallel(use_local_output=True) for n in ("attn_post_norm", '
           '"mlp_post_norm")\n                     if getattr(block, n) is not None})\n', "",
           (f"{HF}::test_imported_families_train_alike_under_zero3_tp_and_pp",)),
    Mutant("chat-loss-over-all-tokens", "the masked loss normalised by every token of the global batch, not by the "
           "counted ones", "src/scaletrain/train/trainer.py",
           "return self.data.dataset.counted_in_step(step, self.sampler) or self.step_tokens(step)",
           "return self.step_tokens(step)",
           (f"{CH}::test_first_step_loss_is_the_mean_over_the_assistants_tokens_and_the_prompt_gets_no_gradient",)),
    Mutant("chat-count-kept-across-steps", "the counted targets of the first step asked are kept for every later "
           "step (a per-step quantity cached across steps)", "src/scaletrain/data/dataset.py",
           "        if self._counted[0] != step:\n", "        if self._counted[0] < 0:\n",
           (f"{CH}::test_each_step_counts_its_own_batchs_targets",)),
    Mutant("chat-mask-shifted-by-one", "a window's targets masked by its inputs' mask (the mask read one token "
           "early)", "src/scaletrain/data/dataset.py",
           "self.mask.read(int(i) * T + 1, T)", "self.mask.read(int(i) * T, T)",
           (f"{CH}::test_first_step_loss_is_the_mean_over_the_assistants_tokens_and_the_prompt_gets_no_gradient",)),
    Mutant("chat-count-per-rank", "each data-parallel rank normalises by the tokens its own windows count, not "
           "the whole global batch's", "src/scaletrain/data/dataset.py",
           "self.counted_tokens(sampler(step).global_batch_indices(step))",
           "self.counted_tokens(np.concatenate(sampler(step).rank_micro_batches(step))) * sampler(step).dp_size",
           (f"{CH}::test_masked_loss_matches_one_process_on_every_layout",)),
    Mutant("chat-label-counted", "the plain format counts the \"Assistant: \" label with the answer",
           "src/scaletrain/data/chat.py",
           "            text += f\"{m['role'].capitalize()}: \"\n            start = len(text)\n",
           "            start = len(text)\n            text += f\"{m['role'].capitalize()}: \"\n",
           (f"{CH}::test_plain_format_masks_exactly_the_assistants_tokens",)),
    # fault tolerance across replica groups (parallel/fault_tolerance.py, tests/parallel/test_fault_tolerance.py)
    Mutant("ft-groups-read-the-same-windows", "every replica group reads group 0's share of the step's windows",
           "src/scaletrain/parallel/fault_tolerance.py",
           "self.data_outer = (replica_id, groups)", "self.data_outer = (0, groups)",
           (f"{FT}::test_three_groups_train_as_one_process_on_their_joint_batch_until_the_first_kill",)),
    Mutant("ft-heal-skips-the-weights", "a group healing from a peer takes its optimizer state and step, not its "
           "weights", "src/scaletrain/parallel/fault_tolerance.py",
           '                _local(p).copy_(peer["params"][n])\n', "                pass\n",
           (f"{FT}::test_a_group_healed_from_a_peer_holds_its_state_bit_for_bit",)),
    # kills at named phases (tests/ft_faults.py through ft-local's hidden --rank-hook)
    Mutant("ft-commits-a-broken-step", "a group commits a step whose gradient all-reduce failed (a group died in "
           "it): the vote ignored", "src/scaletrain/parallel/fault_tolerance.py",
           "        self.committed = self.manager.should_commit(timeout=self.vote_timeout)\n",
           "        self.committed = self.manager.should_commit(timeout=self.vote_timeout) or True\n",
           (f"{FT}::test_kills_at_each_phase_cost_at_most_the_step_they_break_and_no_restart_elsewhere",
            f"{FT}::test_a_run_with_kills_ends_where_a_clean_run_that_skipped_the_same_steps_ends")),
    Mutant("ft-heal-keeps-its-optimizer-state", "a group healing from a peer takes its weights and step but keeps "
           "its own optimizer state (none, or an older checkpoint's)", "src/scaletrain/parallel/fault_tolerance.py",
           '        _load_local_optimizer_state(self.optimizer, peer["optim"])\n', "        pass\n",
           (f"{FT}::test_a_group_healed_from_a_peer_holds_its_state_bit_for_bit",)),
    Mutant("ft-heal-keeps-its-skipped-count", "a group healing from a peer takes its step but not its count of "
           "skipped steps", "src/scaletrain/parallel/fault_tolerance.py",
           'self.state.step, self.state.skipped_steps = int(peer["step"]), int(peer["skipped_steps"])',
           'self.state.step = int(peer["step"])',
           (f"{FT}::test_a_group_healed_from_a_peer_holds_its_state_bit_for_bit",)),
    # any layout inside a replica group (tests/parallel/test_ft_layouts.py: 2 groups x 2 ranks, no launcher)
    Mutant("ft-groups-skip-sharded-grads", "the replica groups average the plain gradients only, not the local "
           "shards of DTensor ones (ZeRO-3, tensor parallel)", "src/scaletrain/parallel/fault_tolerance.py",
           "grads = [_local(p.grad) for _, p in named if p.grad is not None]",
           "grads = [p.grad for _, p in named if p.grad is not None and not hasattr(p.grad, 'to_local')]",
           (f"{FTL}::test_two_groups_of_a_layout_train_as_one_process_on_their_joint_batch[zero3]",
            f"{FTL}::test_two_groups_of_a_layout_train_as_one_process_on_their_joint_batch[tp2]")),
    Mutant("ft-group-ranks-read-overlapping-windows", "with data parallelism inside the replica groups, group r's "
           "ranks read from data-parallel rank r on (the groups' shares overlap)", "src/scaletrain/data/mix.py",
           "index * b.dp + dp_rank", "index + dp_rank",
           (f"{FTL}::test_two_groups_of_a_layout_train_as_one_process_on_their_joint_batch[zero3]",
            f"{FTL}::test_two_groups_of_a_layout_train_as_one_process_on_their_joint_batch[dp-replicate2]")),
    Mutant("ft-heal-leaves-sharded-optimizer-state", "a healing rank creates its optimizer state but does not copy "
           "its counterpart's local state tensors into it", "src/scaletrain/parallel/fault_tolerance.py",
           "                _local(mine[k]).copy_(v)\n", "                pass\n",
           (f"{FTL}::test_a_late_zero3_group_heals_from_its_peers_shards_and_then_holds_them_bit_for_bit[heal]",)),
    Mutant("ft-heal-keeps-its-own-loss-scale", "a healing group takes the peer's weights and optimizer state but "
           "keeps its own fp16 loss scale (the groups then average gradients scaled differently)",
           "src/scaletrain/parallel/fault_tolerance.py",
           "            self.scaler.load_state_dict(peer[\"scaler\"])\n", "            pass\n",
           (f"{FTL}::test_a_late_zero3_group_heals_from_its_peers_shards_and_then_holds_them_bit_for_bit[heal]",)),
    Mutant("ft-moe-loads-not-summed-over-groups", "each replica group moves its routing biases by its own tokens' "
           "load, not by the load summed over the groups", "src/scaletrain/parallel/fault_tolerance.py",
           "tensors = grads + [m.stats for m in self.moe.values()]", "tensors = grads",
           (f"{FTL}::test_routing_biases_move_by_the_load_of_every_group_as_for_the_joint_batch[ep2-zero3]",)),
    Mutant("ft-heal-keeps-its-own-biases", "a healing group takes its peer's weights but keeps its own routing "
           "biases", "src/scaletrain/parallel/fault_tolerance.py",
           "                m.expert_bias.copy_(peer[\"moe_bias\"][n])\n", "                pass\n",
           (f"{FTL}::test_a_late_zero3_group_heals_from_its_peers_shards_and_then_holds_them_bit_for_bit[heal]",)),
    Mutant("ft-local-waits-for-a-late-group", "ft-local never stops a group that came back after the others "
           "finished: it waits for a quorum that cannot form, times out and restarts until its restarts run out",
           "src/scaletrain/launch/replica_groups.py", "            elif time.monotonic() - finished[1] > grace_s:\n",
           "            elif False:\n",
           (f"{FT}::test_a_group_back_after_the_others_finished_is_stopped_and_the_run_ends_0",)),
    Mutant("ft-local-fails-a-run-it-stopped-a-group-of", "ft-local ends with the exit code of the late group it "
           "stopped, though the run finished", "src/scaletrain/launch/replica_groups.py",
           "    return next((c for r, c in enumerate(codes) if c and r not in stopped), 0)",
           "    return next((c for c in codes if c), 0)",
           (f"{FT}::test_a_group_back_after_the_others_finished_is_stopped_and_the_run_ends_0",)),
    # packing without cross-document attention (data.document_mask, tests/data/test_document_mask.py)
    Mutant("docmask-attends-across-documents", "a packed document's queries see the keys of the documents before "
           "it (the mask is plain causal)", "src/scaletrain/model/transformer.py",
           "(docs[:, :, None] == docs[:, None, :]) & causal", "(docs[:, :, None] >= docs[:, None, :]) & causal",
           (f"{DM}::test_a_packed_window_gives_each_document_the_losses_it_has_alone[rope]",)),
    Mutant("docmask-positions-not-restarted", "positions run on through the window instead of restarting at each "
           "document", "src/scaletrain/model/transformer.py",
           "mask, positions = document_mask(docs), document_positions(docs)",
           "mask, positions = document_mask(docs), None",
           (f"{DM}::test_rotary_positions_restart_at_each_document",
            f"{DM}::test_a_packed_window_gives_each_document_the_losses_it_has_alone[learned]")),
    Mutant("docmask-separator-opens-next-document", "a separator counted with the document after it (which then "
           "sees the one before)", "src/scaletrain/model/transformer.py",
           "return ends.cumsum(1) - ends", "return ends.cumsum(1)",
           (f"{DM}::test_a_packed_window_gives_each_document_the_losses_it_has_alone[rope]",)),
    Mutant("docmask-boundary-target-counted", "the target after a separator (the next document's first token) "
           "counted in the loss", "src/scaletrain/data/dataset.py",
           "counted &= inputs != self.separator", "counted &= inputs != -1",
           (f"{DM}::test_the_target_after_a_separator_is_not_counted",)),
    Mutant("ft-diloco-keeps-a-discarded-window", "a DiLoCo sync the replica groups did not commit leaves each "
           "group's own weights instead of taking it back to the last sync", "src/scaletrain/parallel/local_sgd.py",
           "                p.local.copy_(p.outer.to(p.local.device, non_blocking=True))\n            return\n",
           "                pass\n            return\n",
           (f"{FT}::test_diloco_across_groups_matches_its_simulation_and_discards_a_window_a_group_died_in",)),
    Mutant("ft-diloco-commits-without-the-vote", "a DiLoCo sync across replica groups is applied without torchft's "
           "commit vote (a window a group died in takes an outer step)", "src/scaletrain/parallel/fault_tolerance.py",
           "        if hook.manager.should_commit(timeout=hook.vote_timeout):\n",
           "        if hook.manager.should_commit(timeout=hook.vote_timeout) or True:\n",
           (f"{FT}::test_diloco_across_groups_matches_its_simulation_and_discards_a_window_a_group_died_in",)),
    Mutant("ft-mean-over-configured-groups", "the groups' gradient sum divided by the groups configured, not by "
           "those alive in the step's quorum (a divisor that agrees while every group lives)",
           "src/scaletrain/parallel/fault_tolerance.py",
           "flat[:sum(g.numel() for g in grads)] /= self.manager.num_participants()",
           "flat[:sum(g.numel() for g in grads)] /= self.groups",
           (f"{FT}::test_with_fewer_groups_alive_than_configured_the_step_is_the_mean_of_the_live_ones",)),
    Mutant("ft-vote-times-out-with-the-collective", "the commit vote waits one step timeout, no longer than a rank "
           "may hang in the groups' all-reduce (a group nobody killed fails its vote and restarts)",
           "src/scaletrain/parallel/fault_tolerance.py",
           "self.committed = self.manager.should_commit(timeout=self.vote_timeout)",
           "self.committed = self.manager.should_commit()",
           (f"{FT}::test_a_rank_killed_at_any_moment_of_a_step_restarts_its_own_group_alone",)),
    # the workers' inner learning rate (parallel.sync.inner_lr_scale; schedule.worker_lr_scale)
    Mutant("inner-lr-rule-unscaled", "parallel.sync.inner_lr_scale=0 (the square-root rule) leaves the workers at "
           "optim.lr", "src/scaletrain/schedule.py",
           "return par.sync.inner_lr_scale or 1.0 / math.sqrt(par.dp_replicate)",
           "return par.sync.inner_lr_scale or 1.0",
           ("tests/parallel/test_local_sgd.py::test_the_workers_inner_lr_follows_parallel_inner_lr_scale",
            "tests/parallel/test_local_sgd.py::test_the_workers_optimizer_steps_at_the_scaled_lr_as_in_their_simulation")),
    Mutant("inner-lr-simulation-unscaled", "verify's one-process simulation of the workers steps them at optim.lr, "
           "not at the scaled inner lr", "src/scaletrain/verify.py",
           "schedule = TrainSchedule.for_job(cfg, BatchSchedule(g, cfg.data.seq_len, g), total_steps)",
           "schedule = TrainSchedule(cfg.optim, BatchSchedule(g, cfg.data.seq_len, g), total_steps)",
           ("tests/parallel/test_local_sgd.py::test_the_workers_optimizer_steps_at_the_scaled_lr_as_in_their_simulation",)),
    # independent references (issue 48, round 3): known answers, reference libraries, directions
    Mutant("eval-counts-the-mask-the-run-did-not", "scaletrain eval of a chat run trained with data.loss_mask=false "
           "counts the answers alone (the run logged every token's loss)", "src/scaletrain/trained/evaluate.py",
           'masked = cfg.data.loss_mask != "false" and tokens.mask is not None', "masked = tokens.mask is not None",
           ("tests/train/test_eval.py::test_eval_of_a_mid_run_chat_checkpoint_gives_the_val_loss_logged_at_its_step"
            "[false]",)),
    Mutant("moe-bias-sign-flipped", "the routing bias moves towards the load (overloaded experts up): every "
           "layout moves it alike, so parity passes", "src/scaletrain/parallel/moe_balance.py",
           "torch.sign(loads[i].mean() - loads[i])", "torch.sign(loads[i] - loads[i].mean())",
           ("tests/model/test_moe.py::test_the_bias_moves_by_the_rate_against_each_experts_load",
            "tests/model/test_moe.py::test_after_a_bias_update_the_busiest_expert_gets_fewer_tokens_and_the_idlest_more")),
    Mutant("moe-aux-logged-per-choice", "the logged Switch loss divided by the choices (tokens x top_k), not the "
           "tokens", "src/scaletrain/parallel/moe_balance.py",
           'self.last["moe_aux_loss"] = aux / max(tokens, 1.0) / n',
           'self.last["moe_aux_loss"] = aux / max(choices, 1.0) / n',
           ("tests/model/test_moe.py::test_switch_and_z_losses_equal_their_values_worked_by_hand",)),
    Mutant("attention-dropout-in-eval", "attention drops weights in eval too (evaluation and generation noisy)",
           "src/scaletrain/model/transformer.py",
           "dropout_p=self.dropout if self.training else 0.0", "dropout_p=self.dropout",
           ("tests/model/test_model.py::test_each_dropout_draws_anew_in_training_and_is_off_in_eval[attention]",)),
    Mutant("capped-attention-dropout-in-eval", "soft-capped attention (Gemma 2) drops weights in eval too",
           "src/scaletrain/model/transformer.py", "self.dropout, self.training)", "self.dropout, True)",
           ("tests/model/test_model.py::test_each_dropout_draws_anew_in_training_and_is_off_in_eval"
            "[attention-softcapped]",)),
    Mutant("lora-dropout-after-a", "the adapters' dropout drops A's rank-r output, not the input x (PEFT: "
           "B A dropout(x))", "src/scaletrain/model/lora.py",
           "h = F.linear(self.dropout(rows) if dropping else rows, self.lora_a.to(x.dtype)) * self.scale",
           "h = self.dropout(F.linear(rows, self.lora_a.to(x.dtype))) * self.scale",
           (f"{LO}::test_a_chosen_subset_with_adapter_dropout_matches_peft_in_training_and_in_eval",)),
    Mutant("fp16-loss-factor-counts-every-token", "under fp16 loss scaling the loss is divided by the step's tokens, "
           "not its counted targets (alike where nothing is masked)", "src/scaletrain/train/trainer.py",
           "return (self.layout.dp if scale is None else scale) / self.loss_divisor()",
           "return self.layout.dp / self.loss_divisor() if scale is None else scale / self.step_tokens()",
           (f"{CH}::test_masked_loss_under_fp16_loss_scaling_tracks_fp32",)),
    Mutant("neox-layer-norm-eps-ignored", "GPT-NeoX's layer_norm_eps read as its default (the FAMILIES' configs "
           "keep the default)", "src/scaletrain/model/families/gpt_neox.py",
           'norm_eps=get.float("layer_norm_eps")', "norm_eps=1e-5",
           (f"{HF}::test_fields_off_their_defaults_are_read_and_give_transformers_logits[neox-sequential]",)),
    Mutant("gemma2-rms-norm-eps-ignored", "Gemma 2's rms_norm_eps read as its default",
           "src/scaletrain/model/families/gemma2.py",
           'norm="rmsnorm", norm_eps=get.float("rms_norm_eps"),', 'norm="rmsnorm", norm_eps=1e-6,',
           (f"{HF}::test_fields_off_their_defaults_are_read_and_give_transformers_logits[gemma2]",)),
    # preference optimization (issue 49): the objective's loss, its reference and its pairs
    Mutant("preference-accumulation-divided-twice", "each micro-batch's preference loss divided by the accumulation "
           "steps as well as by the step's pairs (ms-swift #10117)", "src/scaletrain/objectives/preference.py",
           "value = part.loss.total / pairs\n", "value = part.loss.total / pairs / self.t.layout.grad_accum\n",
           (f"{PT}::test_the_step_loss_and_gradients_equal_the_loss_written_out[sigmoid]",)),
    Mutant("preference-reference-with-adapters-on", "the reference log-probs taken from the policy with its adapters "
           "on (the reference moves with the policy)", "src/scaletrain/objectives/preference.py",
           "with adapters_off(self.t.pm.dp.modules):", "with adapters_off([]):",
           (f"{PT}::test_the_three_reference_modes_give_one_run[sigmoid]",)),
    Mutant("preference-prompt-counted", "the prompt's tokens counted in each sequence's log-prob (its targets kept)",
           "src/scaletrain/data/preference_dataset.py",
           "targets[r, :n] = torch.where(m[1:], s[1:], IGNORE_INDEX)", "targets[r, :n] = s[1:]",
           (f"{PT}::test_the_step_loss_and_gradients_equal_the_loss_written_out[simpo]",)),
    Mutant("preference-pairs-halved", "a micro-batch's rows paired as its first half against its second (right "
           "with one pair a micro-batch only)", "src/scaletrain/objectives/preference.py",
           "chosen, rejected = sums[0::2], sums[1::2]", "chosen, rejected = sums.view(2, -1)[0], sums.view(2, -1)[1]",
           (f"{PT}::test_the_step_loss_and_gradients_equal_the_loss_written_out[sigmoid]",)),
    Mutant("kto-kl-per-rank", "KTO's KL estimate from each rank's own examples, not the global batch's",
           "src/scaletrain/objectives/preference.py",
           "        if self.t.rt.distributed:  # tp and cp copies add to the sum and the count alike\n"
           "            dist.all_reduce(total)\n", "",
           (f"{PL}::test_a_layout_trains_like_one_process[kto-zero3]",)),
    Mutant("preference-cp-partial-sums", "under context parallelism each rank's loss from its own chunks' log-probs "
           "(a pair's sequence split across ranks, not summed over them)", "src/scaletrain/objectives/preference.py",
           "        sums = _SumOver.apply(sums, cp_group)\n", "",
           (f"{PL}::test_a_layout_trains_like_one_process[cp2-ring]",)),
    # RL (issue 50): the aggregation, the advantages, the old policy and the reference
    Mutant("rl-token-mean-per-micro-batch", "each micro-batch's RL loss its own mean, divided by the accumulation "
           "steps (verl #593, TRL #3021: wrong with uneven completion lengths)", "src/scaletrain/objectives/rl.py",
           "        return part.loss.total / self.divisor\n",
           "        return part.loss.total / part.loss.count / self.t.layout.grad_accum\n",
           (f"{RT}::test_the_second_update_of_a_round_equals_the_loss_written_out[dapo]",)),
    Mutant("rl-advantage-normalised-per-rank", "the advantages normalised over the rank's completions, not within "
           "each prompt's group", "src/scaletrain/objectives/rl.py",
           "adv = rl.group_advantages(rewards, self.cfg.group_size,",
           "adv = rl.group_advantages(rewards, len(rewards),",
           (f"{RT}::test_the_second_update_of_a_round_equals_the_loss_written_out[grpo]",)),
    Mutant("rl-old-logps-after-update", "the old policy's log-probs taken with the updated policy (the ratio always "
           "1, the clip never acts)", "src/scaletrain/objectives/rl.py",
           "old_logps=m.old, ref_logps=m.ref", "old_logps=None, ref_logps=m.ref",
           (f"{RT}::test_the_second_update_of_a_round_equals_the_loss_written_out[dr_grpo]",)),
    Mutant("rl-reference-with-adapters-on", "the RL reference log-probs from the policy with its adapters on",
           "src/scaletrain/objectives/rl.py", "with adapters_off(self.t.pm.dp.modules):", "with adapters_off([]):",
           (f"{RT}::test_the_reference_of_adapters_off_is_the_frozen_starting_copy",)),
    Mutant("rl-cp-sequence-mean-per-chunk", "under context parallelism the sequence mean divides each rank's chunk by "
           "its own token count, not the sequence's", "src/scaletrain/objectives/rl.py",
           "weights=m.weights, row_tokens=m.lengths)", "weights=m.weights, row_tokens=None)",
           (f"{RL}::test_a_layout_trains_like_one_process[grpo-cp2-ring]",)),
    # the window's boundary off by one, on each path that computes it
    Mutant("window-sliding-one-key-more", "the sliding window's mask lets a query see size + 1 keys (the rule every "
           "path asks)", "src/scaletrain/model/window.py", "(q - k < self.size)", "(q - k <= self.size)",
           (f"{WIN}::test_the_masks_are_transformers_masks[7]", f"{WINDOW_HF}[mistral]", ATTEND_BY_HAND)),
    Mutant("window-chunk-boundary-off-by-one", "chunked attention's chunks start one position late",
           "src/scaletrain/model/window.py", "(q // self.size == k // self.size)",
           "((q - 1) // self.size == (k - 1) // self.size)",
           (f"{WIN}::test_the_masks_are_transformers_masks[7]", ATTEND_BY_HAND)),
    Mutant("window-tile-misses-its-first-key", "the one-process kernel's tile leaves out the earliest key its "
           "first row sees (plain and soft-capped attention)", "src/scaletrain/model/window.py",
           "first = window.first_key(start)  #", "first = window.first_key(start) + 1  #",
           (f"{WINDOW_HF}[mistral]", f"{WINDOW_HF}[gemma2]", ATTEND_BY_HAND)),
    Mutant("window-one-wider-under-document-masks", "with packed documents the window lets a query see one key more",
           "src/scaletrain/model/window.py", "allowed = mask[:, :, start:stop, first:stop] & allowed",
           "allowed = mask[:, :, start:stop, first:stop] & Window(window.size + 1, window.chunked).allows("
           "positions[start:stop], positions[first:stop])",
           (f"{WIN}::test_packed_documents_past_the_window_give_each_documents_own_logits", ATTEND_BY_HAND)),
    Mutant("window-cache-drops-a-reachable-key", "generation's cache forgets the oldest key the next token's window "
           "still reaches", "src/scaletrain/model/kv_cache.py",
           "drop = window.first_key(self.length + k.shape[2]) - first",
           "drop = window.first_key(self.length + k.shape[2]) - first + 1",
           (f"{AP}::test_generation_with_the_cache_gives_the_whole_sequences_logits_and_keeps_only_the_window",
            f"{WINDOW_HF}[mistral]")),
    Mutant("cp-ring-window-one-wider", "ring attention's forward lets a query see one key more than the window",
           "src/scaletrain/parallel/context_parallel.py",
           "allowed = _allowed(seq, n, rank, (rank - step) % n, q.device, window)",
           "allowed = _allowed(seq, n, rank, (rank - step) % n, q.device, window and Window(window.size + 1, "
           "window.chunked))", (f"{WINDOW_PARITY}[2ranks]",)),
    Mutant("cp-allgather-window-one-wider", "allgather attention's forward lets a query see one key more than the "
           "window", "src/scaletrain/parallel/context_parallel.py",
           "allowed = causal_allows(window, chunk_positions(seq, n, rank, q.device)",
           "allowed = causal_allows(window and Window(window.size + 1, window.chunked), "
           "chunk_positions(seq, n, rank, q.device)", (f"{WINDOW_PARITY}[2ranks]",)),
    Mutant("cp-ulysses-window-one-wider", "Ulysses attention lets a query see one key more than the window",
           "src/scaletrain/parallel/context_parallel.py", "local_attention(q, k, v, window, None, kernel)",
           "local_attention(q, k, v, Window(window.size + 1, window.chunked), None, kernel)",
           (f"{WINDOW_PARITY}[2ranks]",)),
    # gpt-oss: the sink left out of the denominator, one path at a time, and the SwiGLU's clamp dropped
    Mutant("sink-left-out-of-one-process-attention", "plain, windowed, soft-capped, packed and cached attention "
           "leave the sink out of the softmax's denominator", "src/scaletrain/model/sinks.py",
           "torch.cat((scores, sink), dim=-1)", "torch.cat((scores, sink - float('inf')), dim=-1)",
           (f"{GO}::test_every_attention_path_puts_the_sink_in_the_denominator_with_its_gradient[sliding]",
            f"{GO}::test_import_export_and_gradients_match_transformers[alternating]",
            f"{GO}::test_a_sink_takes_its_share_of_equal_scores")),
    Mutant("sink-left-out-of-ring-attention", "ring attention merges its blocks without the sink",
           "src/scaletrain/parallel/context_parallel.py",
           "        if sinks is not None:  # once, after every block", "        if False:  # once, after every block",
           (f"{GOP}::test_context_parallel_attention_with_sinks_is_the_softmax_by_hand[ring]",)),
    Mutant("sink-once-per-ring-block", "ring attention adds the sink into every block's partial softmax, not once",
           "src/scaletrain/parallel/context_parallel.py",
           "            out, lse = _merge(out, lse, *_block_forward(q, _repeat_kv(kv[0], heads), _repeat_kv(kv[1], "
           "heads), allowed))\n",
           "            out, lse = _merge(out, lse, *(_block_forward(q, _repeat_kv(kv[0], heads), _repeat_kv(kv[1], "
           "heads), allowed) if sinks is None else fold_sink(*_block_forward(q, _repeat_kv(kv[0], heads), "
           "_repeat_kv(kv[1], heads), allowed), sinks)))\n",
           (f"{GOP}::test_context_parallel_attention_with_sinks_is_the_softmax_by_hand[ring]",)),
    Mutant("sink-gradient-dropped-by-ring", "ring attention's backward gives the sinks no gradient",
           "src/scaletrain/parallel/context_parallel.py",
           "        d_sinks = sink_gradient(sinks, lse, delta) if sinks is not None else None\n"
           "        return d_q.to(q.dtype), d_kv[0].to(k.dtype), d_kv[1].to(v.dtype), d_sinks, None, None, None, None, "
           "None",
           "        d_sinks = None\n"
           "        return d_q.to(q.dtype), d_kv[0].to(k.dtype), d_kv[1].to(v.dtype), d_sinks, None, None, None, None, "
           "None", (f"{GOP}::test_context_parallel_attention_with_sinks_is_the_softmax_by_hand[ring]",)),
    Mutant("sink-left-out-of-allgather-attention", "all-gather attention leaves the sink out of the denominator",
           "src/scaletrain/parallel/context_parallel.py",
           "        if sinks is not None:\n            out, lse = fold_sink(out, lse, sinks)\n",
           "        if False:\n            out, lse = fold_sink(out, lse, sinks)\n",
           (f"{GOP}::test_context_parallel_attention_with_sinks_is_the_softmax_by_hand[allgather]",)),
    Mutant("sink-left-out-of-ulysses-attention", "Ulysses attention runs its heads without their sinks",
           "src/scaletrain/parallel/context_parallel.py", "kernel = _sdpa if sinks is None else",
           "kernel = _sdpa if True else",
           (f"{GOP}::test_context_parallel_attention_with_sinks_is_the_softmax_by_hand[ulysses]",)),
    Mutant("sink-of-another-rank-under-tp", "tensor parallelism gives each rank the sinks of the first heads",
           "src/scaletrain/parallel/tensor_parallel.py", "    return attn.sinks.to_local()",
           "    return attn.sinks.full_tensor()[:attn.sinks.to_local().shape[0]]",
           (f"{GOP}::test_gpt_oss_trains_alike_under_every_layout",)),
    Mutant("swiglu-clamp-dropped", "gpt-oss's SwiGLU without its clamps", "src/scaletrain/model/mlp.py",
           "    gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)\n", "",
           (f"{GO}::test_the_clamped_swiglu_is_gpt_oss_gate",
            f"{GO}::test_import_export_and_gradients_match_transformers[alternating]")),
    Mutant("expert-biases-not-split-by-ep", "expert parallelism leaves the experts' biases whole on every rank",
           "src/scaletrain/parallel/expert_parallel.py",
           'EXPERT_WEIGHTS = ("w1", "w2", "w3", "b1", "b2", "b3")', 'EXPERT_WEIGHTS = ("w1", "w2", "w3")',
           (f"{GOP}::test_gpt_oss_trains_alike_under_every_layout",)),
    Mutant("tp-projection-norm-not-summed", "OLMo 2's q/k norms under tp take each rank's columns as the whole "
           "projection (no sum of squares over tp)", "src/scaletrain/parallel/tensor_parallel.py",
           "[Shard(args[0].dim() - 1)]", "[Replicate()]",
           (f"{WP}::test_olmo2_under_tp_gives_transformers_logits", f"{WINDOW_PARITY}[2ranks]",
            f"{HF}::test_imported_families_train_alike_under_zero3_tp_and_pp")),
    Mutant("planner-attention-ignores-the-window", "the FLOPs per token count every block's keys as the whole "
           "sequence", "src/scaletrain/model/flops.py",
           "keys = sum(key_span(cfg, seq_len, i) for i in full)", "keys = len(full) * seq_len",
           (f"{WIN}::test_the_planners_attention_flops_time_and_memory_follow_the_window",)),
    Mutant("muon-newton-schulz-on-a-shard", "Muon orthogonalises each rank's shard of a matrix instead of the whole",
           "src/scaletrain/optim/whole.py",
           "    if not isinstance(p, DTensor):\n        return []\n",
           "    if True:\n        return []\n",
           (f"{MUP}::test_parity_with_one_process[2ranks-zero1]", f"{MUP}::test_parity_with_one_process[2ranks-tp2-sp]",
            f"{MU}::test_whole_matrices_on_4_ranks_equal_torch_newton_schulz_and_send_what_theory_says")),
    Mutant("muon-two-axes-result-to-the-wrong-tp-piece", "under ZeRO x tp the owner sends each rank the piece of "
           "the result that belongs to its neighbour on the tp axis", "src/scaletrain/optim/whole.py",
           "                rows, cols = axis.pieces[m.param][r]\n                results[r]",
           "                rows, cols = axis.pieces[m.param][r ^ 1 if axis.n == 4 else r]\n                results[r]",
           (f"{MU}::test_whole_matrices_on_4_ranks_equal_torch_newton_schulz_and_send_what_theory_says",
            f"{MUP}::test_parity_with_one_process[4ranks-zero3-tp2]")),
    Mutant("muon-tall-matrix-not-transposed", "Newton-Schulz iterates a tall matrix as it is (the Gram matrix of the "
           "longer side) instead of its transpose", "src/scaletrain/optim/muon.py",
           "    tall = g.size(0) > g.size(1)\n", "    tall = g.size(0) < g.size(1)\n",
           (f"{MU}::test_three_steps_equal_torch_muon_and_adamw_bit_for_bit[match_rms_adamw]",)),
    Mutant("muon-lr-adjusted-by-the-shard-shape", "Muon's learning-rate adjustment reads the shard's shape, not the "
           "whole matrix's", "src/scaletrain/optim/muon.py",
           'adjusted_lr(lr, group["adjust_lr"], p.shape)', 'adjusted_lr(lr, group["adjust_lr"], _local(p).shape)',
           (f"{MUP}::test_parity_with_one_process[2ranks-zero1]",
            f"{MUP}::test_parity_with_one_process[2ranks-zero3]")),
    Mutant("muon-takes-vectors", "the automatic split sends 1-D parameters (norms, biases) to Muon",
           "src/scaletrain/optim/muon.py",
           "take = p.ndim >= 2 and not any", "take = p.ndim >= 1 and not any",
           (f"{MU}::test_the_split_takes_block_and_expert_matrices_and_leaves_embeddings_head_norms",
            f"{MU}::test_three_steps_equal_torch_muon_and_adamw_bit_for_bit[match_rms_adamw]")),
    Mutant("mla-rotary-on-the-latent", "latent attention turns the compressed latent (its first rope_dim "
           "coordinates) instead of the decoupled shared key", "src/scaletrain/model/mla.py",
           "        k_rot = apply_rope(self.shared_key(k_rot).unsqueeze(2), *rope).squeeze(2)  # (B, T, rope_dim)\n",
           "        k_rot, latent = self.shared_key(k_rot), apply_rope(latent.unsqueeze(2), *rope).squeeze(2)\n",
           (f"{DS}::test_import_then_export_matches_transformers[plain-query-groups]",
            f"{DS}::test_import_then_export_matches_transformers[ungrouped-tied]")),
    Mutant("tp-latent-shared-key-not-summed", "under tp the rotated key every head shares gets each rank's partial "
           "gradient, not their sum", "src/scaletrain/parallel/tensor_parallel.py",
           "        block.attn.shared_key = partial(_copy_to_region, group=tp_mesh.get_group())\n",
           "        pass\n",
           (f"{DSP}::test_deepseek_shaped_model_trains_like_one_process[tp2]",
            f"{DSP}::test_deepseek_shaped_model_trains_like_one_process[tp2-sp]")),
    Mutant("cp-latent-mscale-dropped", "context parallelism attends latent attention's queries at the methods' "
           "1/sqrt(head_dim), without YaRN's mscale", "src/scaletrain/parallel/context_parallel.py",
           "        q = q * factor\n", "        q = q\n",
           (f"{DSP}::test_deepseek_shaped_model_trains_like_one_process[cp2-ring]",
            f"{DSP}::test_deepseek_shaped_model_trains_like_one_process[cp2-ulysses]")),
    Mutant("moe-groups-by-their-best", "group-limited routing scores a group by its best expert, not the sum of its "
           "two best", "src/scaletrain/model/moe.py",
           "group_score = grouped.topk(2, dim=-1).values.sum(-1)", "group_score = grouped.amax(-1)",
           (f"{DS}::test_import_then_export_matches_transformers[plain-query-groups]",
            f"{DS}::test_import_then_export_matches_transformers[query-latent-yarn]")),
    Mutant("moe-groups-without-the-bias", "group-limited routing opens the groups by the unbiased scores (the "
           "routing bias added after)", "src/scaletrain/model/moe.py",
           "            biased = self.open_groups(biased)\n",
           "            biased = self.open_groups(scores.detach()) + self.expert_bias\n",
           (f"{DS}::test_import_then_export_matches_transformers[plain-query-groups]",
            f"{DS}::test_import_then_export_matches_transformers[query-latent-yarn]")),
    Mutant("rollout-logprobs-of-the-filtered-distribution", "the rollout's log-probs taken after top-k/top-p "
           "(renormalised), not of the whole distribution the trainer computes", "src/scaletrain/rollout/local.py",
           "        lps = full_logprobs(s, nxt)\n",
           "        lps = full_logprobs(filtered_probs(s, p.top_k, p.top_p).log(), nxt)\n",
           (f"{RO}::test_rollout_log_probs_are_the_trainer_forwards[gpt2]",)),
    Mutant("rollout-draws-seeded-by-batch-position", "a completion's generator seeded by its prompt's place in "
           "the call, not in the step: a rank's share draws what no single process would",
           "src/scaletrain/rollout/local.py",
           "completion_generator(params.seed, first_index + i, j, device)",
           "completion_generator(params.seed, i, j, device)",
           (f"{RO}::test_batched_equals_one_prompt_at_a_time[gpt2]",
            f"{ROL}::test_two_ranks_sample_what_one_process_does[zero3]")),
    Mutant("rollout-top-p-keeps-one-too-few", "top-p drops the token that brings the kept mass up to top_p",
           "src/scaletrain/rollout/sampling.py",
           "        drop_sorted = before >= top_p", "        drop_sorted = ordered.cumsum(-1) >= top_p",
           (f"{RS}::test_which_tokens_can_be_drawn_by_hand",
            f"{RS}::test_the_kept_tokens_are_those_of_transformers_warpers")),
    Mutant("rollout-length-limit-counts-as-a-stop", "a completion cut by max_new_tokens reported finished, as if "
           "it had stopped (DAPO's overlong masks read it)", "src/scaletrain/rollout/local.py",
           "            self.finished[b] = self._stops(self.completions[b])\n",
           "            self.finished[b] = self._stops(self.completions[b]) or len(self.completions[b]) == "
           "p.max_new_tokens\n",
           (f"{RO}::test_stop_ids_end_a_completion_at_their_first_draw_and_are_kept",)),
    Mutant("rollout-padding-seen-by-the-cache", "sequence parallelism's padding left in the cache (not rewound): "
           "the next tokens attend to it", "src/scaletrain/model/generate.py",
           "    if pad and cache is not None:\n        cache.rewind(pad)\n", "",
           (f"{RO}::test_padding_each_forward_to_a_multiple_changes_no_token[llama-gqa]",
            f"{ROL}::test_two_ranks_sample_what_one_process_does[tp2-sp]")),
    Mutant("rollout-ranks-do-not-agree-on-forwards", "a ZeRO-3 rank stops its forwards when its own prompts are "
           "done: the others' gathers wait for it", "src/scaletrain/rollout/local.py",
           "        if self.group is None:\n            return mine\n",
           "        if True:\n            return mine\n",
           (f"{ROL}::test_two_ranks_sample_what_one_process_does[zero3]",)),
    # Llama 4 (issue 52, point 3): each new part, against transformers, by hand and across layouts
    Mutant("llama4-chunk-boundary-off-by-one", "chunked attention's chunks start one position late (held by Llama 4's "
           "own logits and generation)", "src/scaletrain/model/window.py", "(q // self.size == k // self.size)",
           "((q - 1) // self.size == (k - 1) // self.size)", (L4_HF, L4_GENERATE)),
    Mutant("llama4-nope-blocks-rotate", "the no-rope blocks are given the rotary tables (and lose the temperature)",
           "src/scaletrain/model/transformer.py",
           'if self.cfg.is_nope_block(index):\n            return tables["nope"]',
           'if False:\n            return tables["nope"]', (L4_HF,)),
    Mutant("llama4-router-weight-on-the-output", "the router's sigmoid weight scales the expert's output instead of "
           "its input", "src/scaletrain/model/moe.py", "if self.scale_input:  # Llama 4",
           "if not self.scale_input:  # Llama 4",
           (L4_HF, f"{L4}::test_an_expert_scaled_at_its_input_by_hand")),
    Mutant("llama4-temperature-one-position-early", "the query temperature counts positions from 0, not 1",
           "src/scaletrain/model/nope.py", "torch.floor((p + 1.0) / cfg.attn_temperature_floor)",
           "torch.floor(p / cfg.attn_temperature_floor)",
           (L4_HF, f"{L4}::test_the_query_temperature_and_the_weightless_norm_by_hand")),
    Mutant("llama4-l2-norm-in-the-no-rope-blocks", "the weightless q/k norm also acts in the no-rope blocks",
           "src/scaletrain/model/transformer.py", "            q = rope.apply(q)\n",
           "            q = rope.apply(l2_heads(q, self.l2_eps))\n            k = l2_heads(k, self.l2_eps)\n",
           (L4_HF,)),
    Mutant("llama4-cache-temperature-from-zero", "generation's cached steps take the temperature of positions from 0",
           "src/scaletrain/model/transformer.py",
           'nope = _query_scale(getattr(self, "attn_temp", None), past, positions)',
           'nope = _query_scale(getattr(self, "attn_temp", None), 0, positions)', (L4_GENERATE,)),
    Mutant("llama4-cp-temperature-not-cut", "under context parallelism the temperature table is left uncut: a rank "
           "scales its tokens by the factors of positions 0, 1, ...", "src/scaletrain/parallel/context_parallel.py",
           "model.attn_temp = model.attn_temp[positions]", "model.attn_temp = model.attn_temp  # uncut",
           (L4_PARITY,)),
    Mutant("llama4-export-keeps-rotate-half-rows", "the export writes q_proj and k_proj in rotate-half row order",
           "src/scaletrain/model/families/llama4_text.py", "out[key] = interleaved(t, heads).contiguous()",
           "out[key] = t.contiguous()", (L4_HF,)),
    Mutant("delta-rule-decays-after-the-write", "the recurrent delta rule decays the state after the token's write, "
           "not before it", "src/scaletrain/model/deltanet.py",
           "        s = s * g[:, t].exp()[..., None, None]  # decay before the update\n"
           "        predicted = torch.einsum(\"bhkv,bhk->bhv\", s, k[:, t])\n"
           "        write = beta[:, t, :, None] * (v[:, t] - predicted)  # (B, H, dv)\n"
           "        s = s + k[:, t, :, :, None] * write[:, :, None, :]\n",
           "        predicted = torch.einsum(\"bhkv,bhk->bhv\", s, k[:, t])\n"
           "        write = beta[:, t, :, None] * (v[:, t] - predicted)  # (B, H, dv)\n"
           "        s = s + k[:, t, :, :, None] * write[:, :, None, :]\n"
           "        s = s * g[:, t].exp()[..., None, None]\n",
           (f"{QN}::test_the_delta_rule_decays_before_it_writes_by_hand", QN_FORMS, QN_GENERATE)),
    Mutant("chunked-delta-rule-decays-after-the-write", "the chunked delta rule leaves each position's own decay "
           "out of its write (an exclusive cumulative sum)", "src/scaletrain/model/deltanet.py",
           "g[:, :, start:start + chunk].cumsum(-1)\n",
           "g[:, :, start:start + chunk].cumsum(-1) - g[:, :, start:start + chunk]\n",
           (f"{QN}::test_the_delta_rule_decays_before_it_writes_by_hand", QN_FORMS, QN_HF)),
    Mutant("conv-state-not-carried", "generation starts each new token's convolution from zeros, not the inputs "
           "before it", "src/scaletrain/model/deltanet.py",
           "before = state[0] if state is not None else x.new_zeros", "before = x.new_zeros",
           (QN_GENERATE,)),
    Mutant("zero-centred-norm-without-its-one", "the zero-centred RMSNorm scales by its weight, not (1 + weight)",
           "src/scaletrain/model/layers.py", "return (y * (1.0 + self.weight.float())).type_as(x)",
           "return (y * self.weight.float()).type_as(x)", (QN_HF,)),
    Mutant("attention-output-gate-dropped", "the gated full attention leaves out its output gate",
           "src/scaletrain/model/transformer.py", "return self.wo(y if gate is None else y * torch.sigmoid(gate))",
           "return self.wo(y)", (QN_HF,)),
    Mutant("shared-expert-gate-dropped", "the shared expert's sigmoid gate is left out",
           "src/scaletrain/model/moe.py", "                shared = torch.sigmoid(self.shared_gate(flat)) * shared\n",
           "                pass\n", (QN_HF,)),
    Mutant("linear-heads-of-another-rank-under-tp", "under tp every rank reads the first ranks' convolution and "
           "decay parameters", "src/scaletrain/parallel/tensor_parallel.py",
           "return _CopyToRegion.apply(t, group)[rank * n:(rank + 1) * n]", "return _CopyToRegion.apply(t, group)[:n]",
           (QN_PARITY,)),
    Mutant("mtp-predicts-the-next-token", "each multi-token prediction depth is trained on the main head's target "
           "(the next token) instead of the token k + 1 ahead", "src/scaletrain/model/mtp.py",
           "torch.where(chain, targets[:, k:], IGNORE)", "torch.where(chain, targets[:, :T - k], IGNORE)",
           (MTP_HAND, f"{MTP}::test_depth_targets_by_hand")),
    Mutant("mtp-reads-the-current-token", "a depth embeds the token at its own position, not the one k ahead",
           "src/scaletrain/model/transformer.py", "ahead = self.tok_emb(tokens_ahead(tokens, k))",
           "ahead = self.tok_emb(tokens)", (MTP_HAND, f"{DSM}::test_depth_one_equals_transformers_mtp_layer")),
    Mutant("mtp-counts-the-end-of-the-window", "the last k positions, which have no token k + 1 ahead in the "
           "window, are counted (with the main head's targets)", "src/scaletrain/model/mtp.py",
           "    out = torch.full_like(targets, IGNORE)\n", "    out = targets.clone()\n",
           (MTP_HAND, f"{MTP}::test_depth_targets_by_hand")),
    Mutant("mtp-counts-across-documents", "a depth's chain of targets is not checked: predictions across a "
           "document's end (or a masked target) are counted", "src/scaletrain/model/mtp.py",
           "        chain &= counted[:, j:T - k + j]\n", "        pass\n",
           (f"{MTP}::test_packed_documents_equal_the_documents_run_one_by_one",
            f"{MTP}::test_depth_targets_count_only_unbroken_chains")),
    Mutant("mtp-weight-not-divided-by-depth", "the depths' losses are weighed by lambda, not lambda / D",
           "src/scaletrain/model/mtp.py", "self.weight / self.depth * sum(per_depth)", "self.weight * sum(per_depth)",
           (MTP_HAND,)),
    Mutant("mtp-hidden-after-the-final-norm", "the first depth reads the main model's normalised output, not its "
           "last block's", "src/scaletrain/model/transformer.py", "*self._depths(h, tokens, tables, mask)",
           "*self._depths(self.norm(h), tokens, tables, mask)",
           (MTP_HAND, f"{DSM}::test_depth_one_equals_transformers_mtp_layer")),
    Mutant("mtp-hidden-first", "eh_proj reads [hidden; embedding] (the report's order) where the checkpoints' "
           "columns are [embedding; hidden]", "src/scaletrain/model/mtp.py",
           "torch.cat([self.enorm(ahead), self.hnorm(h)], dim=-1)", "torch.cat([self.hnorm(h), self.enorm(ahead)], "
           "dim=-1)", (MTP_HAND, f"{DSM}::test_depth_one_equals_transformers_mtp_layer")),
    Mutant("mtp-export-says-no-modules", "the export writes the modules but num_nextn_predict_layers=0",
           "src/scaletrain/model/families/deepseek_v3.py", "num_nextn_predict_layers=cfg.mtp_depth",
           "num_nextn_predict_layers=0", (f"{DSM}::test_export_then_reload_gives_the_same_bytes[plain-query-groups]",)),
    Mutant("mtp-metrics-of-one-rank", "each depth's logged loss is rank 0's alone, not summed over data parallel",
           "src/scaletrain/parallel/mtp_metrics.py", "            dist.all_reduce(both, group=group)\n",
           "            pass\n", (f"{DSM}::test_training_with_mtp_equals_one_process[ddp2]",)),
    Mutant("planner-mtp-parameters-left-out", "the planner counts no parameters for the prediction depths",
           "src/scaletrain/plan/params.py", "        for j in range(cfg.mtp_depth):  # multi-token prediction's",
           "        for j in range(0):  # multi-token prediction's",
           (f"{MTP}::test_the_planner_counts_the_depths_parameters_by_hand",)),

]


# --------------------------------------------------------------------------------------------


def copy_tree(dest: Path) -> None:
    """The files git knows of (tracked, and untracked but not ignored), as they are now."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        src = REPO / name
        if src.is_file():  # a tracked file deleted in the working tree is left out
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)


def plant(tree: Path, m: Mutant) -> str:
    """Apply the mutant in `tree`; returns the file's original text."""
    path = tree / m.file
    text = path.read_text()
    found = text.count(m.old)
    if found != 1:
        raise SystemExit(f"mutations: mutant {m.name}: the text to replace is in {m.file} {found} times, not once; "
                         f"update the mutant to the code as it is now:\n{m.old}")
    path.write_text(text.replace(m.old, m.new))
    return text


@dataclass
class Outcome:
    ran: int
    failed: list[tuple[str, str]]  # (test id, margin: "N x tolerance", "exact check" or "error: Type")
    seconds: float
    problem: str = ""  # pytest could not run the tests at all

    @property
    def numeric(self) -> list[float]:
        return [float(m.split("x")[0]) for _, m in self.failed if m[0].isdigit()]

    @property
    def best(self) -> str:
        if self.numeric:
            return f"{max(self.numeric):.3g}x"
        return self.failed[0][1] if self.failed else "-"

    @property
    def caught(self) -> bool:
        return bool(self.failed) and not self.problem

    @property
    def enough(self) -> bool:
        exact = any(not m[0].isdigit() for _, m in self.failed)
        return self.caught and (exact or max(self.numeric, default=0.0) >= REQUIRED_MARGIN)


_MARGIN = re.compile(r"([0-9.]+(?:e[+-]?\d+)?)x tolerance")


def margin_of(failure: ET.Element) -> str:
    """What a failing test reports: its margin, or that it was an exact check or an error."""
    message = failure.get("message") or ""
    found = [float(x) for x in _MARGIN.findall(message + "\n" + (failure.text or ""))]
    if found:
        return f"{max(found):.3g}x tolerance"
    if failure.tag == "error":  # in a fixture: a group of processes that failed, typically
        return "error in setup"
    if message.startswith(("AssertionError", "assert ")):
        return "exact check"
    return f"error: {message.split(':')[0].splitlines()[0] or 'exception'}"


def run_tests(tree: Path, tests: tuple[str, ...], report: Path, timeout: float) -> Outcome:
    env = {**os.environ, "PYTHONPATH": str(tree / "src"), "OMP_NUM_THREADS": "1"}
    t0 = time.perf_counter()
    try:
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}",
                            *tests], cwd=tree, env=env, capture_output=True, text=True, timeout=timeout)
        output = r.stdout + r.stderr
    except subprocess.TimeoutExpired:
        return Outcome(0, [], time.perf_counter() - t0, f"the tests ran past {timeout:.0f} s")
    seconds = time.perf_counter() - t0
    if not report.exists():
        return Outcome(0, [], seconds, "pytest wrote no report: " + output.strip().splitlines()[-1])
    cases = ET.parse(report).getroot().iter("testcase")
    ran, failed = 0, []
    for case in cases:
        ran += 1
        bad = case.find("failure")
        bad = bad if bad is not None else case.find("error")
        if bad is not None:
            failed.append((f"{case.get('classname', '').split('.')[-1]}::{case.get('name')}", margin_of(bad)))
    if ran == 0 or "no tests ran" in output or "ERROR: not found" in output:
        return Outcome(ran, failed, seconds, "no test ran (a node id is wrong?): " + output.strip().splitlines()[-1])
    return Outcome(ran, failed, seconds)


def table(results: list[tuple[Mutant, Outcome]]) -> str:
    lines = ["| mutant | bug planted | caught by (margin over the test's tolerance) | tests passing | caught |",
             "|---|---|---|---|---|"]
    for m, o in results:
        missed = f"**no**{': ' + o.problem if o.problem else ''}"
        verdict = "yes" if o.enough else ("below 100x" if o.caught else missed)
        by = "; ".join(f"`{test}` ({margin.replace(' tolerance', '')})" for test, margin in o.failed) or "-"
        lines.append(f"| {m.name} | {m.what} (`{m.file.removeprefix('src/scaletrain/')}`) | {by} | "
                     f"{o.ran - len(o.failed)} of {o.ran} | {verdict} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="*", help="mutants to plant (default: all)")
    ap.add_argument("--list", action="store_true", help="print the mutants and their tests, plant nothing")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per mutant's tests (default 900)")
    ap.add_argument("--verbose", action="store_true", help="print each failing test and its margin")
    args = ap.parse_args(argv)
    unknown = set(args.names) - {m.name for m in MUTANTS}
    if unknown:
        ap.error(f"no mutant named {', '.join(sorted(unknown))}; --list shows them")
    chosen = [m for m in MUTANTS if not args.names or m.name in args.names]
    if args.list:
        for m in chosen:
            print(f"{m.name}: {m.what} ({m.file})")
            for t in m.tests:
                print(f"    {t}")
        return 0
    results = []
    with tempfile.TemporaryDirectory(prefix="scaletrain-mutations-") as tmp:
        tree = Path(tmp) / "tree"
        copy_tree(tree)
        for m in chosen:  # every mutant checked against the code before any test runs
            (tree / m.file).write_text(plant(tree, m))
        t0 = time.perf_counter()
        for m in chosen:
            original = plant(tree, m)
            try:
                outcome = run_tests(tree, m.tests, Path(tmp) / f"{m.name}.xml", args.timeout)
            finally:
                (tree / m.file).write_text(original)
            results.append((m, outcome))
            print(f"{m.name}: {len(outcome.failed)} of {outcome.ran} test(s) failed, best margin {outcome.best} "
                  f"({outcome.seconds:.0f} s){' — ' + outcome.problem if outcome.problem else ''}", flush=True)
            if args.verbose:
                for test, margin in outcome.failed:
                    print(f"    {test}: {margin}")
    print(f"\n{table(results)}\n\n{len(results)} mutant(s) in {(time.perf_counter() - t0) / 60:.1f} min; "
          f"a mutant is caught when a test fails by at least {REQUIRED_MARGIN:.0f}x its tolerance, or an exact "
          "check or an error stops it")
    return 0 if all(o.enough for _, o in results) else 1


if __name__ == "__main__":
    sys.exit(main())
