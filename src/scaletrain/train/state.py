"""A run's training state besides its tensors: where it stands and where it came from.

Saved in every checkpoint's trainer.json (`state_dict`) and restored on resume
(`load_state_dict`): the step, the run's id and lineage (the branches it continued on), the
steps skipped for non-finite gradients and the early loss the divergence check measures
against. `resumed_from` is this process's own: the checkpoint it started from, if any.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class TrainState:
    step: int = 0  # optimizer steps done
    run_id: str = ""  # the run's identity, kept across resumes
    lineage: list = field(default_factory=list)  # [(run_id, first step), ...]: the branches resumed on
    skipped_steps: int = 0  # steps whose gradients were not finite (weights untouched)
    early_loss: float | None = None  # the mean loss of the first 5 steps: the divergence yardstick
    resumed_from: Path | None = None  # the checkpoint this process resumed, if any

    def state_dict(self) -> dict:
        return {"step": self.step, "run_id": self.run_id, "lineage": self.lineage,
                "skipped_steps": self.skipped_steps, "early_loss": self.early_loss}

    def load_state_dict(self, state: dict, path: Path) -> None:
        """Continue from a checkpoint's trainer.json (saved at `path`), under its run id."""
        self.step = int(state["step"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self.early_loss = state.get("early_loss")
        self.run_id = state.get("run_id") or self.run_id
        self.resumed_from = path
