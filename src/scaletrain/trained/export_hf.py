"""`scaletrain export --format hf`: a checkpoint as a Hugging Face model folder.

The folder holds config.json, the weights as safetensors (model.safetensors, or shards listed
in model.safetensors.index.json past `max_shard_bytes`), generation_config.json and the tokenizer
the run trained with (tokenizer.json + tokenizer_config.json), so that
`AutoModelForCausalLM.from_pretrained(DIR)` and `AutoTokenizer.from_pretrained(DIR)` load it with
no scaletrain code. Names, GPT-2's fused and transposed layouts and the RoPE row order are
converted by `scaletrain.model.hf`; the weights are fp32 (bf16-true runs export their master copy).
A mixture of experts whose routing bias has moved (model.moe_bias_rate in training) is refused:
Mixtral, Qwen3-MoE and OLMoE route without one, so its experts would be chosen otherwise.

The folder is written beside its destination and renamed when complete: an existing folder is
never overwritten, and a folder at the destination is always whole.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from scaletrain import atomic
from scaletrain.config import data_paths, from_dict
from scaletrain.data.tokenizer import byte_chars
from scaletrain.errors import CheckpointError, ConfigError, DataError
from scaletrain.model.families import family_of_model
from scaletrain.model.hf import INDEX_FILE, WEIGHTS_FILE, hf_state_dict
from scaletrain.model.hf_config import CONFIG_FILE, hf_config_from_model
from scaletrain.model.moe import MoE
from scaletrain.model.transformer import Transformer

MAX_SHARD_BYTES = 5 * 2**30  # transformers' own default shard size
EOT = "<|endoftext|>"
# our sampling defaults (scaletrain.model.generate), so `generate(do_sample=True)` samples alike
SAMPLING = {"do_sample": True, "temperature": 0.8, "top_k": 50}
# the special ids a config.json states: the tokenizer's, or none (null). Never left out: transformers
# would fill in the family's own (GPT-2's 50256, Llama's 1 and 2), ids of another vocabulary
SPECIAL_IDS = ("bos_token_id", "eos_token_id")


def export_hf(checkpoint_path: str | Path, out_dir: str | Path, *, tokenizer: str | Path | None = None,
              max_shard_bytes: int = MAX_SHARD_BYTES, overwrite: bool = False, base: str | Path | None = None) -> Path:
    """Write checkpoint `checkpoint_path` as a Hugging Face model folder `out_dir`; returns it.
    An adapter checkpoint's adapters are merged into their base (`base`: where it is now).
    The tokenizer is the one of the run's data folder (its `data.path`; the built-in data is
    byte-level), or that of `tokenizer` (a prepared data folder) when given. An existing folder
    is replaced (whole, once the new one is complete) only with `overwrite`."""
    from scaletrain.train import checkpoint as ckpt
    from scaletrain.trained.export import load_model_from_checkpoint

    path, out = Path(checkpoint_path), Path(out_dir)
    _check_out(out, overwrite)
    state = ckpt.read_trainer_state(path)
    cfg = from_dict(state["config"] if tokenizer is not None else ckpt.saved_config(
        path, state, fix="restore the data folder the run trained on: export --format hf ships its tokenizer"))
    try:
        hf_config_from_model(cfg.model)
    except ConfigError as e:  # before loading any weights
        raise CheckpointError(f"{path}: cannot be exported as a Hugging Face model: {e.lines[0]}; "
                              "export it as safetensors instead") from None
    data = str(tokenizer) if tokenizer is not None else data_paths(cfg.data)[0]  # a mix's sources share one
    files = tokenizer_files(data, cfg.model.max_seq_len)  # a missing tokenizer stops us before writing
    model = load_model_from_checkpoint(path, base)
    if cfg.model.moe_experts:  # the routing biases are buffers, saved beside the weights
        biases = {f"{name}.expert_bias": m.expert_bias for name, m in model.named_modules() if isinstance(m, MoE)}
        with torch.no_grad():
            ckpt.load_tensors(path, {"model": biases}, verify=False)
    return save_hf(model, out, tokenizer=files, max_shard_bytes=max_shard_bytes, overwrite=overwrite)


def _check_out(out: Path, overwrite: bool) -> None:
    if out.exists() and not overwrite:
        raise CheckpointError(f"{out} already exists; choose another --out, or add --overwrite to replace it "
                              "(nothing was overwritten)")
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"--out {out} is a file; --format hf writes a folder: choose another --out")


def save_hf(model: Transformer, out_dir: str | Path, *, tokenizer: dict[str, str] | None = None,
            max_shard_bytes: int = MAX_SHARD_BYTES, overwrite: bool = False) -> Path:
    """Write a plain model as a Hugging Face folder. `tokenizer` maps file names to their text
    (see `tokenizer_files`); None writes no tokenizer (and states no special ids)."""
    try:
        from safetensors.torch import save_file
    except ImportError:
        raise CheckpointError("export needs the safetensors package: pip install safetensors") from None
    out = Path(out_dir)
    _check_out(out, overwrite)
    keeps_bias = bool(family_of_model(model.cfg).routing_bias)  # a family that stores the routing bias
    for name, m in model.named_modules():
        if isinstance(m, MoE) and torch.count_nonzero(m.expert_bias) and not keeps_bias:
            raise CheckpointError(f"{name}.expert_bias is not zero (model.moe_bias_rate moved it in training), and "
                                  f"{hf_config_from_model(model.cfg)['model_type']} routes without a bias, so its "
                                  "experts would be chosen otherwise; export as safetensors, or fine-tune with "
                                  "model.moe_bias_rate=0")
    tokenizer = tokenizer or {}
    ids = {**dict.fromkeys(SPECIAL_IDS), **json.loads(tokenizer.get("special_ids.json", "{}"))}
    config = hf_config_from_model(model.cfg, **ids)
    weights = hf_state_dict({n: p.detach().float().cpu() for n, p in [*model.named_parameters(), *(
        (f"{n}.expert_bias", m.expert_bias) for n, m in model.named_modules() if isinstance(m, MoE))]}, model.cfg)

    with atomic.replacing(out, sweep=True) as tmp:
        tmp.mkdir(parents=True)
        shards = _split(weights, max_shard_bytes)
        if len(shards) == 1:
            save_file(shards[0], str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        else:
            weight_map = {}
            for i, shard in enumerate(shards, 1):
                name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
                save_file(shard, str(tmp / name), metadata={"format": "pt"})
                weight_map.update({k: name for k in shard})
            total = sum(t.numel() * t.element_size() for t in weights.values())
            _write_json(tmp / INDEX_FILE, {"metadata": {"total_size": total}, "weight_map": weight_map})
        _write_json(tmp / CONFIG_FILE, config)
        _write_json(tmp / "generation_config.json", {**ids, **SAMPLING})
        for name, text in tokenizer.items():
            if name != "special_ids.json":
                (tmp / name).write_text(text)
        atomic.usual_mode(tmp)  # safetensors writes 0600; the folder's files get the umask's mode
    return out


def _split(weights: dict[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    """Shards of at most max_bytes each (a larger tensor gets one of its own), in name order."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(weights):
        t = weights[name]
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += n
    return shards


