"""The techniques' per-step work, as the Trainer sees it: a list of hooks it calls in order.

A technique that must do something every step (sum gradients over its axis, refresh fp8 scales,
average the workers every H steps, agree on a skipped step, keep state in checkpoints) gives the
Trainer a `StepHook`; `parallelize()` returns those of the techniques it applied, the run adds
those built from it (master weights, local SGD). The Trainer calls `StepHooks` at fixed points of
the step and never asks which technique is behind a hook:

    begin_step -> forward/backward of every micro-batch -> reduce_gradients (the last: fp16's unscale)
    -> clip (the parallel model's global norm) -> agree_to_skip -> optimizer step -> after_optimizer_step
    (-> metrics, on a logged step)

Every method of `StepHook` does nothing by default: a hook overrides what it needs. A member belongs to
the protocol when more than one technique implements it (tests/test_structure.py holds this); the run's
outer loop (local SGD / DiLoCo / replica groups: parallel/outer.py), one strategy of its own, adds the
members only it has (`OuterLoop`).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist

Named = list[tuple[str, torch.Tensor]]


class StepHook:
    """One technique's work in each optimizer step; `phase` names it in a hang's report."""

    phase = "a technique's step work"
    key = ""  # the checkpoint's trainer.json entry of state_dict(); empty: the hook keeps no state

    def begin_step(self, loss_factor: float) -> None:
        """Before the step's first forward. `loss_factor`: d (what backward starts from) / d (the sum
        of this rank's token losses), for a loss a technique adds inside the model."""

    def reduce_gradients(self, named: Named) -> None:
        """After the micro-batches' backward, before the norm: gradients of the optimizer's
        parameters (`named`, masters or shards included) summed where the technique needs it."""

    def agree_to_skip(self, skip: bool) -> bool:
        """Whether every rank skips this step, given this rank's verdict (a collective where ranks
        can disagree: workers with norms of their own)."""
        return skip

    def after_optimizer_step(self, applied: bool) -> bool:
        """After the optimizer step (`applied`: not skipped). True when the weights the optimizer
        steps changed besides (the Trainer then refreshes what the model computes with)."""
        return False

    def refresh_weights(self) -> None:
        """What the model computes with, from what the optimizer steps (after a step or a load)."""

    def metrics(self) -> dict[str, float]:
        """What the technique measured in the last step, for the metrics row."""
        return {}

    def say(self, line: str) -> None:
        """A line for the run's log, when what it tells arises (not a member a technique implements: the run
        directs every hook's lines to its log with StepHooks.say_to; until then they go to stderr)."""
        print(f"scaletrain: {line}", file=sys.stderr, flush=True)

    # ---- checkpoints: what the technique keeps beside the weights and the optimizer state ----

    def checkpoint_tensors(self, tensors: dict) -> dict:
        """The tensors DCP saves and loads (weights under "model", optimizer state under "optim"),
        rearranged or extended by the technique."""
        return tensors

    def state_dict(self) -> dict | None:
        """JSON state saved in the checkpoint's trainer.json under the hook's `key` (None: nothing)."""
        return None

    def prepare_load(self, state: dict | None) -> None:
        """Before the tensors are loaded: allocate what `checkpoint_tensors` will load into."""

    def load_state_dict(self, state: dict | None) -> None:
        """After the tensors are loaded."""


class OuterLoop(StepHook):
    """The run's outer loop: copies of the model kept apart between syncs (local SGD / DiLoCo's
    workers, fault tolerance's replica groups; at most one per run, parallel/outer.py). Besides a
    step hook's work, it alone decides what follows from there being several copies of one run."""

    # (index, count): this rank's data-parallel group is group `index` of `count` that read apart as one
    # job's data-parallel ranks, in processes of their own (fault tolerance's replica groups)
    data_outer: tuple[int, int] = (0, 1)
    # what a wait for other processes before a step (`start`, `begin_step`: a quorum) runs inside: not a
    # member a technique implements; the run gives its stop signals' with StepHooks.interrupt_waits_with
    # (StopSignals.interruptible: a stop raises StopWaiting there, not a step later)
    interruptible: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext

    def start(self) -> None:
        """Once the run is built (and resumed), before its first step: a copy that may take the run's
        state from elsewhere (a live peer) does so here, before the data position is read."""

    def skip_reason(self) -> str | None:
        """Why `agree_to_skip` skipped this step where the gradients did not ask for it (None: it did not)."""
        return None

    def writes_checkpoint(self) -> bool:
        """Whether this copy of the run writes the checkpoints (only one of several writes)."""
        return True

    def reported_norm(self, grad_norm):
        """The gradient norm the metrics show (a worker's own norm becomes the workers' RMS)."""
        return grad_norm


