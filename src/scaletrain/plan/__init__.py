"""The planner: will it fit, and which layout is fastest — before anyone spends GPU hours.

    from scaletrain.plan import plan
    result = plan("llama-8b", hardware="H100-SXM", nodes=1, gpus_per_node=8, seq_len=8192, global_batch=64)
    result["layouts"][0].layout, result["explanation"]

See docs/planner.md for the model behind the figures and their calibration.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from scaletrain.config import SyncConfig
from scaletrain.errors import ConfigError
from scaletrain.hardware import Hardware, lookup
from scaletrain.plan.memory_model import GiB, module_memory
from scaletrain.plan.options import SYNC_KEYS, config_key, derive_layout, fixed_fields
from scaletrain.plan.params import ParamCounts, total_and_active
from scaletrain.plan.search import (
    Evaluated,
    calibration_sources,
    enumerate_layouts,
    evaluate,
    explain,
    layout_errors,
    rank_key,
    savers,
    search,
    slow_link,
    workers_comparison,
)
from scaletrain.plan.spec import Cluster, Layout, ModelSource, Workload, load_model
from scaletrain.plan.time_model import estimate_module_time
from scaletrain.vocab import ZERO_STAGES

__all__ = ["Cluster", "Evaluated", "Layout", "Workload", "plan", "resolve_layout"]


def plan(model: Any, *, hardware: str | Hardware = "H100-SXM", nodes: int = 1, gpus_per_node: int = 8,
         seq_len: int = 2048, global_batch: int = 256, precision: str = "bf16-mixed", optimizer: str = "adamw",
         attention: str = "flash", layout: Layout | dict | None = None, top_k: int = 10,
         activations: str = "formula", hardware_file: str | None = None, gpu: bool | None = None,
         engine: str | None = None, compile: bool | None = None, fp8: bool | None = None, workers: int = 1,
         workers_link: float | None = None, sync: dict | None = None, calibrate=None,
         moe_imbalance: float | None = None, name: str | None = None, adapter: str = "none", adapter_rank: int = 8,
         adapter_targets: str = "all-linear", base_dtype: str = "auto", qat: str = "none",
         document_mask: bool = False, reference: str = "none", objective: str = "lm", rl_group: int = 0,
         rl_new_tokens: int = 0, rl_updates: int = 1, rl_old_pass: bool = False) -> dict:
    """Search the layouts (or evaluate `layout`) for `model` on the cluster. Returns a dict with
    "layouts" (Evaluated, best first), "explanation" (lines), "stats", and the inputs. `engine`,
    `compile` and `fp8` default to a model TOML's [plan] table, else scaletrain, off, off.

    `workers` sites of the cluster joined by `workers_link` GB/s: the search tries local SGD /
    DiLoCo (`sync`: Layout's dp_sync, sync_every, sync_fragments, sync_delay, sync_dtype;
    default DiLoCo every 50 steps) beside synchronous training when that link is slow, and the
    explanation says where it overtakes. `sync` with a local dp_sync also applies to a fixed
    `layout`.

    `calibrate`: the plan is for this machine (one node of `gpus_per_node` local ranks) and its
    step times come from the machine's calibration (`scaletrain.plan.calibrate`), which this
    function gives: `scaletrain.measure.calibration` (what is missing measured first) or any
    function of (model config, probes, optimizers, ranks, device type) returning a Calibration.

    `moe_imbalance`: a mixture of experts' load, max / mean tokens per expert (at least 1): the
    busiest expert-parallel rank computes and receives that much more than the mean. Not given:
    the calibration's measured load where the plan is calibrated, else 1 (balanced, as
    published figures force the router).

    `name`: what the report calls the model (default: its preset, file or class name).

    `adapter`, `adapter_rank`, `adapter_targets`, `base_dtype`: a LoRA / QLoRA fine-tune (the
    config's adapter.*): the base frozen, its adapted linears stored as `base_dtype`. `qat`: the
    config's train.qat; `document_mask` its data.document_mask. `reference`: a preference run's reference
    log-probs (Workload.reference; its global batch counts sequences, two a pair). `objective="rl"` with `rl_group`
    completions per prompt of at most `rl_new_tokens`, sampled every `rl_updates` steps (`rl_old_pass`: a forward
    for the sampling policy's log-probs before each update): the rollouts' cache and time (scaletrain.plan.rl),
    its global batch counted in completions. Every layout ranked is one
    `scaletrain train` accepts with these (scaletrain.legality, asked by the search as by the job)."""
    src = load_model(model)
    if name:
        src = replace(src, name=name)
    engine = engine if engine is not None else src.extra.get("engine", "scaletrain")
    compile = compile if compile is not None else bool(src.extra.get("compile", False))
    fp8 = fp8 if fp8 is not None else bool(src.extra.get("fp8", False))
    fp8 = fp8 or precision == "fp8"  # the trainer's fp8 mode runs its linears so: plan them so
    hw = hardware if isinstance(hardware, Hardware) else lookup(hardware, hardware_file)
    if nodes < 1 or gpus_per_node < 1:
        raise ConfigError("--nodes and --gpus-per-node must be at least 1")
    _check_workers(workers, workers_link, nodes * gpus_per_node)
    cluster = Cluster(hw, nodes, gpus_per_node, workers, workers_link)
    sync = {**DEFAULT_SYNC, **(sync or {})}
    candidates = sync if sync["dp_sync"] != "step" else {**sync, "dp_sync": "diloco"}
    if top_k < 1:
        raise ConfigError(f"--top must be at least 1, got {top_k}")
    wl = Workload(seq_len=seq_len, global_batch=global_batch, precision=precision, optimizer=optimizer,
                  attention=attention, engine=engine, compile=compile, fp8=fp8,
                  moe_imbalance=1.0 if moe_imbalance is None else moe_imbalance, adapter=adapter,
                  adapter_rank=adapter_rank, adapter_targets=adapter_targets, base_dtype=base_dtype, qat=qat,
                  document_mask=document_mask, reference=reference, objective=objective, rl_group=rl_group,
                  rl_new_tokens=rl_new_tokens, rl_updates=rl_updates, rl_old_pass=rl_old_pass)
    gpu = hw.name != "CPU" if gpu is None else gpu
    if fp8 and "fp8" not in hw.peak_tflops:
        raise ConfigError(f"--fp8{' (or --precision fp8)' if precision == 'fp8' else ''}: hardware {hw.name} has no "
                          "fp8 peak in the catalog; plan without fp8")
    result = {"model_name": src.name, "cfg": src.cfg, "workload": wl, "cluster": cluster, "stats": None}
    if src.cfg is None:
        return _plan_module(src, wl, cluster, layout, top_k, result, gpu)
    stretched = []
    if src.cfg.max_seq_len < seq_len:  # planning a longer context than the model's: say so
        stretched.append(f"Sequence {seq_len} is above {src.name}'s max_seq_len {src.cfg.max_seq_len}: planned as if "
                         f"it were {seq_len} (train it with --model.max_seq_len={seq_len}, or plan --seq-len "
                         f"{src.cfg.max_seq_len}).")
        src.cfg = replace(src.cfg, max_seq_len=seq_len)
    if moe_imbalance is not None and not src.cfg.moe_experts:
        raise ConfigError(f"--moe-imbalance {moe_imbalance:g} is a mixture of experts' load, but {src.name} is dense "
                          "(model.moe_experts=0); drop it")
    if src.cfg.attn_softcap and attention == "flash":
        raise ConfigError(f"--attention flash: model.attn_softcap={src.cfg.attn_softcap:g} caps the attention scores, "
                          "which no fused kernel does, so scaletrain computes them as plain matmuls; plan with "
                          "--attention eager")
    if src.cfg.attn_sinks and attention == "flash":
        raise ConfigError("--attention flash: model.attn_sinks=true adds a sink to each softmax's denominator, which "
                          "scaletrain computes as plain matmuls (no fused kernel of PyTorch's takes it); plan with "
                          "--attention eager")
    result["num_params"], result["active_params"] = total_and_active(src.cfg)
    result["moe_imbalance"] = ("given" if moe_imbalance is not None else "balanced") if src.cfg.moe_experts else None
    if layout is not None:
        fixed = resolve_layout(layout, cluster, wl)
        if sync["dp_sync"] != "step":
            fixed = replace(fixed, **sync)
        errors = layout_errors(src.cfg, wl, cluster, fixed)
        if errors:
            raise ConfigError(*(f"layout {fixed.describe()}: {e}" for e in errors))
        if calibrate:
            cluster = result["cluster"] = calibrated(src.cfg, wl, cluster, [fixed], gpu, calibrate)
            wl = result["workload"] = _measured_load(src.cfg, wl, cluster, [fixed], result, moe_imbalance)
        ev = evaluate(src.cfg, wl, cluster, fixed, gpu=gpu, activations=activations)
        result["layouts"] = [ev]
        result["explanation"] = stretched + [f"{fixed.describe()}: " + ("fits" if ev.fits else "; ".join(ev.why_not))]
        if calibrate:
            result["explanation"].append(calibration_sources(cluster.calibration))
        if not ev.fits and not isinstance(layout, Layout):  # what else the keys given allow
            result["explanation"].append(_keeping(layout, fixed, src.cfg, wl, cluster, gpu))
        if not ev.fits:
            result["explanation"] += savers(ev, src.cfg, wl, cluster, gpu)
        if workers > 1:
            result["explanation"] += workers_comparison(src.cfg, wl, cluster, fixed, candidates, gpu=gpu)
        result["explanation"] += moe_lines(src.cfg, wl, cluster, ev, result)
        return result
    if calibrate:
        cluster = result["cluster"] = calibrated(src.cfg, wl, cluster, None, gpu, calibrate)
        wl = result["workload"] = _measured_load(src.cfg, wl, cluster, None, result, moe_imbalance)
    ranked, stats = search(src.cfg, wl, cluster, top_k=top_k, gpu=gpu, activations=activations,
                           sync=candidates if slow_link(cluster) else None)
    result["stats"] = stats
    result["layouts"] = ranked[:top_k]
    result["explanation"] = stretched + explain(ranked[0], ranked, src.cfg, wl, cluster, gpu)
    if workers > 1:
        if (outer := ranked[0].layout.outer) is not None:
            result["explanation"].append(f"{outer.mode} is in the search because the link between the "
                                         "sites is slow (below the network inside a site, per GPU)")
        result["explanation"] += workers_comparison(src.cfg, wl, cluster, ranked[0].layout, candidates, gpu=gpu)
    result["explanation"] += moe_lines(src.cfg, wl, cluster, ranked[0], result, ranked)
    return result


def _measured_load(cfg, wl: Workload, cluster: Cluster, layouts: list[Layout] | None, result: dict,
                   given: float | None) -> Workload:
    """The workload with the expert load the calibration measured (unless one was given)."""
    from scaletrain.plan.calibrate import layout_key

    if given is not None or not cfg.moe_experts:
        return wl
    cal = cluster.calibration
    keys = sorted({layout_key(cfg, wl, lay) for lay in layouts} if layouts else set(cal.compute))
    load = cal.imbalance(keys)
    if load is None:
        return wl
    result["moe_imbalance"] = "calibration"
    return replace(wl, moe_imbalance=max(1.0, load))


def moe_lines(cfg, wl: Workload, cluster: Cluster, best: Evaluated, result: dict,
              ranked: list[Evaluated] | None = None) -> list[str]:
    """What a mixture of experts' plan assumes and what expert parallelism does here, in words."""
    if not cfg.moe_experts:
        return []
    lay, t = best.layout, best.time
    source = {"given": "given (--moe-imbalance)",
              "calibration": "measured by this machine's calibration (the router at initialisation on random "
                             "tokens; a trained router's, from a run's moe_imbalance metric, is usually larger)",
              "balanced": "assumed balanced: published figures force-balance the router; give a run's measured "
                          "moe_imbalance with --moe-imbalance"}[result["moe_imbalance"]]
    lines = [f"Mixture of experts: {result['num_params'] / 1e9:.2f}B parameters in all, "
             f"{result['active_params'] / 1e9:.2f}B active per token ({cfg.moe_top_k} of {cfg.moe_experts} experts"
             f"{f' + {cfg.moe_shared_experts} shared' if cfg.moe_shared_experts else ''} in {cfg.moe_blocks} of "
             f"{cfg.n_layers} blocks); MFU counts the active ones. Expert load (max / mean tokens per expert) "
             f"{wl.moe_imbalance:g}, {source}."]
    if lay.ep > 1:
        from scaletrain.plan.params import expert_shard_ranks
        from scaletrain.plan.time_model import ep_traffic

        buffer, calls = ep_traffic(cfg, wl, lay)
        n = expert_shard_ranks(lay, wl.engine)
        zero = lay.expert_zero if wl.engine == "scaletrain" else lay.zero
        held = (f"ZeRO-{zero} over the {n} ranks holding the same ones" +
                (", their weights whole" if lay.zero == 3 and zero == 2 else "")) if zero and n > 1 else "unsharded"
        lines.append(f"Expert parallel {lay.ep}{ep_ranks_words(lay)}: each rank holds {cfg.moe_experts // lay.ep} of "
                     f"{cfg.moe_experts} "
                     f"experts ({held}); {calls} "
                     f"all-to-alls per MoE block and micro-batch of {buffer * (lay.ep - 1) / lay.ep / 2**20:.1f} MiB "
                     f"each leaving a rank cost {1e3 * t.ep_comm_s:.0f} ms per step on the critical path.")
    elif ranked:
        with_ep = next((e for e in ranked if e.fits and e.layout.ep > 1), None)
        if with_ep is not None:
            lines.append(f"Without expert parallelism: the best with it ({with_ep.layout.describe()}) reaches "
                         f"{with_ep.time.tokens_per_s:,.0f} tokens/s, its all-to-alls "
                         f"{1e3 * with_ep.time.ep_comm_s:.0f} ms per step.")
    return lines


def ep_ranks_words(lay) -> str:
    """Where expert parallelism's ranks come from, in words, where they span cp or tp ranks
    ("" within dp_shard): each ep group is ep neighbours of a replica group's dp_shard × cp × tp
    ranks, tp innermost (`Layout.build_expert_mesh`), each rank routing tokens of its own."""
    spans, inner = [], 1
    for name, size in (("tp", lay.tp), ("cp", lay.cp), ("dp_shard", lay.dp_shard)):
        if size > 1 and inner < lay.ep:
            spans.append((name, min(size, -(-lay.ep // inner))))
            inner *= size
    borrowed = {name for name, _ in spans}
    if not borrowed & {"tp", "cp"}:
        return ""
    whose = "; ".join(w for a, w in (("tp", "each tp rank routes its own sequence shard"),
                                     ("cp", "each cp rank routes its own chunks of the sequences")) if a in borrowed)
    return f" (ranks borrowed from {' × '.join(f'{n} {k}' for n, k in reversed(spans))}: {whose})"


def calibrated(cfg, wl: Workload, cluster: Cluster, layouts: list[Layout] | None, gpu: bool, measure) -> Cluster:
    """`cluster` (the machine at hand, one node) with its calibration for `layouts` — by default
    every layout the search would rank that fits in memory — from `measure` (plan's `calibrate`)."""
    from scaletrain.plan import calibrate

    if cluster.nodes != 1:
        raise ConfigError(f"a calibrated plan is for the machine at hand (1 node); this one has {cluster.nodes}")
    if layouts is None:
        layouts = [lay for lay in enumerate_layouts(cfg, wl, cluster, offload=gpu)
                   if evaluate(cfg, wl, cluster, lay, gpu=gpu).fits]
    cal = measure(cfg, calibrate.probes_for(cfg, wl, layouts), [(wl.optimizer, wl.precision)], cluster.world,
                  "cuda" if gpu else "cpu")
    return replace(cluster, calibration=cal)


# local SGD / DiLoCo settings the planner tries when none are given: the config's defaults
# (DiLoCo's paper: H in the hundreds; scaletrain's parallel.sync.every is 50)
DEFAULT_SYNC = {name: getattr(SyncConfig, key.rpartition(".")[2]) for key, name in SYNC_KEYS.items()}


def _check_workers(workers: int, link: float | None, world: int) -> None:
    if workers < 1:
        raise ConfigError(f"--workers must be at least 1, got {workers}")
    if workers > 1 and link is None:
        raise ConfigError(f"--workers {workers} splits the cluster into sites; give the link between them: "
                          "--workers-link GBPS")
    if link is not None and link <= 0:
        raise ConfigError(f"--workers-link must be a positive bandwidth in GB/s, got {link:g}")
    if world % workers:
        raise ConfigError(f"--workers {workers} does not divide the cluster's {world} GPUs into equal sites")


def _keeping(given: dict, fixed: Layout, cfg, wl: Workload, cluster: Cluster, gpu: bool) -> str:
    """When the layout the keys given derive does not fit: the search over the layouts that keep
    those keys (the rest free), its fastest that fits or, if none does, its leanest."""
    kept = fixed_fields(given)
    candidates = {replace(lay, **{f: getattr(fixed, f) for f in kept}) for lay in
                  enumerate_layouts(cfg, wl, cluster, offload=gpu)}
    ranked = sorted((evaluate(cfg, wl, cluster, lay, gpu=gpu) for lay in candidates
                     if not layout_errors(cfg, wl, cluster, lay)), key=rank_key)
    keys = ", ".join(f"{config_key(f)}={_text(getattr(fixed, f))}" for f in sorted(kept))
    if not ranked:
        return f"No other layout keeps {keys}."
    best = ranked[0]
    if best.fits:
        now = fixed.config_overrides()  # the options that train it
        options = ": " + " ".join(f"--{k}={_text(v)}" for k, v in best.layout.config_overrides().items()
                                  if now.get(k) != v)
        return (f"Keeping {keys}, {best.layout.describe()} fits ({best.memory.total / GiB:.1f} GiB per GPU, "
                f"{best.time.tokens_per_s:,.0f} tokens/s), the fastest of {len(ranked):,} that keep them{options}")
    return (f"No layout that keeps {keys} fits: the leanest of {len(ranked):,} ({best.layout.describe()}) "
            f"{best.why_not[0]}. Use more GPUs, a shorter sequence or a smaller global batch, or leave those keys "
            "to the planner.")


def _text(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def resolve_layout(given: Layout | dict, cluster: Cluster, wl: Workload) -> Layout:
    """A layout from the options given — config keys ("parallel.zero"), Layout's field names or
    the plan command's short names ("ac", "schedule", "virtual", "offload", "cp") — with what
    is left out derived as the config derives it (`scaletrain.plan.options.derive_layout`)."""
    if isinstance(given, Layout):
        return given
    return derive_layout(given, cluster.world, wl.global_batch)


def _plan_module(src: ModelSource, wl: Workload, cluster: Cluster, layout, top_k: int, result: dict, gpu: bool):
    """An arbitrary nn.Module: counted parameters, activations traced whole, FLOPs ≈ 6N per token;
    data parallelism and ZeRO only (its structure is unknown to tensor and pipeline parallelism).
    Memory and time come from the planner's models (`module_memory`, `estimate_module_time`)."""
    import torch

    from scaletrain.plan.trace import traced_module_bytes

    if wl.engine != "scaletrain" or wl.fp8:
        raise ConfigError("an nn.Module is planned for scaletrain's trainer only (engine scaletrain, no fp8)")
    module = src.module
    params = [p for p in module.parameters()]
    n = sum(p.numel() for p in params)
    result["num_params"] = n
    mats = tuple((p.shape[0], p[0].numel()) for p in params if p.ndim >= 2)
    counts = ParamCounts(sharded=0, replicated=n, matmul=n, matrices=mats)
    vocab = next((m.num_embeddings for m in module.modules() if isinstance(m, torch.nn.Embedding)), None)
    if vocab is None:
        raise ConfigError(f"{src.name}: the planner feeds token ids to a module; this one has no nn.Embedding")
    hw = cluster.hardware
    candidates = [resolve_layout(layout, cluster, wl)] if layout is not None else \
        [lay for lay in _module_layouts(cluster, wl)]
    evaluated = []
    act_cache: dict[int, float] = {}
    for lay in candidates:
        if lay.tp > 1 or lay.pp > 1 or lay.ep > 1 or lay.activation_checkpointing != "none":
            raise ConfigError("for an nn.Module the planner covers data parallelism and ZeRO only "
                              "(tp=1, pp=1, ep=1, ac none)")
        if lay.micro_batch not in act_cache:
            act_cache[lay.micro_batch] = traced_module_bytes(module, wl, lay.micro_batch, vocab)
        m = module_memory(counts, wl, lay, act_cache[lay.micro_batch], gpu=gpu)
        ev = Evaluated(lay, m, estimate_module_time(n, wl, lay, cluster), hw.memory_bytes)
        if not ev.fits:
            ev.why_not.append(f"needs {m.total / GiB:.1f} GiB per GPU of {hw.memory_bytes / GiB:.1f}")
        evaluated.append(ev)
    evaluated.sort(key=rank_key)
    result["layouts"] = evaluated[:top_k]
    best = evaluated[0]
    result["explanation"] = [f"Best: {best.layout.describe()} — {best.time.tokens_per_s:,.0f} tokens/s "
                             f"({'fits' if best.fits else best.why_not[0]}); FLOPs counted as 6N per token, "
                             "activations traced on fake tensors."]
    return result


def _module_layouts(cluster: Cluster, wl: Workload):
    dp = cluster.world
    if wl.global_batch % dp:
        raise ConfigError(f"the global batch {wl.global_batch} does not divide into {dp} GPUs")
    per_rank = wl.global_batch // dp
    for zero in ((0,) if dp == 1 else ZERO_STAGES):
        for mb in [m for m in range(1, min(per_rank, 16) + 1) if per_rank % m == 0]:
            yield Layout(dp_shard=dp, zero=zero, micro_batch=mb, grad_accum=per_rank // mb)
