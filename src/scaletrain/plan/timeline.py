"""Pipeline schedules drawn as timelines: `scaletrain schedule`.

Each schedule is written as the order in which every rank runs its operations — F (forward),
B (backward), or for zero-bubble I (gradient of the input) and W (gradient of the weights) —
and a small simulator places them in time: an operation starts when its rank is free and
what it needs has finished (a stage's forward needs the previous stage's forward of that
micro-batch; a backward needs the next stage's backward). Forward takes 1 unit, backward 2
(input and weight gradients 1 each), a chunk of an interleaved stage 1/v of that.

The bubble is each rank's idle time over its busy time; the textbook values are (p-1)/m for
GPipe and 1F1B and (p-1)/(v·m) for interleaved 1F1B (Narayanan et al. 2021); ZB-V idles
(p-1)/2 forward-times in all, whatever m, which is (p-1)/(6m) of its work.
"""

from __future__ import annotations

from dataclasses import dataclass

from scaletrain.errors import ConfigError
from scaletrain.vocab import PP_SCHEDULES as SCHEDULES
from scaletrain.vocab import is_multi_chunk, unknown


@dataclass(frozen=True)
class Op:
    kind: str  # F, B, I or W
    mb: int  # micro-batch
    chunk: int  # which of the rank's chunks (0 .. v-1)


@dataclass
class Placed:
    op: Op
    stage: int
    start: float
    end: float


# --------------------------------------------------------------------------------------------
# The order each rank runs its operations in


def gpipe_order(p: int, m: int, r: int) -> list[Op]:
    return [Op("F", i, 0) for i in range(m)] + [Op("B", i, 0) for i in range(m)]


def one_f_one_b_order(p: int, m: int, r: int) -> list[Op]:
    warmup = min(p - 1 - r, m)  # forwards in flight before the first backward
    ops = [Op("F", i, 0) for i in range(warmup)]
    for i in range(m - warmup):  # steady state: one forward, one backward
        ops += [Op("F", warmup + i, 0), Op("B", i, 0)]
    ops += [Op("B", i, 0) for i in range(m - warmup, m)]  # cool-down
    return ops


