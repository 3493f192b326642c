"""The planner's answers for people (a table, a breakdown, a chart) and for programs (JSON).

JSON schema (`scaletrain plan --json`), version 1:

    {
      "schema": "scaletrain.plan/1",
      "model": {"name": str, "num_params": int,                     # every parameter (all experts)
                "active_params": int,              # those a token multiplies by (MFU's count: flops.py)
                "moe_imbalance": float | null,     # a mixture's expert load planned (max / mean)
                "config": {ModelConfig fields} | null},
      "workload": {"seq_len", "global_batch", "precision", "optimizer", "attention",
                   "engine", "compile", "fp8"},
      "cluster": {"hardware": str, "nodes": int, "gpus_per_node": int, "memory_bytes": int},
      "search": {"layouts": int, "fit": int, "seconds": float},      # absent for a fixed layout
      "layouts": [                                                   # best first
        {"layout": {dp_replicate, dp_shard, tp, pp, cp, ep, zero, sp, schedule, virtual, micro_batch,
                    grad_accum, ac, offload},               # cp, ep: context-, expert-parallel ranks
         "describe": str,
         "memory": {"params", "grads", "master", "optimizer", "activations", "logits_loss",
                    "comm_buffers", "reserve", "total", "host"},          # bytes per rank
         "fits": bool, "capacity": int, "host_capacity": int,   # host: bytes per GPU, 0 = unknown
         "step_time_s": float, "tokens_per_s": float, "mfu": float,
         "time": {compute_s, tp_comm_s, cp_comm_s, ep_comm_s, pp_comm_s, dp_comm_s, dp_exposed_s, bubble_s,
                  optimizer_s, step_time_s, tokens_per_s, mfu, model_flops, hardware_flops,
                  bubble_fraction},
         "why_not": [str]}                                            # why it does not fit
      ],
      "explanation": [str]
    }
"""

from __future__ import annotations

import dataclasses
import json

from scaletrain.plan.memory_model import RESERVE_FRACTION, GiB, MemoryBreakdown
from scaletrain.plan.search import Evaluated

SCHEMA = "scaletrain.plan/1"


def to_json(result: dict) -> str:
    ev: list[Evaluated] = result["layouts"]
    payload = {
        "schema": SCHEMA,
        "model": {"name": result["model_name"], "num_params": result["num_params"],
                  "active_params": result.get("active_params", result["num_params"]),
                  "moe_imbalance": result["workload"].moe_imbalance if result.get("moe_imbalance") else None,
                  "config": dataclasses.asdict(result["cfg"]) if result["cfg"] is not None else None},
        "workload": dataclasses.asdict(result["workload"]),
        "cluster": {"hardware": result["cluster"].hardware.name, "nodes": result["cluster"].nodes,
                    "gpus_per_node": result["cluster"].gpus_per_node,
                    "memory_bytes": result["cluster"].hardware.memory_bytes},
        "layouts": [e.to_dict() for e in ev],
        "explanation": result["explanation"],
    }
    if result.get("stats"):
        payload["search"] = result["stats"]
    return json.dumps(payload, indent=2)


def _how_trained(wl, cfg=None) -> str:
    """The engine and knobs, when they are not scaletrain's defaults (with fp8, the share of the
    blocks' matmul FLOPs that the layer rule converts, when the model config is known)."""
    fp8 = "fp8 matmuls"
    if wl.fp8 and cfg is not None:
        from scaletrain.quant.layers import fp8_share

        fp8 += f" ({fp8_share(cfg):.0%} of the blocks' linear FLOPs; smaller layers stay bf16)"
    parts = ([f"engine {wl.engine}"] if wl.engine != "scaletrain" else []) + \
        (["torch.compile"] if wl.compile else []) + ([fp8] if wl.fp8 else [])
    return "; " + ", ".join(parts) if parts else ""


def param_count(n: float, scale: float) -> str:
    """`n` parameters in billions, or in millions for a model (`scale`: its total) under a billion."""
    return f"{n / 1e9:.2f}B" if scale >= 1e9 else f"{n / 1e6:.2f}M"


def table(result: dict) -> str:
    cl, wl = result["cluster"], result["workload"]
    total, active = result["num_params"], result.get("active_params")
    params = f"{param_count(total, total)} parameters" + \
        (f" ({param_count(active, total)} active)" if result["cfg"] is not None and result["cfg"].moe_experts else "")
    lines = [f"model {result['model_name']}: {params}; "
             f"{cl.nodes} × {cl.gpus_per_node} × {cl.hardware.name} ({cl.hardware.memory_bytes / GiB:.1f} GiB each); "
             f"sequence {wl.seq_len}, global batch {wl.global_batch}{wl.batch_note}, {wl.precision}, {wl.optimizer}"
             + _how_trained(wl, result.get("cfg"))]
    if result.get("stats"):
        s = result["stats"]
        lines.append(f"searched {s['layouts']:,} layouts in {s['seconds']:.2f} s; {s['fit']:,} fit")
    lines.append("")
    width = max([len(e.layout.describe()) for e in result["layouts"]] + [6])
    lines.append(f"{'#':>3}  {'layout':<{width}}  {'GiB/GPU':>8}  {'fits':>4}  {'step s':>8}  "
                 f"{'tokens/s':>11}  {'MFU':>6}")
    for i, e in enumerate(result["layouts"], 1):
        lines.append(f"{i:>3}  {e.layout.describe():<{width}}  {e.memory.total / GiB:>8.1f}  "
                     f"{'yes' if e.fits else 'NO':>4}  {e.time.step_time_s:>8.3f}  {e.time.tokens_per_s:>11,.0f}  "
                     f"{100 * e.time.mfu:>5.1f}%")
    return "\n".join(lines)


