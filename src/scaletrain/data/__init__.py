"""Token data: `prepare` writes it (scaletrain.data.prepare), `open_data` reads it, the loader
cuts it into windows by (seed, step). The readers (torch) are imported on first use: a
`prepare` worker process needs no torch."""

from scaletrain.data.prepare import prepare  # noqa: F401 - re-exported (light: numpy); binds the name over the submodule's

_NAMES = {"TokenData": "dataset", "WindowDataset": "dataset", "builtin_data": "dataset", "open_data": "dataset",
          "StepSampler": "loader", "build_loader": "loader"}


def __getattr__(name):
    if name not in _NAMES:
        raise AttributeError(name)
    import importlib

    return getattr(importlib.import_module(f"scaletrain.data.{_NAMES[name]}"), name)


__all__ = sorted([*_NAMES, "prepare"])
