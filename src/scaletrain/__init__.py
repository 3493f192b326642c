"""scaletrain: train models that are too big or too slow for one GPU.

Python API (the same names as the TOML config and the `--section.key=value` options):

    from scaletrain import load_config, Trainer
    cfg = load_config("configs/tiny.toml", {"train.steps": 100})
    result = Trainer(cfg).fit()
"""

from scaletrain.config import JobConfig, load_config
from scaletrain.errors import CheckpointError, ConfigError, DataError, LaunchError, UserError

__version__ = "0.1.0"


def __getattr__(name):  # the trainer pulls in torch; import it only when asked for
    if name == "Trainer":
        from scaletrain.train.trainer import Trainer

        return Trainer
    raise AttributeError(name)


__all__ = ["CheckpointError", "ConfigError", "DataError", "JobConfig", "LaunchError", "Trainer",
           "UserError", "load_config"]
