"""The plan command's options, in the config's language.

`scaletrain plan` takes what `scaletrain train` takes — a TOML (`--config FILE`) and
`--section.key=value` options — and, for short, the flags of `ALIASES`, each another name of
one config key. Every value is checked by the config's own validation. The layout keys given
(in the TOML, as `--section.key=value` or through an alias) fix the layout, and what is left
out is derived as the config derives it (`scaletrain.layout.Layout.from_config`: dp_shard the
remaining ranks, the batch triad from the global batch); with none given the planner searches.

From Python, `plan(layout={...})` takes the same config keys, Layout's field names, or the
aliases' short names ("ac", "schedule", "virtual", "offload", "cp", "ep").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from scaletrain.config import (
    JobConfig,
    from_dict,
    option_fields,
    parse_override_args,
    preference_reference,
    read_config_file,
    rl_reference,
)
from scaletrain.errors import ConfigError
from scaletrain.layout import Layout
from scaletrain.options import coerce

# The plan command's short flags: each is an alias of one config key. The only table of them:
# the CLI's flags and their help, and the short names plan(layout={...}) takes, come from it.
ALIASES = {
    "--seq-len": "data.seq_len",
    "--global-batch": "train.global_batch",
    "--precision": "precision.mode",
    "--optimizer": "optim.name",
    "--zero": "parallel.zero",
    "--tp": "parallel.tp",
    "--pp": "parallel.pp",
    "--dp-replicate": "parallel.dp_replicate",
    "--dp-shard": "parallel.dp_shard",
    "--micro-batch": "train.micro_batch",
    "--ac": "memory.activation_checkpointing",
    "--sp": "parallel.sp",
    "--schedule": "parallel.pp_schedule",
    "--virtual": "parallel.pp_virtual_stages",
    "--offload": "memory.offload_optimizer",
    "--cp": "parallel.cp",
    "--cp-method": "parallel.cp_method",
    "--ep": "parallel.ep",
}

# The config keys that describe a layout (a Layout's fields are these keys after derivation;
# parallel.pp_microbatches is train.grad_accum under pipelining)
LAYOUT_KEYS = ("parallel.dp_replicate", "parallel.dp_shard", "parallel.tp", "parallel.sp", "parallel.pp",
               "parallel.pp_schedule", "parallel.pp_virtual_stages", "parallel.pp_split", "parallel.pp_microbatches",
               "parallel.zero", "parallel.cp", "parallel.cp_method", "parallel.ep", "train.micro_batch",
               "train.grad_accum", "memory.activation_checkpointing", "memory.offload_optimizer")

# How the data-parallel workers sync ([parallel.sync]'s keys and the Layout's fields they become): not
# layout keys that fix the layout, but the local SGD / DiLoCo settings the search tries (and a fixed
# layout runs)
SYNC_KEYS = {"parallel.sync.mode": "dp_sync", "parallel.sync.every": "sync_every",
             "parallel.sync.fragments": "sync_fragments", "parallel.sync.delay": "sync_delay",
             "parallel.sync.dtype": "sync_dtype"}

# The workload's fields and their config keys, and what the planner assumes for those not given
# (without --config; a training config gives all of them, its defaults included)
WORKLOAD_KEYS = {"seq_len": "data.seq_len", "global_batch": "train.global_batch", "precision": "precision.mode",
                 "optimizer": "optim.name", "adapter": "adapter.kind", "adapter_rank": "adapter.rank",
                 "adapter_targets": "adapter.targets", "base_dtype": "adapter.base_dtype", "qat": "train.qat",
                 "document_mask": "data.document_mask"}
PLAN_DEFAULTS = {"data.seq_len": 2048, "train.global_batch": 256, "precision.mode": "bf16-mixed",
                 "optim.name": "adamw", "adapter.kind": "none", "adapter.rank": 8, "adapter.targets": "all-linear",
                 "adapter.base_dtype": "auto", "train.qat": "none",
                 "data.document_mask": False}

# plan(layout={...}) names: Layout's field names and the aliases' short names, to config keys
LAYOUT_NAMES = {**{key.partition(".")[2]: key for key in LAYOUT_KEYS},
                **{flag[2:].replace("-", "_"): key for flag, key in ALIASES.items() if key in LAYOUT_KEYS}}
# sizes that plan(layout={...}) takes by name must be at least 1 (the config's names keep the
# config's meanings: dp_shard = -1 all remaining ranks, micro_batch = 0 derive)
SIZES = ("tp", "pp", "cp", "ep", "dp_replicate", "dp_shard", "micro_batch", "grad_accum", "pp_virtual_stages")


def alias_of(key: str) -> str | None:
    return next((flag for flag, k in ALIASES.items() if k == key), None)


# the Layout field a layout key becomes (the others keep their names)
FIELD_OF = {"parallel.pp_microbatches": "grad_accum"}
# values of the config's that derive rather than fix (dp_shard: the remaining ranks; 0: from the triad)
DERIVES = {"parallel.dp_shard": -1, "train.micro_batch": 0, "train.grad_accum": 0, "parallel.pp_microbatches": 0}


def config_key(field: str) -> str:
    """The config key of a Layout field."""
    return next((k for k, f in {**FIELD_OF, **SYNC_KEYS}.items() if f == field), None) or \
        next((k for k in LAYOUT_KEYS if k.partition(".")[2] == field), field)


def fixed_fields(given: Mapping[str, Any]) -> set[str]:
    """The Layout fields that the layout options `given` (any of derive_layout's names) fix; a
    value that asks for derivation (dp_shard -1, a batch size 0) fixes nothing."""
    out = set()
    for name, value in given.items():
        key = name if name in LAYOUT_KEYS else LAYOUT_NAMES.get(name)
        if key is None or (key in DERIVES and value == DERIVES[key]):
            continue
        out.add(FIELD_OF.get(key, key.partition(".")[2] or key))
    return out


# --------------------------------------------------------------------------------------------
# One layout from the keys given


def derive_layout(given: Mapping[str, Any], world: int, global_batch: int) -> Layout:
    """The layout that `given` (config keys, Layout's field names or the aliases' short names)
    fixes on `world` ranks for `global_batch` sequences per step (0: derived from the
    batch triad, as the config does); what is left out is derived by
    `Layout.from_config`. Sequence parallelism is on under tensor parallelism unless given."""
    keys: dict[str, Any] = {}
    unknown, too_small, twice = [], [], []
    for name, value in given.items():
        key = name if name in LAYOUT_KEYS else LAYOUT_NAMES.get(name)
        if key is None:
            unknown.append(name)
            continue
        field = key.partition(".")[2]
        if name != key and field in SIZES and value < 1:
            too_small.append(f"{field}={value}")
        if key in keys:
            twice.append(key)
        keys[key] = value
    if unknown:
        known = sorted(LAYOUT_NAMES)
        raise ConfigError(f"unknown layout option(s) {', '.join(sorted(unknown))}; known: {', '.join(known)} "
                          "(or their config keys)")
    if twice:
        raise ConfigError(f"{', '.join(twice)} given twice (by two of its names); give it once")
    if too_small:
        raise ConfigError(f"layout sizes must be at least 1, got {', '.join(too_small)}")
    if world < 1:
        raise ConfigError("--nodes and --gpus-per-node must be at least 1")
    sections: dict[str, dict] = {"data": {"seq_len": 1}, "train": {"global_batch": global_batch}}
    for key, value in keys.items():
        section, _, name = key.partition(".")
        sections.setdefault(section, {})[name] = value
    cfg = from_dict(sections, source="layout")  # the config's checks of every value
    par = cfg.parallel
    if "parallel.sp" not in keys and par.tp > 1:  # the planner's default: sequence parallel with tp
        cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(par, sp=True))
    # where the cluster does not take the layout, its words before Layout.from_config's (which
    # speak of processes to launch)
    if world % Layout.fixed_ranks(par) or (par.dp_shard > 0 and Layout.config_world(par) != world):
        raise ConfigError(_misfit(par, world))
    return Layout.from_config(cfg, world)


def _misfit(par, world: int) -> str:
    """Why the cluster's `world` GPUs do not take the sizes of `par` (a ParallelConfig)."""
    besides = par.tp * par.pp * par.cp
    sizes_text = f"tp {par.tp} × pp {par.pp}" + (f" × cp {par.cp}" if par.cp > 1 else "")
    if world % besides:
        return f"{sizes_text} does not divide the cluster's {world} GPUs"
    dp = world // besides
    if dp % par.dp_replicate:
        return f"dp_replicate {par.dp_replicate} does not divide the {dp} data-parallel ranks"
    return (f"dp_replicate {par.dp_replicate} × dp_shard {par.dp_shard} ≠ the {dp} data-parallel ranks the "
            f"cluster's {world} GPUs leave beside {sizes_text}; leave dp_shard out (or -1) for the remaining ranks")


# --------------------------------------------------------------------------------------------
# The plan command's request


@dataclass
class Request:
    """What `scaletrain plan`'s options ask: plan(model, layout=layout, **workload)."""

    model: Any  # the MODEL argument, or the config's ModelConfig
    cfg: JobConfig  # the config the options make (the planned model's section aside, with MODEL)
    workload: dict  # seq_len, global_batch, precision, optimizer
    layout: dict | None  # the layout keys given, or None: search
    overrides: dict  # the command line's config options ({"section.key": value}), aliases included
    sync: dict = dataclasses.field(default_factory=dict)  # Layout's dp_sync settings (SYNC_KEYS)


def read_request(model: Any, config: str | None, aliases: Mapping[str, Any], extra: list[str], *,
                 world: int) -> Request:
    """Read the plan command's options: MODEL (or None), --config FILE, the aliases given
    ({"--zero": 2}; None = not given) and the `--section.key=value` options, for a cluster of
    `world` GPUs."""
    dotted, errors = parse_override_args(extra)
    if errors:
        raise ConfigError(*errors)
    by_alias = {ALIASES[flag]: value for flag, value in aliases.items() if value is not None}
    for key, value in by_alias.items():  # an alias and its key: one value
        if key in dotted:
            try:
                same = _coerce(key, value) == _coerce(key, dotted[key])
            except ValueError as e:
                errors.append(f"{key}: {e}")
                continue
            if not same:
                errors.append(f"{alias_of(key)} {value} and {key}={dotted[key]} set the same option ({alias_of(key)} "
                              f"is {key}) to different values; give one of them")
    if errors:
        raise ConfigError(*errors)
    raw = read_config_file(config) if config else {}
    given = {f"{s}.{k}" for s, body in raw.items() if isinstance(body, Mapping) for k in body}
    given |= set(dotted) | set(by_alias)
    overrides = {**dotted, **by_alias}
    if model is None and not config and not any(k.startswith("model.") for k in given):
        raise ConfigError("plan needs a model: a preset name, a TOML or a config.json path (or --config FILE)")
    cfg = _validated(raw, overrides, config, model_given=model is not None)
    if model is None:
        model = cfg.model

    workload = {}
    derive_batch = not config and "train.global_batch" not in given and \
        bool({"train.grad_accum", "parallel.pp_microbatches"} & given)  # the triad gives the batch
    for name, key in WORKLOAD_KEYS.items():
        given_here = config or key in given or (key == "train.global_batch" and derive_batch)
        workload[name] = _value(cfg, key) if given_here else PLAN_DEFAULTS[key]
    layout = {key: _value(cfg, key) for key in LAYOUT_KEYS if key in given}
    if not workload["global_batch"]:  # 0: micro_batch × grad_accum × dp, as the config derives it here
        workload["global_batch"] = derive_layout(layout, world, 0).global_batch
    if cfg.train.objective == "preference":  # a pair is two sequences, chosen and rejected, in one micro-batch
        workload["global_batch"] *= 2
        if layout.get("train.micro_batch"):
            layout["train.micro_batch"] *= 2
        workload["reference"], workload["objective"] = preference_reference(cfg), "preference"
    if cfg.train.objective == "rl":  # the rollouts' cache and generation (scaletrain.plan.rl)
        workload.update(objective="rl", reference=rl_reference(cfg), rl_group=cfg.rl.group_size,
                        rl_new_tokens=cfg.rl.max_new_tokens, rl_updates=cfg.rl.updates,
                        rl_old_pass=cfg.rl.updates > 1 or cfg.rl.is_correction != "none")
    sync = {field: _value(cfg, key) for key, field in SYNC_KEYS.items()}
    return Request(model, cfg, workload, layout or None, overrides, sync)


def _validated(raw: dict, overrides: dict, config: str | None, *, model_given: bool) -> JobConfig:
    """The config of the options, checked by the config's validation. With MODEL given, the
    config's [model] is not what is planned: it is left out, and the planned sequence length is
    checked on its own (the planner stretches the model's max_seq_len to it)."""
    source = config or "options"
    if not model_given:
        return from_dict(raw, overrides, source=source)
    if any(k.startswith("model.") for k in overrides):
        first = next(k for k in overrides if k.startswith("model."))
        raise ConfigError(f"--{first}: the model planned is the MODEL argument; give its shape in a TOML [model] "
                          "section (plan FILE.toml) or plan --config FILE without MODEL")
    raw = {s: dict(body) if isinstance(body, Mapping) else body for s, body in raw.items() if s != "model"}
    overrides = dict(overrides)
    data = raw.get("data")
    seq_len = data.pop("seq_len", None) if isinstance(data, dict) else None
    seq_len = overrides.pop("data.seq_len", seq_len)  # the command line wins
    errors = []
    try:
        cfg = from_dict(raw, overrides, source=source, own_model=False)
    except ConfigError as e:
        errors += e.lines
    if seq_len is not None:
        try:
            seq_len = _coerce("data.seq_len", seq_len)
        except ValueError as e:
            errors.append(f"data.seq_len: {e}")
    if errors:
        raise ConfigError(*errors)
    if seq_len is not None:
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, seq_len=seq_len))
    return cfg


def _coerce(key: str, value: Any) -> Any:
    """`value` for config key `key` as the config reads it (text as from the command line)."""
    return coerce(option_fields()[key], value, isinstance(value, str))


def _value(cfg: JobConfig, key: str) -> Any:
    for name in key.split("."):  # "parallel.sync.every": cfg.parallel.sync.every
        cfg = getattr(cfg, name)
    return cfg
