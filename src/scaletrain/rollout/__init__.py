"""Rollouts for reinforcement learning (issue 50): the engine interface (engine.py), our colocated engine
on the live training module (local.py) and its sampler (sampling.py).

Floor: beside model/ (plain parts): it imports model/ and torch.distributed, never the config, the
techniques or the trainer; the trainer hands it the module, the group and the tokenizer."""

from scaletrain.rollout.engine import RolloutEngine, Rollouts, SamplingParams

__all__ = ["RolloutEngine", "Rollouts", "SamplingParams"]
