"""Activations counted from the actual model, without running it.

The model (one layer of it, and the model with no layers for the embedding, head and loss) is
built on fake tensors — shapes and dtypes, no data — with the same tensor parallelism,
sequence parallelism, checkpointing and precision as the layout, on a fake process group of
`tp` ranks in this one process. A forward pass and the loss run under a tracker that sees every
tensor created; the storages still alive afterwards are what backward needs. One layer's share
is the difference between the two-layer and the one-layer model, so it can be scaled by the
number of layers. Any `nn.Module` that takes token ids can be traced whole the same way.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from functools import lru_cache

import torch
import torch.distributed as dist

from scaletrain.errors import ConfigError
from scaletrain.model.config import ModelConfig
from scaletrain.plan.spec import Workload

_FAKE_WORLD = {"size": None}


@contextlib.contextmanager
def _fake_world(size: int):
    """A process group of `size` ranks that exists only in this process (collectives do nothing)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized() and _FAKE_WORLD["size"] is None:
        raise ConfigError("the traced activation count runs in a process of its own; this process already "
                          "belongs to a process group (use the closed form here: --activations formula)")
    if _FAKE_WORLD["size"] != size:
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=size)
        _FAKE_WORLD["size"] = size
    from torch.distributed.device_mesh import init_device_mesh

    yield init_device_mesh("cpu", (size,), mesh_dim_names=("tp",))


def release_fake_world() -> None:
    if _FAKE_WORLD["size"] is not None and dist.is_initialized():
        dist.destroy_process_group()
    _FAKE_WORLD["size"] = None


def traced_activation_bytes(cfg: ModelConfig, wl: Workload, b: int, tp: int, sp: bool, ac: str) -> tuple[float, float]:
    """(bytes per layer, bytes of embedding + head + loss) for micro-batches of b sequences."""
    key = json.dumps(dataclasses.asdict(cfg), sort_keys=True)
    return _traced(key, wl.seq_len, wl.precision, wl.attention, b, tp, sp, ac)


@lru_cache(maxsize=256)
def _traced(cfg_json: str, seq_len: int, precision: str, attention: str, b: int, tp: int, sp: bool, ac: str):
    if attention != "flash":
        raise ConfigError("the traced count measures scaletrain's model, which uses memory-efficient attention; "
                          "use --activations formula for eager attention")
    cfg = ModelConfig(**json.loads(cfg_json))
    cfg = dataclasses.replace(cfg, max_seq_len=max(cfg.max_seq_len, seq_len), dropout=0.0)
    # two layers minus one layer is one layer's share; what one layer leaves over is the rest
    # (a model without layers would not be a valid sequence-parallel model)
    one = _trace_model(dataclasses.replace(cfg, n_layers=1), seq_len, precision, b, tp, sp, ac)
    two = _trace_model(dataclasses.replace(cfg, n_layers=2), seq_len, precision, b, tp, sp, ac)
    return float(two - one), float(2 * one - two)


def _trace_model(cfg: ModelConfig, seq_len: int, precision: str, b: int, tp: int, sp: bool, ac: str) -> int:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from scaletrain.memory import apply_activation_checkpointing, saved_activation_bytes
    from scaletrain.model.loss import cross_entropy_sum
    from scaletrain.model.mtp import MTPLoss
    from scaletrain.model.transformer import Transformer

    mesh_ctx = _fake_world(tp) if tp > 1 else contextlib.nullcontext()
    default_dtype = torch.get_default_dtype()
    with mesh_ctx as mesh, FakeTensorMode(allow_non_fake_inputs=True):
        try:  # bf16-true builds its parameters in bf16 directly (no conversion of fake tensors)
            torch.set_default_dtype(torch.bfloat16 if precision == "bf16-true" else default_dtype)
            model = Transformer(cfg)
        finally:
            torch.set_default_dtype(default_dtype)
        if tp > 1:
            from scaletrain.parallel.tensor_parallel import apply_tensor_parallel

            apply_tensor_parallel(model, mesh, sequence_parallel=sp, first_block="0")
        apply_activation_checkpointing(model.layers, ac)
        tokens = torch.randint(0, cfg.vocab_size, (b, seq_len))
        targets = torch.randint(0, cfg.vocab_size, (b, seq_len))
        # (multi-token prediction: its depths' logits follow the main head's, and its loss reads them)
        loss_fn = MTPLoss(cfg.mtp_depth, cfg.mtp_loss_weight) if cfg.mtp_depth else cross_entropy_sum
        return saved_activation_bytes(model, _forward(model, tokens, targets, precision, tp, loss_fn),
                                      backward=False)


def _forward(model, tokens, targets, precision: str, tp: int, loss_fn):
    def run():
        autocast = {"16-mixed": torch.float16, "bf16-mixed": torch.bfloat16}.get(precision)
        ctx = torch.autocast("cpu", dtype=autocast) if autocast else contextlib.nullcontext()
        if tp > 1:
            from torch.distributed.tensor.parallel import loss_parallel

            with loss_parallel(), ctx:
                logits = model(tokens)
            with loss_parallel():
                return loss_fn(logits, targets)
        with ctx:
            logits = model(tokens)
        return loss_fn(logits, targets)

    return run


def traced_module_bytes(module: torch.nn.Module, wl: Workload, b: int, vocab_size: int) -> int:
    """Saved activations of a whole module fed token ids (b, seq_len), counted on fake tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from scaletrain.memory import saved_activation_bytes

    with FakeTensorMode(allow_non_fake_inputs=True):
        tokens = torch.randint(0, vocab_size, (b, wl.seq_len))

        def run():
            out = module(tokens)
            out = out[0] if isinstance(out, (tuple, list)) else getattr(out, "logits", out)
            return out.float().sum()

        return saved_activation_bytes(module, run, backward=False)
