"""Llama 4 (text): a Llama whose MLPs are, in the blocks moe_layers names (every
interleave_moe_layer_step-th), a mixture of experts with a shared expert, a sigmoid router that
keeps the top k (1) and scales each chosen expert's *input* by its score (model.moe_scale_input);
whose every no_rope_layer_interval-th block has no rotary positions (model.nope_every) and, with
attn_temperature_tuning, a query temperature (model.attn_temperature, attn_temperature_floor),
the other blocks attending within chunks of attention_chunk_size (model.attn_chunk, the no-rope
blocks global: model.global_every) with a q/k norm without a weight after the rotation
(use_qk_norm: model.qk_l2_norm). Dense blocks are intermediate_size_mlp wide, experts and the
shared expert intermediate_size.

Its checkpoints differ from Llama's in three ways, which `Llama4View` (import) and `saved`
(export) translate: the MLPs live under `feed_forward` (the router `feed_forward.router`, the
shared expert `feed_forward.shared_expert`); the experts are two tensors of transposed layout,
`experts.gate_up_proj` (experts, dim, 2 * hidden), gate columns first, and `experts.down_proj`
(experts, hidden, dim); and the rotary turns interleaved pairs (x[2i], x[2i+1]), as ours does, so
q_proj and k_proj are stored in our row order (the import's rotate-half reordering is undone).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from scaletrain.errors import ConfigError
from scaletrain.model.config import ModelConfig
from scaletrain.model.families._common import ROTARY, Reader, Refuse, short
from scaletrain.model.families._moe import MoeFamily
from scaletrain.model.lazy import Lazy, read_part, shape_of

if TYPE_CHECKING:
    import torch

# Llama's names inside block i -> Llama 4's (the MLPs' own; attention and norms are alike)
RENAMED = {"mlp.gate.weight": "feed_forward.router.weight",
           "mlp.shared_expert.gate_proj.weight": "feed_forward.shared_expert.gate_proj.weight",
           "mlp.shared_expert.up_proj.weight": "feed_forward.shared_expert.up_proj.weight",
           "mlp.shared_expert.down_proj.weight": "feed_forward.shared_expert.down_proj.weight",
           "mlp.gate_proj.weight": "feed_forward.gate_proj.weight", "mlp.up_proj.weight": "feed_forward.up_proj.weight",
           "mlp.down_proj.weight": "feed_forward.down_proj.weight",
           # transformers' fused experts, (experts, out, in) in Llama's view, (experts, in, out) in Llama 4's
           "mlp.experts.gate_up_proj": "feed_forward.experts.gate_up_proj",
           "mlp.experts.down_proj": "feed_forward.experts.down_proj"}
TRANSPOSED = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


class Llama4Text(MoeFamily):
    model_type = "llama4_text"
    architecture = "Llama4ForCausalLM"
    known = ROTARY | {"intermediate_size_mlp", "num_local_experts", "num_experts_per_tok", "moe_layers",
                      "interleave_moe_layer_step", "use_qk_norm", "router_jitter_noise", "no_rope_layers",
                      "no_rope_layer_interval", "attention_chunk_size", "layer_types", "attn_temperature_tuning",
                      "floor_scale", "attn_scale", "attention_bias"}
    defaults = dict(num_key_value_heads=8, head_dim=128, hidden_act="silu", max_position_embeddings=4096 * 32,
                    rms_norm_eps=1e-5, tie_word_embeddings=False, rope_theta=500000.0, intermediate_size=8192,
                    intermediate_size_mlp=16384, num_local_experts=16, num_experts_per_tok=1, moe_layers=None,
                    interleave_moe_layer_step=1, use_qk_norm=True, router_jitter_noise=0.0, no_rope_layers=None,
                    no_rope_layer_interval=4, attention_chunk_size=8192, layer_types=None,
                    attn_temperature_tuning=True, floor_scale=8192, attn_scale=0.1, attention_bias=False)
    output_bias_refused = True
    fused = True  # its tensors seen as Llama's through `llama_view`
    adapter_refusal = ("adapters of a Llama 4 model are not exported to PEFT: its MLP modules are named apart "
                       "(feed_forward) and its q/k rows are not reordered; merge them instead (scaletrain export)")

    def fields(self, get: Reader, refuse: Refuse, strict: bool) -> dict[str, Any]:
        out = super().fields(get, refuse, strict)
        out["ffn_dim"] = get.int("intermediate_size_mlp")  # the dense blocks' width
        nope = self._nope_every(get, refuse, out["n_layers"])
        chunk = get.int("attention_chunk_size", optional=True) or 0
        out.update(nope_every=nope, attn_chunk=chunk, global_every=nope if chunk else 0,
                   qk_l2_norm=get.bool("use_qk_norm"))
        if nope and get.bool("attn_temperature_tuning") and get.float("attn_scale"):
            out.update(attn_temperature=get.float("attn_scale"), attn_temperature_floor=get.int("floor_scale"))
            if out["attn_temperature_floor"] < 1:
                refuse("floor_scale", "should be a positive number of positions")
        self._check_layer_types(get, refuse, out)
        return out

    def _nope_every(self, get: Reader, refuse: Refuse, n_layers: int) -> int:
        """model.nope_every of no_rope_layers (1 = the block rotates) or its interval."""
        every = get.int("no_rope_layer_interval")
        given = get.raw("no_rope_layers")
        if not given:  # transformers: every interval-th block has no rotary
            return every if every >= 1 else 0
        if not isinstance(given, list) or len(given) != n_layers or any(v not in (0, 1) for v in given):
            raise ConfigError(f"{get.where}: no_rope_layers should be a list of {n_layers} zeros and ones, got "
                              f"{short(given)}")
        nope = [i for i, v in enumerate(given) if v == 0]
        every = nope[0] + 1 if nope else 0
        if nope != [i for i in range(n_layers) if every and (i + 1) % every == 0]:
            refuse("no_rope_layers", f"leaves blocks {nope} without rotary positions; scaletrain's are every n-th "
                                     "block (model.nope_every)")
        return every

    def _check_layer_types(self, get: Reader, refuse: Refuse, out: dict[str, Any]) -> None:
        """layer_types, where given, must be what transformers derives: chunked where the block rotates."""
        given = get.raw("layer_types")
        if given is None:
            return
        nope = out["nope_every"]
        derived = ["chunked_attention" if out["attn_chunk"] and not (nope and (i + 1) % nope == 0) else
                   "full_attention" for i in range(out["n_layers"])]
        if given != derived:
            refuse("layer_types", f"differs from the blocks attention_chunk_size and the no-rope blocks make "
                                  f"({short(derived)}); scaletrain chunks the rotary blocks only")

    def router_checks(self, get: Reader, refuse: Refuse) -> None:
        if get.float("router_jitter_noise"):
            refuse("router_jitter_noise", "scales the router's input by random noise in training; scaletrain's "
                                          "router has no jitter: set it to 0")

    def moe_fields(self, get: Reader, refuse: Refuse, n_layers: int) -> dict[str, Any]:
        out = super().moe_fields(get, refuse, n_layers)
        if out:  # a sigmoid of each chosen logit, scaling the expert's input; one shared expert as wide
            out.update(moe_score="sigmoid", moe_scale_input=True, moe_shared_experts=1,
                       moe_hidden=get.int("intermediate_size"))
        return out

    def renorm(self, get: Reader) -> bool:
        return False

    def moe_blocks(self, get: Reader, refuse: Refuse, out: dict[str, Any], n_layers: int) -> dict[str, Any]:
        step = get.raw("interleave_moe_layer_step")
        if isinstance(step, bool) or not isinstance(step, int) or step < 1:
            raise ConfigError(f"{get.where}: interleave_moe_layer_step should be a positive integer, got {short(step)}")
        moe = get.raw("moe_layers")
        if moe is None:
            moe = list(range(step - 1, n_layers, step))
        if not isinstance(moe, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in moe):
            raise ConfigError(f"{get.where}: moe_layers should be a list of layer indices, got {short(moe)}")
        moe = sorted(i for i in set(moe) if 0 <= i < n_layers)
        if not out["moe_experts"] or not moe:
            return {}  # a dense model
        first, every = moe[0], (moe[1] - moe[0] if len(moe) > 1 else n_layers)
        out.update(moe_first_dense=first, moe_every=every)
        if moe != [i for i in range(n_layers) if i >= first and (i - first) % every == 0]:
            refuse("moe_layers", f"makes blocks {moe} mixtures of experts, which model.moe_first_dense and moe_every "
                                 "(every n-th block after the first dense ones) cannot express")
        return out

    def hf_extra(self, cfg: ModelConfig, out: dict[str, Any]) -> None:
        super().hf_extra(cfg, out)
        moe = [i for i in range(cfg.n_layers) if cfg.is_moe_block(i)]
        out.update(intermediate_size=cfg.expert_hidden if cfg.moe_experts else cfg.hidden_dim,
                   intermediate_size_mlp=cfg.hidden_dim, num_local_experts=max(1, cfg.moe_experts),
                   moe_layers=moe, interleave_moe_layer_step=1, router_jitter_noise=0.0, attention_bias=False,
                   use_qk_norm=cfg.qk_l2_norm, no_rope_layer_interval=cfg.nope_every or cfg.n_layers + 1,
                   no_rope_layers=[int(not cfg.is_nope_block(i)) for i in range(cfg.n_layers)],
                   attention_chunk_size=cfg.attn_chunk or None, layer_types=None,
                   attn_temperature_tuning=bool(cfg.attn_temperature), attn_scale=cfg.attn_temperature,
                   floor_scale=cfg.attn_temperature_floor)
        if not cfg.moe_experts:
            out.update(num_experts_per_tok=1)

    def chosen(self, cfg: ModelConfig, no) -> str:
        """This family, if it computes what `cfg` computes, else `no`'s ConfigError."""
        unlike = [why for why, differs in (
            ("is rope, rmsnorm, swiglu with norms before the sub-blocks and no biases",
             not (cfg.position == "rope" and cfg.norm == "rmsnorm" and cfg.activation == "swiglu"
                  and cfg.norm_placement == "pre") or cfg.bias or cfg.qkv_bias),
            ("has no weighted q/k norm (model.qk_norm), sliding window nor soft-capping",
             cfg.qk_norm or cfg.sliding_window or cfg.attn_softcap or cfg.logit_softcap or cfg.attn_scale_dim),
            ("chunks exactly the rotary blocks (model.global_every = nope_every with attn_chunk)",
             cfg.global_every != (cfg.nope_every if cfg.attn_chunk else 0)),
            ("has none of Gemma's and GPT-NeoX's options (embed_scale, norm_unit_offset, parallel_residual, "
             "rotary_fraction, rope_local_theta)", cfg.embed_scale or cfg.norm_unit_offset or cfg.parallel_residual
             or cfg.rotary_fraction != 1.0 or cfg.rope_local_theta),
            ("routes by a sigmoid scaling the experts' input, one shared expert as wide, dropless, no rescaling",
             cfg.moe_experts and (cfg.moe_score != "sigmoid" or not cfg.moe_scale_input or cfg.moe_renorm
                                  or cfg.moe_shared_experts != 1 or cfg.moe_route_scale != 1.0
                                  or cfg.moe_capacity_factor))) if differs]
        if unlike:
            raise no(f"Llama 4 {unlike[0]}")
        return self.model_type

    # weights ------------------------------------------------------------------------------------

    def recognises(self, keys) -> bool:
        return any(".feed_forward." in k for k in keys)

    def llama_view(self, source: Mapping[str, torch.Tensor], cfg: ModelConfig) -> Mapping[str, torch.Tensor]:
        return Llama4View(source, cfg, self.layers)

    def saved(self, tensors: dict[str, torch.Tensor], weights: Mapping[str, torch.Tensor],
              cfg: ModelConfig) -> dict[str, torch.Tensor]:
        """Llama-named tensors (one matrix per expert, q/k rows in rotate-half order) as Llama 4's."""
        import torch

        out: dict[str, torch.Tensor] = {}
        experts: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
        for key, t in tensors.items():
            i, rest = _in_block(key, self.layers)
            if rest is None:
                out[key] = t
            elif rest.startswith("mlp.experts."):  # mlp.experts.E.gate_proj.weight
                _, _, e, matrix, _ = rest.split(".")
                experts.setdefault((i, matrix), {})[int(e)] = t
            elif rest in ("self_attn.q_proj.weight", "self_attn.k_proj.weight"):
                heads = cfg.n_heads if rest.startswith("self_attn.q") else cfg.kv_heads
                out[key] = interleaved(t, heads).contiguous()
            else:
                out[f"{self.layers}.{i}.{RENAMED.get(rest, rest)}"] = t
        for (i, matrix), parts in experts.items():
            if matrix == "down_proj":  # (experts, dim, hidden) in Llama's view -> (experts, hidden, dim)
                out[f"{self.layers}.{i}.feed_forward.experts.down_proj"] = _stack(parts).transpose(1, 2).contiguous()
            elif matrix == "gate_proj":  # gate then up along the output: (experts, dim, 2 * hidden)
                up = _stack(experts[(i, "up_proj")])
                fused = torch.cat((_stack(parts), up), dim=1)
                out[f"{self.layers}.{i}.feed_forward.experts.gate_up_proj"] = fused.transpose(1, 2).contiguous()
        return out


