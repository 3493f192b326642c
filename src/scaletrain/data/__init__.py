from scaletrain.data.dataset import TokenData, WindowDataset, builtin_data, open_data
from scaletrain.data.loader import StepSampler, build_loader
from scaletrain.data.prepare import prepare

__all__ = ["StepSampler", "TokenData", "WindowDataset", "build_loader", "builtin_data", "open_data", "prepare"]
