"""`scaletrain eval CKPT` (`evaluate_checkpoint`): a checkpoint's loss and perplexity, in one process.

The windows are those the training run evaluated: the same data split, the checkpoint's
data.seq_len, global batch and seed, and train.eval_batches batches of them (or --batches), so the
number matches the val_loss the run logged at the checkpoint's step. The model runs whole, in fp32
(a checkpoint trained with train.qat through its fake quantizers, as its run evaluated it); a
folder without a validation split is evaluated on all its windows. A folder written by
`scaletrain quantize` is evaluated the same way, its quantized layers as they are (the windows come
from the config it records); an adapter checkpoint or a PEFT folder merged into its base.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from scaletrain.config import JobConfig, from_dict, parse_mix
from scaletrain.data.dataset import WindowDataset, open_data, open_validation
from scaletrain.data.documents import document_separator
from scaletrain.data.loader import validation_batches
from scaletrain.data.mix import source_name
from scaletrain.errors import ConfigError, DataError
from scaletrain.model.transformer import Transformer
from scaletrain.quant.ptq import is_quantized_folder, load_quantized, read_info
from scaletrain.quant.qat import prepare_qat
from scaletrain.train import checkpoint as ckpt
from scaletrain.train.evaluate import combined
from scaletrain.train.metrics import perplexity
from scaletrain.trained.adapters import adapted_model, is_peft_folder
from scaletrain.trained.export import load_model_from_checkpoint


@dataclass
class _Evaluated:
    """What is evaluated: the trainer state it stands for, its config, and how it is stored."""

    state: dict
    cfg: JobConfig
    quantized: dict | None = None  # `scaletrain quantize`'s quantization.json
    peft_model: torch.nn.Module | None = None  # a PEFT folder merged into its base
    hf_folder: bool = False  # a Hugging Face model folder (as `generate` takes), evaluated on --data


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
    what = _what_is_evaluated(path, data, base, report)
    cfg = what.cfg
    if data is None and cfg.data.mix:  # each source of the mix, and their mean weighted as the mix
        pairs = [(source_name(p), w, p) for p, w in parse_mix(cfg.data.mix)]
    else:
        pairs = [(None, 1.0, cfg.data.path if data is None else str(data))]
    dev = torch.device("cuda" if device == "cuda" or (device == "auto" and torch.cuda.is_available()) else "cpu")
    model = _model(path, what, base, dev)
    if cfg.train.objective == "preference":  # its held-out pairs' loss, rewards and accuracy
        return _preference_result(path, what, model, pairs[0][2], batches, dev)
    losses, weights, parts = {}, {}, []
    for name, weight, data_path in pairs:
        losses[name], held_out, order = _loss_on(model, data_path, what, batches, chunk, dev, report)
        weights[name] = weight
        parts.append((held_out, order))
    return _result(path, what, combined(losses, weights), losses, parts, dev)


def _what_is_evaluated(path, data, base, report) -> _Evaluated:
    """The trainer state and config behind `path`: a checkpoint's own, a quantized folder's record,
    or a PEFT folder's (the run's config if a scaletrain export carries it, else the base's shape)."""
    if is_peft_folder(path):
        peft_model, run_cfg = adapted_model(path, base)
        if run_cfg is None and data is None:
            raise ConfigError(f"{path} is a PEFT folder that names no run (not written by scaletrain export): give "
                              "--data FOLDER, a prepared folder to evaluate on")
        config = run_cfg.to_dict() if run_cfg is not None else {
            "model": asdict(peft_model.cfg), "data": {"seq_len": min(128, peft_model.cfg.max_seq_len)}}
        state = {"config": config, "step": 0, "data": {"global_batch": from_dict(config).train.global_batch or 8}}
        return _Evaluated(state, from_dict(config), peft_model=peft_model)
    if not (Path(path) / ckpt.TRAINER_FILE).is_file() and (Path(path) / "config.json").is_file():
        return _hf_folder(path, data)
    quantized = None
    if is_quantized_folder(path):  # `scaletrain quantize`'s folder: its quantization.json holds the run's config
        quantized = read_info(path)
        state = {"config": quantized["config"], "step": quantized.get("step") or 0,
                 "data": {"global_batch": quantized.get("global_batch") or 32}}
    else:
        state = ckpt.read_trainer_state(Path(path))
    config = state["config"] if data is not None else \
        ckpt.saved_config(path, state, fix="give --data FOLDER, a prepared folder to evaluate on", report=report)
    return _Evaluated(state, from_dict(config), quantized=quantized)


def _hf_folder(path, data) -> _Evaluated:
    """A Hugging Face model folder names no run: evaluated on `data` (a prepared folder of the same
    tokenizer), as a PEFT folder without a run is: windows of min(128, its max_seq_len), batches of 8."""
    from scaletrain.data.tokenizer import check_same_tokenizer
    from scaletrain.model.config import model_config
    from scaletrain.model.hf_config import model_config_from_hf

    if data is None:
        raise ConfigError(f"{path} is a Hugging Face model folder, which names no data: give --data FOLDER, a "
                          "prepared folder of its tokenizer")
    check_same_tokenizer(str(path), str(data), what="the model folder",  # the ids must mean the same text
                         otherwise="give --data a folder prepared with this model's tokenizer")
    cfg = model_config(model_config_from_hf(path))
    config = {"model": asdict(cfg), "data": {"seq_len": min(128, cfg.max_seq_len)}}
    state = {"config": config, "step": 0, "data": {"global_batch": 8}}
    return _Evaluated(state, from_dict(config), hf_folder=True)


