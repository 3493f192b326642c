"""`scaletrain generate CKPT_OR_HF --prompt TEXT`: text from a checkpoint or a Hugging Face
model folder, one process, with the key/value cache (scaletrain.model.generate).

The tokenizer is the data folder's: a checkpoint's run data (its data.path, or a data.mix's
sources, which share one), or --data FOLDER; a Hugging Face folder's own tokenizer.json. The
context is at most the length the model was trained on (a checkpoint's data.seq_len, a Hugging
Face model's max_seq_len).
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch

from scaletrain.config import data_paths, from_dict
from scaletrain.errors import CheckpointError, ConfigError, DataError
from scaletrain.train import checkpoint as ckpt


def data_tokenizer(path: str):
    """The tokenizer a prepared folder was made with, from its meta.json alone (no shard is
    read); empty path: the built-in byte-level data's."""
    from scaletrain.data.prepare import META_FILE
    from scaletrain.data.tokenizer import ByteTokenizer, load_tokenizer

    if not path:
        return ByteTokenizer()
    meta = Path(path) / META_FILE
    try:
        described = json.loads(meta.read_text())["tokenizer"]
    except FileNotFoundError:
        raise DataError(f"{meta} does not exist; give --data, a folder written by scaletrain prepare") from None
    except (OSError, ValueError, KeyError, TypeError):
        raise DataError(f"{meta}: no tokenizer described; re-run scaletrain prepare") from None
    return load_tokenizer(described, Path(path))


def load_for_generation(source: str | Path, data: str | None = None, report=None, base: str | Path | None = None):
    """(model, tokenizer, window) for `source`: a checkpoint folder (step_*; adapters merged into
    their base, `base` if given), a folder written by `scaletrain quantize`, a Hugging Face model
    folder, or a PEFT adapter folder (merged into `base`, else its base_model_name_or_path);
    `data`: a prepared folder whose tokenizer to use instead of the run's (found where the run
    recorded it, or where it moved with the run: said through `report`)."""
    from scaletrain.quant.ptq import is_quantized_folder, load_quantized, read_info
    from scaletrain.trained.adapters import adapted_model, is_peft_folder, peft_base

    path = Path(source)
    if is_peft_folder(path):  # the run's tokenizer if a scaletrain export says which, else the base's
        from scaletrain.data.tokenizer import HFTokenizer

        model, cfg = adapted_model(path, base)
        if data is not None or cfg is not None:
            tokenizer = data_tokenizer(data if data is not None else data_paths(cfg.data)[0])
        else:
            tokenizer = HFTokenizer.from_hf_folder(peft_base(path, base))
        return model, tokenizer, min(cfg.data.seq_len, model.cfg.max_seq_len) if cfg else model.cfg.max_seq_len
    if base is not None and not (path / ckpt.TRAINER_FILE).is_file():
        raise ConfigError(f"--base {base} goes with adapters (a checkpoint of an adapter run, or a PEFT folder); "
                          f"{path} holds none: drop --base")
    if is_quantized_folder(path):  # `scaletrain quantize`'s folder: its quantization.json holds the config
        info = read_info(path)
        state = {"config": info["config"]}
        cfg = from_dict(state["config"] if data is not None else ckpt.saved_config(
            path, state, fix="give --data FOLDER, a prepared folder with the run's tokenizer", report=report))
        tokenizer = data_tokenizer(data if data is not None else data_paths(cfg.data)[0])
        return load_quantized(path)[0], tokenizer, min(cfg.data.seq_len, cfg.model.max_seq_len)
    if (path / ckpt.TRAINER_FILE).is_file():
        from scaletrain.trained.export import load_model_from_checkpoint

        state = ckpt.read_trainer_state(path)
        cfg = from_dict(state["config"] if data is not None else ckpt.saved_config(
            path, state, fix="give --data FOLDER, a prepared folder with the run's tokenizer", report=report))
        tokenizer = data_tokenizer(data if data is not None else data_paths(cfg.data)[0])
        return load_model_from_checkpoint(path, base), tokenizer, min(cfg.data.seq_len, cfg.model.max_seq_len)
    if (path / "config.json").is_file():
        from scaletrain.data.tokenizer import HFTokenizer
        from scaletrain.model.config import model_config
        from scaletrain.model.hf import load_hf_weights
        from scaletrain.model.hf_config import model_config_from_hf
        from scaletrain.model.transformer import Transformer

        model_cfg = model_config(model_config_from_hf(path))
        from scaletrain.parallel.init import load_weights

        model = Transformer(model_cfg)
        model.init_buffers("cpu")
        load_weights(model, load_hf_weights(path, model_cfg), str(path))  # routing biases too (DeepSeek-V3)
        tokenizer = data_tokenizer(data) if data is not None else HFTokenizer.from_hf_folder(path)
        return model, tokenizer, model_cfg.max_seq_len
    raise CheckpointError(f"{path}: neither a checkpoint folder (no {ckpt.TRAINER_FILE}) nor a Hugging Face model "
                          "folder (no config.json); give runs/<run>/checkpoints/step_* or a model folder")


def generate_text(source: str | Path, prompt: str, *, max_new_tokens: int = 200, temperature: float = 0.8,
                  top_k: int = 50, seed: int = 0, data: str | None = None, device: str = "auto",
                  stream=None, report=None, base: str | Path | None = None) -> str:
    """The prompt and `max_new_tokens` tokens sampled after it, decoded; with `stream`, the
    sampled text goes to it as it comes (model.generate.sample_text) and the prompt is returned;
    `report` is told where the run's data was found, if it moved."""
    from scaletrain.model.generate import sample_text

    if not prompt:
        raise ConfigError("--prompt is empty: give the text to continue (at least one character)")
    if max_new_tokens < 0:
        raise ConfigError(f"--max-new-tokens {max_new_tokens} must be 0 or more")
    if not temperature > 0:
        raise ConfigError(f"--temperature {temperature} must be above 0 (lower is more predictable)")
    if top_k < 0:
        raise ConfigError(f"--top-k {top_k} must be 0 (no limit) or more")
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device is available here; use --device cpu")
    model, tokenizer, window = load_for_generation(source, data, report, base)
    if tokenizer.vocab_size > model.cfg.vocab_size:
        raise DataError(f"the tokenizer has {tokenizer.vocab_size} tokens, more than the model's vocabulary of "
                        f"{model.cfg.vocab_size}: give --data, the folder the model was trained on")
    dev = torch.device("cuda" if device == "cuda" or (device == "auto" and torch.cuda.is_available()) else "cpu")
    model = model.to(dev)
    try:
        return sample_text(model, tokenizer, prompt, max_new_tokens, window=window, seed=seed, device=dev,
                           autocast=contextlib.nullcontext, all_ranks=False, interrupted=lambda: False,
                           temperature=temperature, top_k=top_k, stream=stream)
    except ValueError as e:  # the prompt encodes to no token
        raise ConfigError(f"--prompt: {e}; give text the tokenizer knows") from None