def _stack(parts: dict[int, torch.Tensor]) -> torch.Tensor:
    import torch

    return torch.stack([parts[e] for e in range(len(parts))])


def _in_block(key: str, layers: str) -> tuple[str, str | None]:
    """(block index, the name inside the block) of `key`, or (\"\", None) outside the blocks."""
    if not key.startswith(layers + "."):
        return "", None
    i, rest = key[len(layers) + 1:].split(".", 1)
    return i, rest


def rotate_half(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of each head from the interleaved order (x[2i], x[2i+1]) to rotate-half's (x[i], x[i+d/2])."""
    d, rest = t.shape[0] // heads, t.shape[1:]
    return t.reshape(heads, d // 2, 2, *rest).transpose(1, 2).reshape(t.shape)


def interleaved(t: torch.Tensor, heads: int) -> torch.Tensor:
    """The inverse of rotate_half."""
    d, rest = t.shape[0] // heads, t.shape[1:]
    return t.reshape(heads, 2, d // 2, *rest).transpose(1, 2).reshape(t.shape)


class Llama4View(Lazy):
    """A Llama 4 checkpoint under Llama's names and layouts: the MLPs' tensors renamed, the experts
    transposed to transformers' (experts, out, in), q_proj and k_proj in rotate-half row order (which
    the import turns back). Read a part at a time: whole heads of q/k rows, the experts' slices."""

    def __init__(self, source: Mapping[str, torch.Tensor], cfg: ModelConfig, layers: str):
        self.source, self.cfg = source, cfg
        back = {theirs: ours for ours, theirs in RENAMED.items()}
        self.names: dict[str, str] = {}  # Llama's name -> the source's
        for key in source:
            i, rest = _in_block(key, layers)
            self.names[key if rest is None else f"{layers}.{i}.{back.get(rest, rest)}"] = key

    @property
    def bytes_read(self) -> int:
        return getattr(self.source, "bytes_read", 0)

    @property
    def total_bytes(self) -> int:
        return getattr(self.source, "total_bytes", 0)

    def _heads(self, key: str) -> int:
        if key.endswith("self_attn.q_proj.weight"):
            return self.cfg.n_heads
        return self.cfg.kv_heads if key.endswith("self_attn.k_proj.weight") else 0

    def shape(self, key: str) -> tuple[int, ...]:
        shape = shape_of(self.source, self.names[key])
        return (shape[0], shape[2], shape[1]) if key.endswith(TRANSPOSED) else shape

    def read(self, key: str, index: tuple) -> torch.Tensor:
        source = self.names[key]
        if key.endswith(TRANSPOSED):
            experts, rows, cols = index
            return read_part(self.source, source, (experts, cols, rows)).transpose(1, 2)
        heads = self._heads(key)
        if not heads:
            return read_part(self.source, source, index)
        rows, rest = index[0], tuple(index[1:])
        start, stop = rows.indices(self.shape(key)[0])[:2]
        d = self.shape(key)[0] // heads
        lo, hi = start // d * d, -(-stop // d) * d  # whole heads
        if hi <= lo:  # an empty shard
            return read_part(self.source, source, (slice(0, 0), *rest))
        t = rotate_half(read_part(self.source, source, (slice(lo, hi), *rest)), (hi - lo) // d)
        return t[start - lo:stop - lo]

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.read(key, tuple(slice(0, n) for n in self.shape(key)))

    def __iter__(self):
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


FAMILY = Llama4Text()
