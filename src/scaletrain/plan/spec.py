"""What the planner is asked about: a model, a workload, a cluster, a layout.

A model arrives as a built-in preset name, a TOML file with a [model] section, a Hugging Face
`config.json`, a `ModelConfig`, or (from Python) a live `nn.Module`. Everything but the last
becomes a `ModelConfig`, for which the planner has closed forms; a module it cannot describe
is counted on the meta device and traced.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scaletrain.config import completion_room_problem, from_dict, read_config_file
from scaletrain.errors import ConfigError
from scaletrain.hardware import Hardware
from scaletrain.layout import Layout  # noqa: F401 - the one Layout, re-exported for the planner
from scaletrain.legality import Techniques
from scaletrain.model.config import ModelConfig
from scaletrain.vocab import ADAPTER_KINDS, BASE_DTYPES, OPTIMIZERS, PLAN_ENGINES, PRECISIONS, QAT_SCHEMES, did_you_mean

ATTENTION = ("flash", "eager")  # memory-efficient kernels (SDPA flash / efficient) or materialized scores

__all__ = ["ATTENTION", "Cluster", "Layout", "ModelSource", "Workload", "hf_config_to_model", "load_model"]


@dataclass(frozen=True)
class Workload:
    seq_len: int
    global_batch: int  # sequences per optimizer step
    precision: str = "bf16-mixed"
    optimizer: str = "adamw"
    attention: str = "flash"
    engine: str = "scaletrain"  # the engine that trains it: what it keeps, how it communicates
    compile: bool = False  # torch.compile: element-wise work fused (less memory traffic)
    fp8: bool = False  # the linear layers' matmuls in float8 (torchao / Transformer Engine)
    # a mixture of experts' load: max / mean tokens per expert (1 = balanced, as published
    # figures force it); the busiest expert-parallel rank computes and receives this much more
    moe_imbalance: float = 1.0
    # adapter fine-tuning (adapter.kind, rank, targets, base_dtype): the base frozen, the adapted
    # linears' bases stored as base_dtype (scaletrain.plan.adapters)
    adapter: str = "none"
    adapter_rank: int = 8
    adapter_targets: str = "all-linear"
    base_dtype: str = "auto"
    qat: str = "none"  # train.qat: fake-quantized linears (what they allow: scaletrain.legality)
    document_mask: bool = False  # data.document_mask: pp and cp cannot find a window's documents
    # train.objective=preference: where the reference log-probs come from (scaletrain.config.preference_reference):
    # model = a frozen copy sharded like the policy (its weights' memory, a forward a step), adapters = the policy
    # with its adapters off (a forward a step), precomputed = a pass before training, none = no reference
    reference: str = "none"
    objective: str = "lm"  # train.objective: preference counts two sequences a pair in global_batch
    # train.objective=rl (scaletrain.plan.rl): completions per prompt, the longest completion, optimizer steps a
    # round of rollouts feeds, and whether an update needs the sampling policy's log-probs first (a forward)
    rl_group: int = 0
    rl_new_tokens: int = 0
    rl_updates: int = 1
    rl_old_pass: bool = False

    @property
    def rows_per_example(self) -> int:
        """Sequences of one training example: a preference pair's two, else one."""
        return 2 if self.objective == "preference" else 1

    @property
    def batch_note(self) -> str:
        """What the global batch's sequences are, where it is not plain sequences."""
        if self.objective == "rl":
            ref = "no reference" if self.reference == "none" else f"reference: {self.reference}"
            return (f" completions ({self.global_batch // max(1, self.rl_group)} prompts x {self.rl_group}, at most "
                    f"{self.rl_new_tokens} new tokens each, sampled every {self.rl_updates} step(s); {ref})")
        if self.objective != "preference":
            return ""
        ref = {"none": "no reference", "precomputed": "reference precomputed before training",
               "model": "reference: a frozen copy, a forward a step", "adapters": "reference: adapters off, a forward "
               "a step"}[self.reference]
        return f" sequences ({self.global_batch // 2} preference pairs; {ref})"

    def __post_init__(self):
        errors = []
        if self.qat not in QAT_SCHEMES:
            errors.append(f"qat {self.qat!r} is not one of {', '.join(QAT_SCHEMES)}")
        if self.adapter not in ADAPTER_KINDS:
            errors.append(f"adapter {self.adapter!r} is not one of {', '.join(ADAPTER_KINDS)}")
        if self.base_dtype not in BASE_DTYPES:
            errors.append(f"base_dtype {self.base_dtype!r} is not one of {', '.join(BASE_DTYPES)}")
        elif self.base_dtype != "auto" and self.adapter == "none":
            errors.append(f"adapter.base_dtype={self.base_dtype} stores the frozen base of adapted linears; plan it "
                          "with adapter.kind=lora")
        if self.adapter_rank < 1:
            errors.append(f"adapter.rank={self.adapter_rank}: at least 1")
        if self.engine not in PLAN_ENGINES:
            errors.append(f"engine {self.engine!r} is not one of {', '.join(PLAN_ENGINES)}")
        if self.precision not in PRECISIONS:
            errors.append(f"precision {self.precision!r} is not one of {', '.join(PRECISIONS)}")
        if self.optimizer not in OPTIMIZERS:
            errors.append(f"optimizer {self.optimizer!r} is not one of {', '.join(OPTIMIZERS)}")
        if self.attention not in ATTENTION:
            errors.append(f"attention {self.attention!r} is not one of {', '.join(ATTENTION)}")
        if not self.moe_imbalance >= 1.0:
            errors.append(f"--moe-imbalance is max / mean tokens per expert, at least 1; got {self.moe_imbalance:g}")
        if self.reference not in ("none", "model", "adapters", "precomputed"):
            errors.append(f"reference {self.reference!r} is not one of none, model, adapters, precomputed")
        if self.objective == "rl" and (problem := completion_room_problem(self.seq_len, self.rl_new_tokens)):
            errors.append(problem)
        if self.seq_len < 1 or self.global_batch < 1:
            errors.append("sequence length and global batch must be at least 1")
        if errors:
            raise ConfigError(*errors)

    @property
    def tokens(self) -> int:
        return self.seq_len * self.global_batch

    @property
    def techniques(self) -> Techniques:
        """What scaletrain's trainer runs on top of a layout, for the one legality check: the
        planner ranks only what `train` accepts (another engine's rules are its own)."""
        if self.engine != "scaletrain":
            return Techniques()
        return Techniques(qat=self.qat, fp8=self.fp8, adapter=self.adapter, base_dtype=self.base_dtype,
                          document_mask=self.document_mask, rl_group=self.rl_group if self.objective == "rl" else 0,
                          rl_samples=self.objective == "rl", objective=self.objective,
                          optimizer=self.optimizer)


