"""An import exported untouched gives back the file transformers wrote, tensor for tensor: the same
names, dtypes and bytes, for every tiny model of the family tests. The logits tests cannot see a
tensor that does not change the logits (a key projection's bias shifts each query's scores alike;
softmax drops it) nor a head saved under a name only transformers 5 maps; this sees both."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402

import test_hf_families  # noqa: E402
from scaletrain.trained.export_hf import save_hf  # noqa: E402
from test_config_round_trip import TINY_MODELS  # noqa: E402

from conftest import model_from_hf  # noqa: E402

# each tiny model's make_hf (folder) -> the transformers model it saved there
MAKERS = {name: (lambda folder, m=module, a=args, c=change: m.make_hf(*a, folder, **c))
          for name, (module, args, change) in TINY_MODELS.items()}


def tensors(folder) -> dict[str, torch.Tensor]:
    return load_file(folder / "model.safetensors")


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, str]:
    """What differs between two files' tensors (nothing: {})."""
    out = {k: "only in the first" for k in a.keys() - b.keys()} | {k: "only in the second" for k in b.keys() - a.keys()}
    out |= {k: f"{a[k].dtype} vs {b[k].dtype}" for k in a.keys() & b.keys() if a[k].dtype != b[k].dtype}
    return out | {k: "other values" for k in a.keys() & b.keys() if k not in out and not torch.equal(a[k], b[k])}


@pytest.mark.parametrize("name", MAKERS)
def test_an_untouched_import_exports_the_file_transformers_wrote(name, tmp_path):
    MAKERS[name](tmp_path / "hf")
    save_hf(model_from_hf(tmp_path / "hf", 16), tmp_path / "out")
    assert same(tensors(tmp_path / "hf"), tensors(tmp_path / "out")) == {}


def test_a_gpt_neox_head_named_lm_head_is_read_too(tmp_path):
    """transformers writes GPT-NeoX's head as embed_out (so does the export); one named lm_head, as
    the model holds it in memory, imports alike."""
    tokens = torch.arange(16)[None] * 7 % 128
    hf = test_hf_families.make_hf("neox-parallel", tmp_path / "hf")
    file = tensors(tmp_path / "hf")
    file["lm_head.weight"] = file.pop("embed_out.weight")
    save_file(file, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    with torch.no_grad():
        assert (model_from_hf(tmp_path / "hf", 16)(tokens) - hf(tokens).logits).abs().max() <= 1e-5


def test_a_gpt2_without_biases_exports_zero_biases(tmp_path):
    """GPT-2 has biases on every linear layer; a model without them exports zeros there (the same
    function), and transformers computes what it computes."""
    from scaletrain.model.config import ModelConfig
    from scaletrain.model.transformer import Transformer

    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=128, dim=64, n_layers=2, n_heads=4, max_seq_len=32, bias=False)).eval()
    save_hf(model, tmp_path / "out")
    file = tensors(tmp_path / "out")
    biases = {k: t for k, t in file.items() if k.endswith(("attn.bias", "proj.bias", "fc.bias"))}
    assert len(biases) == 2 * 4 and all(not t.any() for t in biases.values())  # c_attn, attn/mlp c_proj, c_fc
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager").eval()
    tokens = torch.arange(16)[None] * 7 % 128
    with torch.no_grad():
        assert (back(tokens).logits - model(tokens)).abs().max() <= 1e-5