def breakdown(e: Evaluated) -> str:
    m, t = e.memory, e.time
    lines = [f"memory per GPU{f' (pipeline rank {m.stage}, the fullest)' if m.stage else ''}:"]
    for c in MemoryBreakdown.COMPONENTS:
        v = getattr(m, c)
        label = c.replace("_", " ")
        if c == "reserve":
            label = f"reserve ({int(100 * RESERVE_FRACTION)}% + runtime)"
        lines.append(f"  {label:<26}{v / GiB:>9.2f} GiB")
    lines.append(f"  {'total':<26}{m.total / GiB:>9.2f} GiB of {e.capacity / GiB:.2f}"
                 + ("" if m.total <= e.capacity else "  — DOES NOT FIT"))
    rows = sum(getattr(m, c) for c in MemoryBreakdown.COMPONENTS)
    if f"{rows / GiB:.2f}" != f"{m.total / GiB:.2f}":  # the engine's peak: not every row is alive at once
        lines.append(f"  (the rows sum to {rows / GiB:.2f} GiB, but not all are alive at once: the total is the most "
                     "held at one moment — backward's activations with the gradients made by then, or the "
                     "gradients at their largest at the optimizer step — plus the reserve)")
    for note in m.notes:  # what an objective adds (a reference copy's weights, RL's rollout cache)
        if note.startswith(("rl", "preference")):
            lines.append(f"  {note}")
    if m.host:
        of = f" of {e.host_capacity / GiB:.2f} (the GPU's share of its node's RAM)" if e.host_capacity else \
            " (the node's RAM is unknown: not checked)"
        lines.append(f"  {'in host memory (offload)':<26}{m.host / GiB:>9.2f} GiB{of}"
                     + ("" if e.host_fits else "  — DOES NOT FIT"))
    lines.append("time per step:")
    tp_label = "tensor-parallel comm" if not t.calibrated else "tp comm (in compute)"
    engine = t.calibrated and t.optimizer_s == 0 and e.layout.pp == 1  # the trainer's engine, measured whole
    for label, v in (("compute", t.compute_s), (tp_label, t.tp_comm_s),
                     *((("context-parallel (exposed)", t.cp_comm_s),) if e.layout.cp > 1 else ()),
                     *((("expert all-to-all", t.ep_comm_s),) if e.layout.ep > 1 else ()),
                     ("pipeline sends (exposed)", t.pp_comm_s), ("pipeline bubble", t.bubble_s),
                     ("data-parallel comm" if not engine else "engine (dp, optimizer)", t.dp_comm_s),
                     ("  of which exposed", t.dp_exposed_s),
                     ("optimizer step", t.optimizer_s),
                     *((("reference forward", t.reference_s),) if t.reference_s else ()),
                     *((("rollouts (sampling, old pass)", t.rollout_s),) if t.rollout_s else ())):
        lines.append(f"  {label:<26}{1e3 * v:>9.1f} ms")
    lines.append(f"  {'step':<26}{1e3 * t.step_time_s:>9.1f} ms  → {t.tokens_per_s:,.0f} tokens/s, "
                 f"MFU {100 * t.mfu:.1f}% ({t.model_flops / 1e12:,.0f} model TFLOP, "
                 f"{t.hardware_flops / 1e12:,.0f} hardware TFLOP per step)")
    for why in e.why_not:
        lines.append(f"does not fit: {why}")
    return "\n".join(lines)


def chart(result: dict, path: str, top: int = 8) -> None:
    from scaletrain.errors import ConfigError

    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("--chart needs matplotlib: pip install matplotlib (or 'scaletrain[plot]')") from None
    layouts = result["layouts"][:top]
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(layouts) + 2), 5))
    bottom = [0.0] * len(layouts)
    colors = ["#4c78a8", "#f58518", "#e45756", "#72b7b2", "#54a24b", "#eeca3b", "#b279a2", "#9d755d"]
    for comp, color in zip(MemoryBreakdown.COMPONENTS, colors):
        values = [getattr(e.memory, comp) / GiB for e in layouts]
        ax.bar(range(len(layouts)), values, bottom=bottom, color=color, label=comp.replace("_", " "))
        bottom = [b + v for b, v in zip(bottom, values)]
    capacity = result["cluster"].hardware.memory_bytes / GiB
    ax.axhline(capacity, color="black", linestyle="--", linewidth=1)
    ax.text(len(layouts) - 0.5, capacity, f" {result['cluster'].hardware.name} {capacity:.0f} GiB",
            va="bottom", ha="right", fontsize=8)
    ax.set_xticks(range(len(layouts)), [f"#{i + 1}\n{e.time.tokens_per_s / 1e3:,.1f}k tok/s"
                                        for i, e in enumerate(layouts)], fontsize=8)
    ax.set_ylabel("GiB per GPU")
    ax.set_title(f"{result['model_name']} on {result['cluster'].nodes}×{result['cluster'].gpus_per_node} "
                 f"{result['cluster'].hardware.name}: memory of the top layouts")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