@dataclass(frozen=True)
class Cluster:
    hardware: Hardware
    nodes: int = 1
    gpus_per_node: int = 8
    # the cluster in `workers` sites (e.g. datacenters) of world / workers GPUs each, joined by a
    # link of `workers_link_GBps` (GB/s each way, shared by every rank that sends over it); the
    # data-parallel workers (dp_replicate groups) are the sites
    workers: int = 1
    workers_link_GBps: float | None = None
    # the machine at hand's measured figures (scaletrain.plan.calibrate.Calibration); with them the
    # time model uses no catalog constant for what was measured
    calibration: Any = field(default=None, compare=False, repr=False)

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def site(self) -> int:
        """GPUs per site."""
        return self.world // self.workers


@dataclass
class ModelSource:
    """A model for the planner: a shape it knows (`cfg`) and/or a module to count and trace."""

    name: str
    cfg: ModelConfig | None = None
    module: Any = None  # an nn.Module (for modules the planner cannot describe as a ModelConfig)
    extra: dict = field(default_factory=dict)


def load_model(source: Any) -> ModelSource:
    """Interpret a preset name, a TOML path, a Hugging Face config.json path (or model folder), a
    ModelConfig or an nn.Module."""
    from torch import nn

    from scaletrain.model.presets import PRESETS

    if isinstance(source, ModelConfig):
        return ModelSource("model", cfg=source)
    if isinstance(source, nn.Module):
        cfg = getattr(source, "cfg", None)
        return ModelSource(type(source).__name__, cfg=cfg if isinstance(cfg, ModelConfig) else None, module=source)
    if not isinstance(source, (str, Path)):
        raise ConfigError(f"cannot plan for a {type(source).__name__}; give a preset name, a TOML or config.json "
                          "path, a ModelConfig or an nn.Module")
    text = str(source)
    if text in PRESETS:
        return ModelSource(text, cfg=from_dict({"model": {"preset": text}, "data": {"seq_len": 1}}).model)
    from scaletrain.plan.published import MODELS

    if text in MODELS:  # the shapes of public runs the planner is checked against
        return ModelSource(text, cfg=_model_only(MODELS[text], text))
    path = Path(text)
    if path.is_dir() and (path / "config.json").is_file():  # a Hugging Face model folder
        path = path / "config.json"
    if path.suffix == ".toml":
        raw = read_config_file(path)
        section = raw.get("model", raw)
        # an optional [plan] table names how the run is trained, beside the model's shape
        run = raw.get("plan", {}) if "model" in raw else {}
        unknown = set(run) - {"engine", "compile", "fp8"}
        if unknown:
            raise ConfigError(f"{path}: [plan] takes engine, compile and fp8; unknown: {', '.join(sorted(unknown))}")
        return ModelSource(path.stem, cfg=_model_only(section, str(path)), extra=dict(run))
    if path.suffix == ".json":
        if not path.is_file():
            raise ConfigError(f"{path} not found; give a Hugging Face config.json")
        try:
            return ModelSource(path.parent.name or path.stem, cfg=hf_config_to_model(json.loads(path.read_text()),
                                                                                   str(path)))
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e.msg})") from None
    raise ConfigError(f"unknown model {text!r}{did_you_mean(text, [*PRESETS, *MODELS])}: not a preset "
                      f"({', '.join(PRESETS)}), a published run's shape ({', '.join(MODELS)}), a .toml or a "
                      "config.json")


def _model_only(section: dict, where: str) -> ModelConfig:
    # the data section's default seq_len must not trip the model's max_seq_len check here
    return from_dict({"model": section, "data": {"seq_len": 1}}, source=where).model


def hf_config_to_model(hf: dict, where: str = "config.json") -> ModelConfig:
    """A Hugging Face decoder config (GPT-2, Llama, Mistral, Qwen2, Qwen3, and others read like
    Llama) as a ModelConfig: the import's own mapping (head_dim, biases, q/k norms), without its
    refusals of what changes the math but not the size."""
    from scaletrain.model.hf_config import model_config_from_hf

    if not isinstance(hf, dict):
        raise ConfigError(f"{where}: expected a JSON object (a Hugging Face config.json), got {type(hf).__name__}")
    return _model_only(model_config_from_hf(hf, strict=False, where=where), where)
