"""scaletrain: train models that are too big or too slow for one GPU.

Python API (the same names as the TOML config and the `--section.key=value` options):

    from scaletrain import load_config, Trainer
    cfg = load_config("configs/tiny.toml", {"train.steps": 100})
    result = Trainer(cfg).fit()
"""

__version__ = "0.1.0"

# imported when first asked for: `python -m scaletrain` installs its signal handlers (see
# scaletrain.interrupt) after this package is imported and before anything slow
_LAZY = {"JobConfig": "config", "load_config": "config", "Trainer": "train.trainer", "CheckpointError": "errors",
         "ConfigError": "errors", "DataError": "errors", "LaunchError": "errors", "UserError": "errors"}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"scaletrain.{_LAZY[name]}"), name)
    raise AttributeError(name)


__all__ = ["CheckpointError", "ConfigError", "DataError", "JobConfig", "LaunchError", "Trainer",
           "UserError", "load_config"]
