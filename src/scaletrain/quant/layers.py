"""Which linear layers a quantization scheme converts, and why the others stay high precision.

One rule, printed by `scaletrain quantize` and by a run with train.qat, so a reader knows what
was converted:

* only the transformer blocks' linear layers (attention wq/wk/wv/wo, MLP w1/w2/w3) convert;
* the embeddings stay: a lookup has no matmul to speed up, and the vocabulary's rows are where
  rare tokens live, which a per-row scale treats worst;
* the output head stays: every logit goes through it and its errors go straight into the loss
  (with tied embeddings it is the embedding);
* a small linear (fewer than MIN_FEATURES inputs or outputs) stays: its int8 copy saves a few
  KiB while its scales cost about as much;
* for int4 weights (int8-int4) a linear whose inputs are not a multiple of the group size
  stays: each group of GROUP_SIZE inputs shares one scale.
"""

from __future__ import annotations

MIN_FEATURES = 64  # a linear with fewer inputs or outputs stays high precision
GROUP_SIZE = 32  # int4 weights: one scale per this many inputs of a row


def layer_plan(model: nn.Module, scheme: str, *, multiple_of: int = 1) -> dict[str, str | None]:
    """{module name: None (converts) or why it stays high precision} for every nn.Linear and
    nn.Embedding of `model` (a scaletrain Transformer or a pipeline chunk of one). `multiple_of`:
    both dimensions must be multiples of it (fp8's kernels want 16)."""
    from torch import nn  # here: the config checks below load without torch

    group = GROUP_SIZE if scheme == "int8-int4" else 1
    plan: dict[str, str | None] = {}
    for name, m in model.named_modules():
        if isinstance(m, nn.Embedding):
            plan[name] = "embedding (a lookup: no matmul to speed up)"
        elif isinstance(m, nn.Linear):
            plan[name] = _keeps(name, m, group, multiple_of)
    return plan


def _keeps(name: str, m, group: int, multiple_of: int) -> str | None:
    if name == "output" or name.endswith(".output"):
        return "output head (its errors go straight into the loss)"
    if not name.startswith("layers.") and ".layers." not in name:
        return "outside the transformer blocks"
    if min(m.in_features, m.out_features) < MIN_FEATURES:
        return f"small ({m.in_features}x{m.out_features}, under {MIN_FEATURES})"
    if m.in_features % group:
        return f"{m.in_features} inputs are not a multiple of the int4 group size {group}"
    if multiple_of > 1 and (m.in_features % multiple_of or m.out_features % multiple_of):
        return f"{m.in_features}x{m.out_features} is not a multiple of {multiple_of}"
    return None


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
