"""Post-training quantization (`scaletrain quantize`): a trained model's linear layers converted
to int8 (or int4) weights by torchao's `quantize_`, written as a folder that loads without
unpickling anything.

What it saves: weights of 4 bytes become 1 (int8) or half of one (int4, two to a byte on disk),
plus a fp32 scale per row (int8) or per 32 inputs (int4). What it costs: the rounding error
(validation perplexity rises a little; quantization-aware training, qat.py, wins most of it
back), and on a CPU without kernels for these types, speed (see quant/__init__.py).

The folder (FORMAT):

    quantization.json   scheme, torchao version, the run's config, and per layer: converted or
                        why it stayed high precision
    model.safetensors   high-precision tensors under their own names; for each converted linear
                        NAME.qdata (int8, or int4 packed two to a uint8), NAME.scale (fp32),
                        NAME.zero_point (int8) and NAME.bias if it has one

Loading (`load_quantized`) builds the plain model, fills it from the safetensors file, and puts
torchao's quantized weight tensors back together from those plain tensors: no pickle is read.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from scaletrain import atomic
from scaletrain.errors import CheckpointError
from scaletrain.model.transformer import Transformer
from scaletrain.quant import import_torchao
from scaletrain.quant.layers import GROUP_SIZE, layer_plan
from scaletrain.vocab import QUANT_SCHEMES, unknown

FORMAT = "scaletrain-quantized"
FORMAT_VERSION = 1
INFO_FILE = "quantization.json"
WEIGHTS_FILE = "model.safetensors"


def torchao_config(scheme: str):
    """The torchao config that quantizes a linear layer by `scheme`."""
    import_torchao("scaletrain quantize")
    from torchao.quantization import (
        Int8DynamicActivationInt8WeightConfig,
        Int8DynamicActivationIntxWeightConfig,
        Int8WeightOnlyConfig,
        PerGroup,
    )

    if scheme == "int8-weight":
        return Int8WeightOnlyConfig(set_inductor_config=False)
    if scheme == "int8-dynamic":  # asymmetric activations: QAT's per-token fake quantizer has no symmetric one
        from torchao.quantization.quant_primitives import MappingType

        return Int8DynamicActivationInt8WeightConfig(act_mapping_type=MappingType.ASYMMETRIC,
                                                     set_inductor_config=False)
    if scheme == "int8-int4":
        return Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=PerGroup(GROUP_SIZE))
    raise unknown("quantization scheme", scheme, QUANT_SCHEMES)


def quantize_model(model: nn.Module, scheme: str) -> dict[str, str | None]:
    """Quantize `model`'s linear layers in place by `scheme` (the rule of quant/layers.py);
    returns the layer plan."""
    plan = layer_plan(model, scheme)
    config = torchao_config(scheme)
    from torchao.quantization import quantize_

    convert = {n for n, why in plan.items() if why is None}
    with torch.no_grad():
        quantize_(model, config, filter_fn=lambda m, fqn: isinstance(m, nn.Linear) and fqn in convert)
    return plan


# --------------------------------------------------------------------------------------------
# The folder


def quantized_tensors(model: nn.Module, plan: dict[str, str | None]) -> dict[str, torch.Tensor]:
    """Every tensor of a quantized model as plain tensors: converted linears as qdata, scale and
    zero point (int4 qdata packed two to a byte), the rest under their own names."""
    out: dict[str, torch.Tensor] = {}
    converted = {n for n, why in plan.items() if why is None}
    for name, p in model.named_parameters():  # a tied weight appears once, under its first name
        module = name.rsplit(".", 1)[0]
        if module in converted and name.endswith(".weight"):
            w = p.data if isinstance(p, nn.Parameter) else p
            int4 = getattr(w, "target_dtype", None) == torch.int4
            out[f"{module}.qdata"] = pack_int4(w.qdata) if int4 else w.qdata.contiguous()
            out[f"{module}.scale"] = w.scale.float().contiguous()
            out[f"{module}.zero_point"] = w.zero_point.to(torch.int8).contiguous()
        else:
            out[name] = p.detach().float().contiguous()
    return out


def save_quantized(model: nn.Module, plan: dict[str, str | None], scheme: str, out: str | Path,
                   info: dict, *, overwrite: bool = False) -> Path:
    """Write quantized `model` to the folder `out` (whole, or not at all). `info`: what else
    quantization.json records (the run's config, its step, where the weights came from)."""
    from safetensors.torch import save_file

    torchao = import_torchao("scaletrain quantize")
    out = Path(out)
    if out.exists() and not overwrite:
        raise CheckpointError(f"--out {out} already exists; choose another --out, or add --overwrite to replace it "
                              "(nothing was overwritten)")
    tensors = quantized_tensors(model, plan)
    layers = {n: {"converted": why is None, **({"kept": why} if why else {})} for n, why in plan.items()}
    meta = {"format": FORMAT, "format_version": FORMAT_VERSION, "scheme": scheme, "group_size": GROUP_SIZE,
            "torchao": torchao.__version__, "layers": layers, **info}
    with atomic.replacing(out, sweep=True) as tmp:
        tmp.mkdir(parents=True)
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        (tmp / INFO_FILE).write_text(json.dumps(meta, indent=1, sort_keys=True) + "\n")
        atomic.usual_mode(tmp)
    return out


def is_quantized_folder(path: str | Path) -> bool:
    return (Path(path) / INFO_FILE).is_file()


def read_info(path: str | Path) -> dict:
    """quantization.json of folder `path`, checked."""
    f = Path(path) / INFO_FILE
    try:
        info = json.loads(f.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{f}: not valid JSON ({e}); the quantized folder is damaged") from None
    if not isinstance(info, dict) or info.get("format") != FORMAT:
        raise CheckpointError(f"{f}: not a scaletrain quantized model (no \"format\": \"{FORMAT}\")")
    if info.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{f}: format version {info.get('format_version')!r}; this scaletrain reads "
                              f"{FORMAT_VERSION}: use the scaletrain that wrote it")
    if info.get("scheme") not in QUANT_SCHEMES or not isinstance(info.get("layers"), dict) \
            or not isinstance(info.get("config"), dict) or not isinstance(info["config"].get("model"), dict):
        raise CheckpointError(f"{f}: missing or malformed scheme, layers or config; the quantized folder is damaged")
    return info


def load_quantized(path: str | Path) -> tuple[Transformer, dict]:
    """(the quantized model on the CPU, in eval mode, its quantization.json) from folder `path`.
    Reads JSON and safetensors only."""
    from scaletrain.model.config import model_config

    path = Path(path)
    info = read_info(path)
    # the saved config's model section is whole (every key, as the run resolved it): no preset or
    # Hugging Face config is read again, the keys are only checked
    scheme, cfg = info["scheme"], model_config(info["config"]["model"], source=str(path / INFO_FILE))
    tensors = _read_weights(path / WEIGHTS_FILE)
    model = Transformer(cfg)
    converted = {n for n, v in info["layers"].items() if v.get("converted")}
    for name, m in model.named_modules():
        if name in converted and not isinstance(m, nn.Linear):
            raise CheckpointError(f"{path / INFO_FILE}: layer {name} is not a linear layer of this model; "
                                  "the quantized folder is damaged")
    with torch.no_grad():
        for name, p in model.named_parameters():
            module = name.rsplit(".", 1)[0]
            if module in converted and name.endswith(".weight"):
                continue
            if name not in tensors or tensors[name].shape != p.shape:
                raise CheckpointError(f"{path / WEIGHTS_FILE}: tensor {name} is missing or of another shape; the "
                                      "quantized folder is damaged")
            _check_dtype(tensors[name], torch.float32, f"{path / WEIGHTS_FILE}: {name}")
            p.copy_(tensors[name])
        for name in converted:
            linear = model.get_submodule(name)
            weight = _weight_tensor(scheme, {k: tensors.get(f"{name}.{k}") for k in ("qdata", "scale", "zero_point")},
                                    tuple(linear.weight.shape), f"{path / WEIGHTS_FILE}: {name}")
            linear.weight = nn.Parameter(weight, requires_grad=False)
    return model.eval(), info


def _read_weights(file: Path) -> dict[str, torch.Tensor]:
    """The tensors of a quantized folder's safetensors file; a missing, cut short or garbled
    file is one line."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if not file.is_file():
        raise CheckpointError(f"{file} is missing; the quantized folder is damaged: quantize the checkpoint again")
    try:
        return load_file(str(file))
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise CheckpointError(f"{file}: not a readable safetensors file ({why}): it is truncated or corrupt; the "
                              "quantized folder is damaged: quantize the checkpoint again") from None


def _check_dtype(tensor: torch.Tensor, want: torch.dtype, where: str) -> None:
    if tensor.dtype != want:
        raise CheckpointError(f"{where} is {str(tensor.dtype).removeprefix('torch.')}, not "
                              f"{str(want).removeprefix('torch.')}; the quantized folder is damaged: quantize the "
                              "checkpoint again")


def _weight_tensor(scheme: str, parts: dict[str, torch.Tensor | None], shape: tuple[int, int], where: str):
    """torchao's quantized weight of `scheme`, put together from its plain tensors."""
    import_torchao("loading a quantized model")
    from torchao.quantization.quantize_.workflows.int8.int8_tensor import Int8Tensor, QuantizeTensorToInt8Kwargs
    from torchao.quantization.quantize_.workflows.intx.intx_unpacked_to_int8_tensor import IntxUnpackedToInt8Tensor

    rows, cols = shape
    groups = cols // GROUP_SIZE if scheme == "int8-int4" else 1
    qshape = (rows, (cols + 1) // 2) if scheme == "int8-int4" else shape
    expected = {"qdata": qshape, "scale": (rows, groups), "zero_point": (rows, groups)}
    dtypes = {"qdata": torch.uint8 if scheme == "int8-int4" else torch.int8, "scale": torch.float32,
              "zero_point": torch.int8}  # as quantized_tensors writes them
    for k, want in expected.items():
        if parts[k] is None or tuple(parts[k].shape) != want:
            raise CheckpointError(f"{where}.{k} is missing or not of shape {want}; the quantized folder is damaged")
        _check_dtype(parts[k], dtypes[k], f"{where}.{k}")
    if scheme == "int8-int4":
        return IntxUnpackedToInt8Tensor(unpack_int4(parts["qdata"], cols), parts["scale"], parts["zero_point"],
                                        torch.int4, (1, GROUP_SIZE), torch.float32, "int8_asym_per_token")
    act = None
    if scheme == "int8-dynamic":  # how the scheme quantizes activations, as its config says
        config = torchao_config(scheme)
        act = QuantizeTensorToInt8Kwargs(granularity=Int8Tensor._normalize_granularity(config.granularity)[0],
                                         mapping_type=config.act_mapping_type)
    return Int8Tensor(parts["qdata"], parts["scale"], [1, cols], torch.float32, zero_point=parts["zero_point"],
                      act_quant_kwargs=act)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int8 values in [-8, 7] (rows, cols) -> uint8 (rows, ceil(cols / 2)): column 2i in the low
    four bits, 2i+1 in the high four, each offset by 8."""
    u = (q.to(torch.int16) + 8).to(torch.uint8)
    if u.shape[-1] % 2:
        u = torch.nn.functional.pad(u, (0, 1), value=8)
    return (u[..., 0::2] | (u[..., 1::2] << 4)).contiguous()


def unpack_int4(packed: torch.Tensor, cols: int) -> torch.Tensor:
    low, high = packed & 0xF, packed >> 4
    both = torch.stack((low, high), dim=-1).flatten(-2)[..., :cols]
    return (both.to(torch.int16) - 8).to(torch.int8)


def folder_bytes(path: str | Path) -> int:
    """The size of a saved model on disk: a file, or the files of a folder."""
    path = Path(path)
    return path.stat().st_size if path.is_file() else sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
