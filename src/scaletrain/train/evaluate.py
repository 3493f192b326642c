"""Evaluation on held-out data: during training, and of a saved checkpoint.

During training (train.eval_every), `validation_sets` fixes the run's validation windows (one
set per source of a data.mix, each logged as val_loss/NAME, val_loss being their mean weighted as
the mix) and `validation_loss` is their mean token loss under the run's own layout: each validation batch is
split over data-parallel ranks and micro-batches like a training batch, pipeline stages run the
schedule's forward-only pass, and the sums are all-reduced like the training loss.

`scaletrain eval CKPT` (`evaluate_checkpoint`): a checkpoint's loss and perplexity, in one
process. The windows are those the training run evaluated: the same data split, the
checkpoint's data.seq_len, global batch and seed, and train.eval_batches batches of them (or
--batches), so the number matches the val_loss the run logged at the checkpoint's step. The
model runs whole, in fp32 (a checkpoint trained with train.qat through its fake quantizers, as
its run evaluated it); a folder without a validation split is evaluated on all its windows.
A folder written by `scaletrain quantize` is evaluated the same way, its quantized layers as they
are (the windows come from the config it records).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from scaletrain.config import JobConfig, from_dict, parse_mix
from scaletrain.data.dataset import WindowDataset, open_data, open_validation
from scaletrain.data.documents import document_separator
from scaletrain.data.loader import rank_slices, validation_batches
from scaletrain.data.mix import source_name
from scaletrain.errors import ConfigError, DataError
from scaletrain.model.transformer import Transformer
from scaletrain.parallel import pipeline
from scaletrain.parallel.tensor_parallel import whole
from scaletrain.quant.ptq import is_quantized_folder, load_quantized, read_info
from scaletrain.quant.qat import prepare_qat
from scaletrain.train import checkpoint as ckpt
from scaletrain.train.metrics import perplexity
from scaletrain.trained.adapters import adapted_model, is_peft_folder
from scaletrain.trained.export import load_model_from_checkpoint


@dataclass
class ValidationSet:
    """Fixed validation windows: (batches, global_batch) window indices of `dataset`. `name`:
    the source of a data.mix (None for a single folder), `weight` its share of the mix."""

    name: str | None
    weight: float
    dataset: WindowDataset
    batches: np.ndarray


def validation_sets(cfg: JobConfig, global_batch: int) -> list[ValidationSet]:
    """The validation windows that train.eval_every evaluates, fixed for the run: one set for
    data.path, one per source (that has a validation split) for data.mix; [] when evaluation is
    off."""
    train = cfg.train
    if not train.eval_every:
        return []
    if cfg.data.mix:
        sources = [(source_name(p), w, p) for p, w in parse_mix(cfg.data.mix)]
    else:
        sources = [(None, 1.0, cfg.data.path)]
    sets = []
    for name, weight, path in sources:
        data = open_validation(path, cfg.data.verify_checksums)
        if data is None:
            continue
        # a loss mask (chat data) counts the answers here as in training
        masked = cfg.data.loss_mask != "false" and data.mask is not None
        separator = document_separator(data, data.source) if cfg.data.document_mask else None
        dataset = WindowDataset(data, cfg.data.seq_len, loss_mask=masked, separator=separator)
        sets.append(ValidationSet(name, weight, dataset,
                                  validation_batches(len(dataset), global_batch, train.eval_batches, train.seed,
                                                     data.source)))
    if not sets:
        what = f"data.path {cfg.data.path} has none" if not cfg.data.mix else "none of data.mix's folders has one"
        raise ConfigError(f"train.eval_every={train.eval_every} needs a validation split, and {what}; prepare the "
                          "data again with --val-fraction (e.g. 0.05), or set train.eval_every=0")
    return sets


def combined(losses: dict[str | None, float], weights: dict[str | None, float]) -> dict[str, float]:
    """{"val_loss": ...} of one set; of a mix's sources, their mean weighted as the mix (over the
    sources evaluated) and "val_loss/NAME" for each."""
    if list(losses) == [None]:
        return {"val_loss": losses[None]}
    total = sum(weights[n] for n in losses)
    out = {"val_loss": sum(weights[n] * loss for n, loss in losses.items()) / total}
    out.update({f"val_loss/{n}": loss for n, loss in losses.items()})
    return out


@torch.no_grad()
def validation_loss(t) -> dict[str, float]:
    """The mean token loss of Trainer `t` over its fixed validation windows, in eval mode and
    without gradients, per validation set (`combined`). Each validation batch is split over ranks
    and micro-batches exactly like a training step's global batch; pipeline stages run the
    schedule's forward-only pass; the summed token losses are all-reduced like the training loss
    (tensor-parallel ranks hold copies). Gradients, optimizer state and random streams are left
    as they were."""
    t.health.enter("evaluation")
    b, modules = t.layout, t.dp.modules
    share = t.hooks.batch_share or (lambda batch: batch)  # this rank's tokens (context parallelism)
    totals = torch.zeros(len(t.val_sets), dtype=torch.float64, device=t.device)
    was_training = [m.training for m in modules]
    for m in modules:
        m.eval()  # no dropout
    try:
        for i, v in enumerate(t.val_sets):
            for global_batch in v.batches:
                micro = rank_slices(global_batch, b.micro_batch, b.grad_accum, t.dp_rank, b.dp)
                if t.pipeline is not None:
                    totals[i] += pipeline.eval_loss_sum(
                        t.pm, t.pipeline, [share(v.dataset[indices]) for indices in micro], device=t.device,
                        loss_factor=t.loss_factor(), autocast=t.precision.autocast, loss_context=t.loss_context)
                    continue
                for indices in micro:
                    inputs, targets = (x.to(t.device) for x in share(v.dataset[indices]))
                    with t.loss_context():
                        with t.precision.autocast():
                            logits = t.dp.module(inputs)  # the chunk itself: no DDP bookkeeping
                        loss = t.loss_fn(logits, targets)
                        totals[i] += whole(loss).double()
    finally:
        _restore_modes(modules, was_training, reshard=t.dp.zero == 3)
    if t.rt.distributed:
        t.health.enter("the evaluation all-reduce")
        dist.all_reduce(totals)
        totals /= b.tp
    # by the targets counted: every token's, or a loss mask's (the same on every rank: from the data)
    losses = {v.name: float(totals[i]) / max(1, sum(v.dataset.counted_tokens(g) for g in v.batches))
              for i, v in enumerate(t.val_sets)}
    return combined(losses, {v.name: v.weight for v in t.val_sets})


def _restore_modes(modules, was_training: list[bool], *, reshard: bool) -> None:
    """Put each module back in the mode it was in; under ZeRO-3 free what FSDP gathered for
    the forwards."""
    for m, training in zip(modules, was_training):
        m.train(training)
    if reshard:
        for module in modules:
            for m in module.modules():
                if hasattr(m, "reshard"):
                    m.reshard()


@torch.no_grad()
def evaluate_checkpoint(path: str | Path, data: str | None = None, batches: int | None = None,
                        device: str = "auto", chunk: int = 8, report=None, base: str | Path | None = None) -> dict:
    """Evaluate checkpoint `path` on `data` (a prepared folder; None: the data it was trained on,
    found where the run recorded it or where it moved with the run; "" the built-in data): its
    validation split, or all of it if it has none. `batches`: global batches of windows (None:
    the run's train.eval_batches, or as many as the data holds if fewer, said through `report`;
    0: every whole batch). `chunk`: sequences per forward, which changes memory, not the result.
    An adapter checkpoint or a PEFT adapter folder is evaluated merged into its base (`base`, if
    given: where the base is now; a PEFT folder not written by scaletrain needs `data`)."""
    if batches is not None and batches < 0:
        raise ConfigError(f"--batches {batches} must be 0 (every whole batch) or more")
    if device not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"--device {device!r}: expected auto, cpu or cuda")
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device is available here; use --device cpu")
    quantized = is_quantized_folder(path)
    peft_model = None
    if is_peft_folder(path):  # the run's config if a scaletrain export carries it, else the base's shape
        peft_model, run_cfg = adapted_model(path, base)
        if run_cfg is None and data is None:
            raise ConfigError(f"{path} is a PEFT folder that names no run (not written by scaletrain export): give "
                              "--data FOLDER, a prepared folder to evaluate on")
        config = run_cfg.to_dict() if run_cfg is not None else {
            "model": asdict(peft_model.cfg), "data": {"seq_len": min(128, peft_model.cfg.max_seq_len)}}
        state = {"config": config, "step": 0, "data": {"global_batch": from_dict(config).train.global_batch or 8}}
    elif quantized:  # `scaletrain quantize`'s folder: its quantization.json holds the run's config
        info = read_info(path)
        state = {"config": info["config"], "step": info.get("step") or 0,
                 "data": {"global_batch": info.get("global_batch") or 32}}
    else:
        state = ckpt.read_trainer_state(Path(path))
    config = state["config"] if data is not None or peft_model is not None else \
        ckpt.saved_config(path, state, fix="give --data FOLDER, a prepared folder to evaluate on", report=report)
    cfg = from_dict(config)
    if data is None and cfg.data.mix:  # each source of the mix, and their mean weighted as the mix
        pairs = [(source_name(p), w, p) for p, w in parse_mix(cfg.data.mix)]
    else:
        pairs = [(None, 1.0, cfg.data.path if data is None else str(data))]
    seq_len, global_batch, seed = cfg.data.seq_len, int(state["data"]["global_batch"]), cfg.train.seed
    dev = torch.device("cuda" if device == "cuda" or (device == "auto" and torch.cuda.is_available()) else "cpu")
    if peft_model is not None:
        model = peft_model.to(dev).eval()
    elif quantized:
        model = load_quantized(path)[0].to(dev)
    else:
        model = load_model_from_checkpoint(path, base)
        if cfg.train.qat != "none":  # through the fake quantizers it trained and was evaluated with
            prepare_qat(model, cfg.train.qat)
        model = model.to(dev).eval()
    from scaletrain.model.loss import cross_entropy_sum  # the training loss, summed over tokens

    losses, weights, parts = {}, {}, []
    for name, weight, data_path in pairs:
        held_out = open_validation(data_path)
        tokens = held_out if held_out is not None else open_data(data_path)
        if tokens.vocab_size > cfg.model.vocab_size:
            raise DataError(f"{tokens.source}: the tokenizer has {tokens.vocab_size} tokens, more than the model's "
                            f"vocabulary of {cfg.model.vocab_size}: this data was prepared for another model")
        # chat data: the answers; packed documents (data.document_mask) attend within themselves, as in training
        separator = document_separator(tokens, tokens.source) if cfg.data.document_mask else None
        for m in model.modules():
            if isinstance(m, Transformer):
                m.separator = separator
        dataset = WindowDataset(tokens, seq_len, loss_mask=tokens.mask is not None, separator=separator)
        wanted = batches
        if batches is None:  # the run's number, where this data holds that many
            wanted, held = cfg.train.eval_batches, len(dataset) // global_batch
            if 0 < held < wanted:
                if report is not None:
                    report(f"{tokens.source} holds {held} whole batch(es) of {global_batch} windows, fewer than the "
                           f"run's train.eval_batches={wanted}: evaluating on those {held}")
                wanted = held
        order = validation_batches(len(dataset), global_batch, wanted, seed, tokens.source)
        total = torch.zeros((), dtype=torch.float64, device=dev)
        for window_batch in order:
            for i in range(0, global_batch, chunk):
                inputs, targets = dataset[window_batch[i:i + chunk]]
                total += cross_entropy_sum(model(inputs.to(dev)), targets.to(dev)).double()
        losses[name], weights[name] = float(total) / max(1, sum(dataset.counted_tokens(b) for b in order)), weight
        parts.append((tokens, held_out is not None, order))
    result = combined(losses, weights)
    loss = result["val_loss"]
    tokens, held, order = parts[0]
    out = {"checkpoint": str(path), "step": int(state["step"]),
           "data": tokens.source if len(parts) == 1 else "data.mix: " + ", ".join(str(n) for n in losses),
           "split": "validation" if all(h for _, h, _ in parts) else
           "all (the folder has no validation split)" if len(parts) == 1 else
           "validation, or all of a folder without one",
           "batches": sum(len(o) for _, _, o in parts), "windows": sum(int(o.size) for _, _, o in parts),
           "tokens": sum(int(o.size) * seq_len for _, _, o in parts),
           "val_loss": loss, "val_ppl": perplexity(loss), "device": str(dev)}
    if quantized:
        out["quantized"] = info["scheme"]
    elif cfg.train.qat != "none":
        out["fake_quantized"] = cfg.train.qat
    if len(parts) > 1:
        out["sources"] = {n: losses[n] for n in losses}
    return out
