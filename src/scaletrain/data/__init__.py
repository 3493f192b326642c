"""Token data: `prepare` writes it (scaletrain.data.prepare), `open_data` reads it, the loader
cuts it into windows by (seed, step). Names are imported on first use: a `prepare` worker
process needs no torch."""

_NAMES = {"TokenData": "dataset", "WindowDataset": "dataset", "builtin_data": "dataset", "open_data": "dataset",
          "StepSampler": "loader", "build_loader": "loader", "prepare": "prepare"}


def __getattr__(name):
    if name not in _NAMES:
        raise AttributeError(name)
    import importlib

    return getattr(importlib.import_module(f"scaletrain.data.{_NAMES[name]}"), name)


__all__ = sorted(_NAMES)
