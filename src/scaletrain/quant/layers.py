"""Which linear layers a quantization scheme (or fp8 training) converts, and why the others stay
high precision.

One rule, printed by `scaletrain quantize` and by a run with train.qat or precision.mode=fp8, so
a reader knows what was converted (the planner's `--fp8` counts the same layers):

* only the transformer blocks' linear layers (attention wq/wk/wv/wo, MLP w1/w2/w3) convert;
* the embeddings stay: a lookup has no matmul to speed up, and the vocabulary's rows are where
  rare tokens live, which a per-row scale treats worst;
* the output head stays: every logit goes through it and its errors go straight into the loss
  (with tied embeddings it is the embedding);
* a mixture of experts' router stays (its scores are fp32: a rounding would choose another
  expert), and so do its routed experts, stacked weights rather than linear layers (its shared
  experts are a dense MLP and convert like one);
* a small linear (fewer than MIN_FEATURES inputs or outputs) stays: its int8 copy saves a few
  KiB while its scales cost about as much;
* for int4 weights (int8-int4) a linear whose inputs are not a multiple of the group size
  stays: each group of GROUP_SIZE inputs shares one scale;
* for fp8, a linear whose dimensions are not multiples of FP8_MULTIPLE stays (the fp8 matmul
  kernels need them), and so does one with fewer than precision.fp8_min_dim inputs or outputs:
  casting its operands to fp8 and scaling them costs more than its faster matmul saves.
  torchao's own automatic filter (torchao.float8, from its H100 measurements) skips, for
  tensorwise, layers with at most 1024 outputs unless they have over 4096 inputs, and for
  rowwise, layers with at most 2048 outputs or 1024 inputs; one threshold on both sides is
  simpler to state and to plan with, and its default of 1024 sits at tensorwise's edge.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported on first use: the config checks load this module without it
    from torch import nn

MIN_FEATURES = 64  # a linear with fewer inputs or outputs stays high precision
GROUP_SIZE = 32  # int4 weights: one scale per this many inputs of a row
FP8_MULTIPLE = 16  # fp8 matmuls (torch._scaled_mm) need both dimensions multiples of this
FP8_MIN_DIM = 1024  # precision.fp8_min_dim's default: smaller linears stay bf16


def layer_plan(model: nn.Module, scheme: str, *, fp8_min_dim: int = FP8_MIN_DIM) -> dict[str, str | None]:
    """{module name: None (converts) or why it stays high precision} for every nn.Linear and
    nn.Embedding of `model` (a scaletrain Transformer or a pipeline chunk of one). `scheme` is a
    quantization scheme or "fp8" (whose size threshold is `fp8_min_dim`)."""
    from torch import nn  # here: the config checks below load without torch

    plan: dict[str, str | None] = {}
    for name, m in model.named_modules():
        if isinstance(m, nn.Embedding):
            plan[name] = "embedding (a lookup: no matmul to speed up)"
        elif isinstance(m, nn.Linear):
            plan[name] = _keeps(name, m.in_features, m.out_features, scheme, fp8_min_dim)
    return plan


def _keeps(name: str, n_in: int, n_out: int, scheme: str, fp8_min_dim: int) -> str | None:
    if name == "output" or name.endswith(".output"):
        return "output head (its errors go straight into the loss)"
    if not name.startswith("layers.") and ".layers." not in name:
        return "outside the transformer blocks"
    if name.endswith(".moe.router"):
        return "mixture-of-experts router (scores in fp32: a rounding would pick another expert)"
    if scheme == "fp8":
        if n_in % FP8_MULTIPLE or n_out % FP8_MULTIPLE:
            return f"{n_in}x{n_out} is not a multiple of {FP8_MULTIPLE} (the fp8 matmul kernels need it)"
        if min(n_in, n_out) < fp8_min_dim:
            return (f"small ({n_in}x{n_out}, under precision.fp8_min_dim={fp8_min_dim}: fp8's casts and scaling "
                    "would cost more than its matmul saves)")
        return None
    if min(n_in, n_out) < MIN_FEATURES:
        return f"small ({n_in}x{n_out}, under {MIN_FEATURES})"
    if scheme == "int8-int4" and n_in % GROUP_SIZE:
        return f"{n_in} inputs are not a multiple of the int4 group size {GROUP_SIZE}"
    return None


def block_linears(cfg) -> dict[str, tuple[int, int]]:
    """{name inside a block: (inputs, outputs)} of one transformer block's linear layers, from a
    ModelConfig (the planner has no model to look at). Their weights add up to
    model.flops.block_matmul_params."""
    d, kv, q = cfg.dim, cfg.kv_heads * cfg.head_size, cfg.n_heads * cfg.head_size
    shapes = {"attn.wq": (d, q), "attn.wk": (d, kv), "attn.wv": (d, kv), "attn.wo": (q, d),
              "mlp.w1": (d, cfg.hidden_dim), "mlp.w2": (cfg.hidden_dim, d)}
    if cfg.gated:
        shapes["mlp.w3"] = (d, cfg.hidden_dim)
    return shapes


def fp8_block_plan(cfg, fp8_min_dim: int = FP8_MIN_DIM) -> dict[str, str | None]:
    """layer_plan's fp8 verdict for one block's linears of ModelConfig `cfg` (every block has the
    same shapes)."""
    return {name: _keeps(f"layers.0.{name}", n_in, n_out, "fp8", fp8_min_dim)
            for name, (n_in, n_out) in block_linears(cfg).items()}


def fp8_share(cfg, fp8_min_dim: int = FP8_MIN_DIM) -> float:
    """The share of a block's matmul FLOPs that fp8 runs (the planner's --fp8 puts these at the
    fp8 peak and the rest at bf16's)."""
    shapes, plan = block_linears(cfg), fp8_block_plan(cfg, fp8_min_dim)
    total = sum(a * b for a, b in shapes.values())
    return sum(a * b for name, (a, b) in shapes.items() if plan[name] is None) / total