def interleaved_order(p: int, m: int, r: int, v: int) -> list[Op]:
    """Megatron's interleaved 1F1B: micro-batches go through the chunks in groups of p."""
    total = m * v

    def fwd(k: int) -> Op:
        group, within = divmod(k, p * v)
        return Op("F", group * p + within % p, within // p)

    def bwd(k: int) -> Op:
        group, within = divmod(k, p * v)
        return Op("B", group * p + within % p, v - 1 - within // p)

    warmup = min((p - r - 1) * 2 + (v - 1) * p, total)
    ops = [fwd(k) for k in range(warmup)]
    for k in range(total - warmup):
        ops += [fwd(warmup + k), bwd(k)]
    ops += [bwd(k) for k in range(total - warmup, total)]
    return ops


def zero_bubble_v_order(p: int, m: int, r: int) -> list[Op]:
    """The ZB-V schedule (Qi et al. 2024, section 6): two chunks per rank in a V (rank r holds
    stage r going down and stage 2p-1-r coming back), backward split into I and W, and the
    weight gradients deferred into what would be bubbles."""
    ops: list[Op] = []
    f = [0, 0]  # next forward micro-batch of chunk 0 and 1
    i = [0, 0]  # next input-gradient
    w = [0, 0]  # next weight-gradient

    def add(kind: str, chunk: int) -> None:
        counter = {"F": f, "I": i, "W": w}[kind]
        if counter[chunk] < m:
            ops.append(Op(kind, counter[chunk], chunk))
        counter[chunk] += 1

    n = max(2 * p - 1, m)  # the phases are written for at least 2p-1 micro-batches
    for _ in range(2 * (p - r) - 1):  # warm-up: fill the way down
        add("F", 0)
    for _ in range(r):
        add("F", 1)
        add("F", 0)
    for _ in range(p - r):  # the bottom of the V turns around at once
        add("F", 1)
        add("I", 1)
        add("W", 1)
    while f[1] < f[0] or f[0] < n:  # steady state
        if f[0] < n:
            add("F", 0)
        add("I", 0)
        add("W", 0)
        add("F", 1)
        add("I", 1)
        add("W", 1)
    for _ in range(r):  # cool-down: input gradients first, weights fill the gaps
        add("I", 0)
        add("I", 1)
    for _ in range(p - r):
        add("I", 0)
        add("W", 0)
    while w[1] < i[1]:
        add("W", 1)
    while w[0] < i[0]:
        add("W", 0)
    return ops


def rank_orders(schedule: str, p: int, m: int, v: int) -> tuple[list[list[Op]], callable]:
    """Per-rank operation orders, and the map (rank, chunk) -> global stage index."""
    if schedule == "gpipe":
        return [gpipe_order(p, m, r) for r in range(p)], lambda r, c: r
    if schedule == "1f1b":
        return [one_f_one_b_order(p, m, r) for r in range(p)], lambda r, c: r
    if schedule == "interleaved-1f1b":
        return [interleaved_order(p, m, r, v) for r in range(p)], lambda r, c: r + c * p
    if schedule == "zero-bubble":
        return [zero_bubble_v_order(p, m, r) for r in range(p)], lambda r, c: r if c == 0 else 2 * p - 1 - r
    raise unknown("pipeline schedule", schedule, SCHEDULES)


# --------------------------------------------------------------------------------------------
# Placing the operations in time


def simulate(schedule: str, p: int, m: int, v: int = 1) -> list[list[Placed]]:
    orders, stage_of = rank_orders(schedule, p, m, v)
    chunks = v if is_multi_chunk(schedule) else 1
    stages = p * chunks
    unit = 1.0 / chunks
    length = {"F": unit, "B": 2 * unit, "I": unit, "W": unit}
    done: dict[tuple[str, int, int], float] = {}  # (kind, stage, mb) -> end time
    placed: list[list[Placed]] = [[] for _ in range(p)]
    free = [0.0] * p
    cursor = [0] * p
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for r in range(p):
            while cursor[r] < len(orders[r]):
                op = orders[r][cursor[r]]
                s = stage_of(r, op.chunk)
                deps = _dependencies(op, s, stages)
                if any(d not in done for d in deps):
                    break
                start = max([free[r], *(done[d] for d in deps)])
                end = start + length[op.kind]
                kind = "B" if op.kind == "I" else op.kind
                done[(kind, s, op.mb)] = end
                if op.kind == "W":
                    done[("W", s, op.mb)] = end
                placed[r].append(Placed(op, s, start, end))
                free[r] = end
                cursor[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"schedule {schedule} deadlocks for p={p}, m={m}, v={v}")
    return placed


def _dependencies(op: Op, stage: int, stages: int) -> list[tuple[str, int, int]]:
    if op.kind == "F":
        return [("F", stage - 1, op.mb)] if stage > 0 else []
    if op.kind in ("B", "I"):
        deps = [("F", stage, op.mb)]
        if stage < stages - 1:
            deps.append(("B", stage + 1, op.mb))
        return deps
    return [("B", stage, op.mb)]  # W after this stage's input gradient


def bubble_fraction(placed: list[list[Placed]]) -> float:
    """Idle time over busy time, averaged over ranks, within the step's span."""
    span = max(x.end for row in placed for x in row)
    fractions = []
    for row in placed:
        busy = sum(x.end - x.start for x in row)
        fractions.append((span - busy) / busy)
    return sum(fractions) / len(fractions)


def theory(schedule: str, p: int, m: int, v: int) -> float:
    """The bubble in closed form. For ZB-V with equal F, I and W times the idle time does not
    grow with m: (p-1)/2 forward-times of warm-up and cool-down against 3m of work."""
    if not is_multi_chunk(schedule):
        return (p - 1) / m
    if schedule == "interleaved-1f1b":
        return (p - 1) / (v * m)
    if schedule == "zero-bubble":
        return (p - 1) / (6 * m)
    raise unknown("pipeline schedule", schedule, SCHEDULES)


THEORY_TEXT = {"gpipe": "(p-1)/m", "1f1b": "(p-1)/m", "interleaved-1f1b": "(p-1)/(v·m)",
               "zero-bubble": "(p-1)/(6m), F = I = W"}


# --------------------------------------------------------------------------------------------
# Drawing


def check(schedule: str, p: int, m: int, v: int) -> None:
    if schedule not in SCHEDULES:
        raise ConfigError(f"--schedule {schedule!r} is not one of {', '.join(SCHEDULES)}")
    if p < 2 or m < 1:
        raise ConfigError("--pp must be at least 2 and --microbatches at least 1")
    if p * max(v, 1) * m > 65_536:  # the drawing grows with it (memory, then minutes), not the insight
        raise ConfigError(f"--pp × --virtual × --microbatches = {p * max(v, 1) * m:,} is too many to draw "
                          "(at most 65,536); a few micro-batches per stage show the same bubble")
    if not is_multi_chunk(schedule) and v != 1:
        raise ConfigError(f"--virtual {v} needs an interleaved schedule (interleaved-1f1b or zero-bubble)")
    if schedule == "interleaved-1f1b" and (v < 2 or m % p):
        raise ConfigError("interleaved-1f1b needs --virtual 2 or more and --microbatches a multiple of --pp")
    if schedule == "zero-bubble" and v != 2:
        raise ConfigError("zero-bubble (the V schedule) has exactly 2 stages per rank: --virtual 2")
    if schedule != "gpipe" and m < p:
        raise ConfigError(f"{schedule} needs at least --pp={p} micro-batches; gpipe also runs fewer")


def render_text(schedule: str, p: int, m: int, v: int, placed: list[list[Placed]]) -> str:
    """Ranks × time slots; each slot is the smallest operation length. Chunk c>0 of a rank is
    shown in lower case (f, b, i, w)."""
    unit = min(x.end - x.start for row in placed for x in row)
    span = max(x.end for row in placed for x in row)
    slots = round(span / unit)
    width = max(2, len(str(m - 1)) + 1) + 1
    unit_text = "1" if unit == 1 else f"1/{round(1 / unit)}"
    lines = [f"{schedule}: {p} stages × {m} micro-batches" + (f", {v} chunks per rank" if v > 1 else "")
             + f"; one column = {unit_text} of a forward"]
    header = "rank |" + "".join(f"{t:<{width}}"[:width] if t % 5 == 0 else " " * width for t in range(slots))
    lines.append(header.rstrip())
    for r, row in enumerate(placed):
        cells = ["." * (width - 1) + " "] * slots
        for x in row:
            label = x.op.kind if x.op.chunk == 0 else x.op.kind.lower()
            text = f"{label}{x.op.mb}"
            for t in range(round(x.start / unit), round(x.end / unit)):
                cells[t] = f"{text:<{width - 1}} "
        lines.append(f"{r:>4} |" + "".join(cells).rstrip())
    measured = bubble_fraction(placed)
    lines.append(f"bubble (idle / busy per rank): {measured:.3f}; theory {theory(schedule, p, m, v):.3f} "
                 f"({THEORY_TEXT[schedule]})")
    return "\n".join(lines)


KIND_COLORS = {"F": "#4c78a8", "B": "#e45756", "I": "#f58518", "W": "#54a24b"}
KIND_WORDS = {"F": "forward", "B": "backward", "I": "input gradient", "W": "weight gradient"}
CHUNK_HATCHES = ("", "///", "...", "xxx", "\\\\\\", "+++", "ooo", "---")  # a second cue beside the shade


def bar_style(op: Op) -> dict:
    """How the picture draws one operation: its kind's colour; a rank's later chunks lighter
    and hatched (a pattern as well as a shade, so they stay apart in grey or for colour-blind
    readers) and labelled in lower case, as the text picture does."""
    label = op.kind if op.chunk == 0 else op.kind.lower()
    return {"color": KIND_COLORS[op.kind], "alpha": 1.0 if op.chunk == 0 else 0.55,
            "hatch": CHUNK_HATCHES[op.chunk % len(CHUNK_HATCHES)], "label": f"{label}{op.mb}"}


def figure(schedule: str, p: int, m: int, v: int, placed: list[list[Placed]]):
    """The schedule as a matplotlib figure: a bar per operation on its rank's row, a legend of
    the kinds and, with several chunks per rank, of the chunks' patterns."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    span = float(max(x.end for row in placed for x in row))
    fig, ax = plt.subplots(figsize=(max(6.0, span * 0.45), 0.6 * p + 1.8))
    for r, row in enumerate(placed):
        for x in row:
            start, width = float(x.start), float(x.end - x.start)
            style = bar_style(x.op)
            ax.barh(r, width, left=start, color=style["color"], alpha=style["alpha"], hatch=style["hatch"],
                    edgecolor="black", linewidth=0.5)
            ax.text(start + width / 2, r, style["label"], ha="center", va="center", fontsize=7)
    kinds = sorted({x.op.kind for row in placed for x in row}, key="FBIW".index)
    handles = [Patch(facecolor=KIND_COLORS[k], edgecolor="black", label=f"{k} {KIND_WORDS[k]}") for k in kinds]
    chunks = sorted({x.op.chunk for row in placed for x in row})
    if len(chunks) > 1:
        handles += [Patch(facecolor="white", edgecolor="black", hatch=CHUNK_HATCHES[c % len(CHUNK_HATCHES)],
                          label=f"chunk {c} " + ("(upper case, solid)" if c == 0 else "(lower case, lighter, hatched)"))
                    for c in chunks]
    ax.legend(handles=handles, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.25 if p < 3 else -0.15),
              ncol=min(len(handles), 4), frameon=False)
    ax.set_yticks(range(p), [f"rank {r}" for r in range(p)])
    ax.invert_yaxis()
    ax.set_xlabel("time (forward = 1)")
    ax.set_title(f"{schedule}, p={p}, m={m}" + (f", v={v}" if v > 1 else "")
                 + f": bubble {bubble_fraction(placed):.3f} (theory {theory(schedule, p, m, v):.3f})")
    fig.tight_layout()
    return fig


def render_png(schedule: str, p: int, m: int, v: int, placed: list[list[Placed]], path: str) -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ConfigError("--png needs matplotlib: pip install matplotlib (or 'scaletrain[plot]')") from None
    import matplotlib.pyplot as plt

    fig = figure(schedule, p, m, v, placed)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