def _write_json(path: Path, data) -> None:  # inside the folder that is renamed whole
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


# --------------------------------------------------------------------------------------------
# The tokenizer


def tokenizer_files(data_path: str, max_len: int) -> dict[str, str]:
    """The tokenizer files of a run's data (`data.path`; empty = the built-in byte-level text):
    tokenizer.json, tokenizer_config.json and (for config.json) special_ids.json."""
    if not data_path:
        return _files(byte_tokenizer_json(), max_len)
    from scaletrain.data.prepare import META_FILE

    folder = Path(data_path)
    try:
        described = json.loads((folder / META_FILE).read_text())["tokenizer"]
    except FileNotFoundError:
        raise DataError(f"{folder}: no {META_FILE}, so the run's tokenizer cannot be exported; restore the data "
                        "folder the run trained on, or name another prepared folder with its tokenizer") from None
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError):
        raise DataError(f"{folder / META_FILE}: no tokenizer described; re-run scaletrain prepare") from None
    kind = described.get("kind") if isinstance(described, dict) else None
    if kind == "byte":
        return _files(byte_tokenizer_json(), max_len)
    if kind == "hf":  # a Hugging Face model's tokenizer: its own files, as prepare copied them
        from scaletrain.data.tokenizer import load_tokenizer

        return load_tokenizer(described, folder).hf_files(max_len)
    name = described.get("file") if isinstance(described, dict) else None
    if not isinstance(name, str) or Path(name).name != name:
        raise DataError(f"{folder}: tokenizer kind {kind!r} names no tokenizer file in this folder; "
                        "re-run scaletrain prepare")
    if not (folder / name).is_file():
        raise DataError(f"{folder / name}: the tokenizer file named in {META_FILE} is missing; "
                        "re-run scaletrain prepare")
    return _files((folder / name).read_text(), max_len)


def _files(tokenizer_json: str, max_len: int) -> dict[str, str]:
    vocab = json.loads(tokenizer_json).get("model", {}).get("vocab", {})
    added = {t["content"]: t["id"] for t in json.loads(tokenizer_json).get("added_tokens", [])}
    eot = added.get(EOT, vocab.get(EOT) if isinstance(vocab, dict) else None)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_len,
              "clean_up_tokenization_spaces": False}
    ids = {}
    if eot is not None:  # documents were joined by it: it ends (and starts) a text
        config.update(eos_token=EOT, bos_token=EOT)
        ids = {"bos_token_id": eot, "eos_token_id": eot}
    return {"tokenizer.json": tokenizer_json, "tokenizer_config.json": json.dumps(config, indent=2) + "\n",
            "special_ids.json": json.dumps(ids)}


def byte_tokenizer_json() -> str:
    """scaletrain's byte-level tokenizer (token id = UTF-8 byte) as a `tokenizers` tokenizer.json:
    a BPE without merges over the 256 byte characters."""
    try:
        import tokenizers as tk
    except ImportError:
        raise DataError("exporting the tokenizer needs the `tokenizers` package: pip install tokenizers") from None
    vocab = {c: b for b, c in enumerate(byte_chars())}
    tok = tk.Tokenizer(tk.models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = tk.decoders.ByteLevel()
    return tok.to_str(pretty=True)