def _model(path, what: _Evaluated, base, dev: torch.device) -> torch.nn.Module:
    """The model to evaluate, whole, on `dev`."""
    if what.peft_model is not None:
        return what.peft_model.to(dev).eval()
    if what.hf_folder:  # read as `generate` reads it
        from scaletrain.trained.generate import load_for_generation

        return load_for_generation(path)[0].to(dev).eval()
    if what.quantized is not None:
        return load_quantized(path)[0].to(dev)
    model = load_model_from_checkpoint(path, base)
    if what.cfg.train.qat != "none":  # through the fake quantizers it trained and was evaluated with
        prepare_qat(model, what.cfg.train.qat)
    return model.to(dev).eval()


def _loss_on(model, data_path: str, what: _Evaluated, batches: int | None, chunk: int, dev: torch.device, report):
    """(mean token loss over the run's validation windows of `data_path`, whether it has a validation
    split, the window batches evaluated)."""
    from scaletrain.model.loss import cross_entropy_sum  # the training loss, summed over tokens

    cfg, global_batch = what.cfg, int(what.state["data"]["global_batch"])
    held_out = open_validation(data_path)
    tokens = held_out if held_out is not None else open_data(data_path)
    if tokens.vocab_size > cfg.model.vocab_size:
        raise DataError(f"{tokens.source}: the tokenizer has {tokens.vocab_size} tokens, more than the model's "
                        f"vocabulary of {cfg.model.vocab_size}: this data was prepared for another model")
    # packed documents (data.document_mask) attend within themselves, as in training
    separator = document_separator(tokens, tokens.source) if cfg.data.document_mask else None
    for m in model.modules():
        if isinstance(m, Transformer):
            m.separator = separator
    # a loss mask (chat data) counts the answers, unless the run counted every token (data.loss_mask=false)
    masked = cfg.data.loss_mask != "false" and tokens.mask is not None
    dataset = WindowDataset(tokens, cfg.data.seq_len, loss_mask=masked, separator=separator)
    wanted = batches
    if batches is None:  # the run's number, where this data holds that many
        wanted, held = cfg.train.eval_batches, len(dataset) // global_batch
        if 0 < held < wanted:
            if report is not None:
                report(f"{tokens.source} holds {held} whole batch(es) of {global_batch} windows, fewer than the "
                       f"run's train.eval_batches={wanted}: evaluating on those {held}")
            wanted = held
    order = validation_batches(len(dataset), global_batch, wanted, cfg.train.seed, tokens.source)
    total = torch.zeros((), dtype=torch.float64, device=dev)
    for window_batch in order:
        for i in range(0, global_batch, chunk):
            inputs, targets = dataset[window_batch[i:i + chunk]]
            total += cross_entropy_sum(model(inputs.to(dev)), targets.to(dev)).double()
    loss = float(total) / max(1, sum(dataset.counted_tokens(b) for b in order))
    return loss, (tokens, held_out is not None), order


def _preference_result(path, what: _Evaluated, model, data_path: str, batches: int | None, dev) -> dict:
    from scaletrain.trained.preference_eval import evaluate_preference

    r = evaluate_preference(model, what.cfg, data_path, int(what.state["data"]["global_batch"]), batches, dev)
    return {"checkpoint": str(path), "step": int(what.state["step"]), "data": r["source"], "split": r["split"],
            "batches": r["batches"], "examples": r["examples"], **r["result"], "device": str(dev)}


def _result(path, what: _Evaluated, result: dict, losses: dict, parts: list, dev: torch.device) -> dict:
    """What `scaletrain eval` prints: the loss, perplexity and what they were measured on."""
    loss, seq_len = result["val_loss"], what.cfg.data.seq_len
    (tokens, _), _ = parts[0]
    out = {"checkpoint": str(path), "step": int(what.state["step"]),
           "data": tokens.source if len(parts) == 1 else "data.mix: " + ", ".join(str(n) for n in losses),
           "split": "validation" if all(h for (_, h), _ in parts) else
           "all (the folder has no validation split)" if len(parts) == 1 else
           "validation, or all of a folder without one",
           "batches": sum(len(o) for _, o in parts), "windows": sum(int(o.size) for _, o in parts),
           "tokens": sum(int(o.size) * seq_len for _, o in parts),
           "val_loss": loss, "val_ppl": perplexity(loss), "device": str(dev)}
    if what.quantized is not None:
        out["quantized"] = what.quantized["scheme"]
    elif what.cfg.train.qat != "none":
        out["fake_quantized"] = what.cfg.train.qat
    if len(parts) > 1:
        out["sources"] = {n: losses[n] for n in losses}
    return out