class StepHooks:
    """The hooks of a run, called in order, and its outer loop (`outer`, among the hooks in its place;
    None: every rank syncs every step). `enter(phase)` tells the run's health what is running (a hang
    in a collective is reported with it)."""

    def __init__(self, hooks: Iterable[StepHook | None] = (), enter: Callable[[str], None] = lambda phase: None,
                 outer: OuterLoop | None = None):
        self.hooks = [h for h in hooks if h is not None]
        assert outer is None or outer in self.hooks, "the outer loop is one of the run's hooks"
        self.outer = outer or OuterLoop()  # (no outer loop: one copy of the run, nothing to decide)
        self.enter = enter

    def add(self, *hooks: StepHook | None) -> StepHooks:
        self.hooks.extend(h for h in hooks if h is not None)
        return self

    def find(self, kind: type) -> StepHook | None:
        """The run's hook of one technique (a benchmark or a test looks into it), or None."""
        return next((h for h in self.hooks if isinstance(h, kind)), None)

    def start(self) -> None:
        self.enter(self.outer.phase)
        self.outer.start()

    def begin_step(self, loss_factor: float) -> None:
        for h in self.hooks:
            h.begin_step(loss_factor)

    @property
    def data_outer(self) -> tuple[int, int]:
        return self.outer.data_outer

    def skip_reason(self) -> str | None:
        return self.outer.skip_reason()

    def writes_checkpoint(self) -> bool:
        return self.outer.writes_checkpoint()

    def reduce_gradients(self, named: Named) -> None:
        for h in self.hooks:
            self.enter(h.phase)
            h.reduce_gradients(named)

    def agree_to_skip(self, skip: bool) -> bool:
        for h in self.hooks:
            skip = h.agree_to_skip(skip)
        return skip

    def after_optimizer_step(self, applied: bool) -> bool:
        changed = False
        for h in self.hooks:
            self.enter(h.phase)
            changed |= bool(h.after_optimizer_step(applied))
        return changed

    def refresh_weights(self) -> None:
        for h in self.hooks:
            h.refresh_weights()

    def reported_norm(self, grad_norm):
        return self.outer.reported_norm(grad_norm)

    def metrics(self) -> dict[str, float]:
        return {k: v for h in self.hooks for k, v in h.metrics().items()}

    def say_to(self, say: Callable[[str], None]) -> None:
        """Where the hooks' lines go from now on (the run's log)."""
        for h in self.hooks:
            h.say = say

    def interrupt_waits_with(self, interruptible: Callable[[], contextlib.AbstractContextManager]) -> None:
        """What the outer loop's waits before a step run inside from now on (the run's stop signals)."""
        self.outer.interruptible = interruptible

    def checkpoint_tensors(self, tensors: dict) -> dict:
        for h in self.hooks:
            tensors = h.checkpoint_tensors(tensors)
        return tensors

    def state_dict(self) -> dict:
        return {h.key: s for h in self.hooks if h.key and (s := h.state_dict()) is not None}

    def prepare_load(self, state: dict) -> None:
        for h in self.hooks:
            h.prepare_load(state.get(h.key) if h.key else None)

    def load_state_dict(self, state: dict) -> None:
        for h in self.hooks:
            h.load_state_dict(state.get(h.key) if h.key else None)


def sum_gradients(params: list[torch.Tensor], group) -> None:
    """Sum the gradients of `params` over `group` in one all-reduce: over the cp ranks (same
    weights, different tokens of the same batch), a tied embedding's over its first and last
    pipeline stage, replicated K/V heads' over the tp ranks. A sharded parameter's local shard:
    the ranks of `group` hold the same shards. A DTensor gradient placed otherwise than its
    parameter (a vocabulary-parallel embedding's comes back replicated) is first placed like it."""
    for p in params:
        if p.grad is not None and hasattr(p.grad, "placements") and p.grad.placements != p.placements:
            p.grad = p.grad.redistribute(p.device_mesh, p.placements)
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return
    local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
    flat = torch.cat([g.reshape(-1).float() for g in local])
    dist.all_reduce(flat, group=group)
    offset = 0
    for g in local:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()