def fp8_problems(model, fp8_min_dim: int, qat: str) -> list[str]:
    """What makes precision.mode=fp8 refuse model config `model` (None: the model is not known
    yet, only the settings are checked), as config error lines."""
    if qat != "none":
        return [f"precision.mode=fp8 and train.qat={qat} both replace the blocks' linear layers (with float8 and "
                "fake-quantized ones); keep one of them"]
    if model is None or any(why is None for why in fp8_block_plan(model, fp8_min_dim).values()):
        return []
    widest = max(min(s) for s in block_linears(model).values())
    return [f"precision.mode=fp8: no block linear layer qualifies (the widest is {widest} wide, under "
            f"precision.fp8_min_dim={fp8_min_dim}, or not a multiple of {FP8_MULTIPLE}), so fp8 would change nothing; "
            "a model this small trains faster in bf16-mixed: use that, or lower precision.fp8_min_dim"]


def describe(plan: dict[str, str | None], scheme: str) -> list[str]:
    """Lines for the log: how many layers convert, and each reason the others stay."""
    converted = [n for n, why in plan.items() if why is None]
    kept: dict[str, list[str]] = {}
    for name, why in plan.items():
        if why is not None:
            kept.setdefault(why, []).append(name)
    lines = [f"{scheme}: {len(converted)} linear layer(s) converted (the transformer blocks' projections)"]
    for why, names in kept.items():
        shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
        lines.append(f"  high precision: {shown}: {why}")
    return lines


def qat_problems(model, scheme: str) -> list[str]:
    """What makes train.qat=`scheme` refuse model config `model` (a ModelConfig), as config
    error lines: a block linear whose inputs int4 cannot group, or no linear large enough to
    convert at all."""
    if scheme == "none":
        return []
    inputs = {"model.dim": model.dim, "model.n_heads * head_dim": model.n_heads * model.head_size,
              "the MLP's hidden width (model.ffn_dim)": model.hidden_dim}
    errors = []
    if scheme == "int8-int4":
        for what, n in inputs.items():
            if n % GROUP_SIZE:
                errors.append(f"train.qat=int8-int4 gives each {GROUP_SIZE} inputs of a linear layer one int4 scale, "
                              f"but {what} = {n} is not a multiple of {GROUP_SIZE}; make it one, or use "
                              "train.qat=int8-dynamic (a scale per row)")
    if not errors and min(model.dim, model.hidden_dim) < MIN_FEATURES:
        errors.append(f"train.qat={scheme}: no linear layer would be fake-quantized: model.dim={model.dim} is under "
                      f"{MIN_FEATURES}, and smaller layers stay high precision; set train.qat=none or widen the model")
    return errors
