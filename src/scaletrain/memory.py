"""Activation checkpointing: trade compute for activation memory.

Backward needs tensors saved during forward. Per block of a transformer these are about
34 * B * T * dim + 5 * B * heads * T^2 bytes in 16-bit (Korthikanti et al. 2022).

* `none`: keep everything. Fastest, most memory.
* `full`: keep only each block's input; recompute the whole block in backward.
  Saves almost all block activations; costs one extra forward (~33% more compute).
* `selective`: keep the outputs of matmuls and attention, recompute the cheap element-wise
  ops (norms, activations, residual adds, rotary) from them. Saves the element-wise share of
  memory for a few percent of extra time.

Checkpointing wraps each block with PyTorch's `checkpoint_wrapper` (non-reentrant
`torch.utils.checkpoint`), so it composes with compile and FSDP.
"""

from __future__ import annotations

import contextlib
import functools
import gc
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from scaletrain.vocab import AC_MODES, unknown

_aten = torch.ops.aten
# Ops whose outputs selective checkpointing keeps: the expensive ones to recompute.
_SAVE_OPS = {
    _aten.mm.default,
    _aten.addmm.default,
    _aten.bmm.default,
    _aten.baddbmm.default,
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_cudnn_attention.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
    _aten._grouped_mm.default,  # a mixture of experts' expert matmuls
}


def _selective_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context():
    return create_selective_checkpoint_contexts(_selective_policy)


def block_items(blocks: nn.ModuleDict | nn.ModuleList) -> list[tuple]:
    """(key, block) pairs of a ModuleDict (ours, keyed by global index) or a ModuleList (most
    other models'): the key puts a wrapped block back in its place, under the same name."""
    return list(blocks.items()) if isinstance(blocks, nn.ModuleDict) else list(enumerate(blocks))


def apply_activation_checkpointing(blocks: nn.ModuleDict | nn.ModuleList, mode: str) -> None:
    """Wrap every block of `blocks` in place for `mode` (none | full | selective)."""
    if mode == "none":
        return
    if mode == "full":
        wrap = functools.partial(checkpoint_wrapper, preserve_rng_state=True)
    elif mode == "selective":
        wrap = functools.partial(checkpoint_wrapper, preserve_rng_state=True, context_fn=_selective_context)
    else:
        raise unknown("activation checkpointing mode", mode, AC_MODES)
    for key, block in block_items(blocks):
        blocks[key] = wrap(block)


def holding_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """The tensors whose storages hold `t`'s bytes: `t` itself, or the inner tensors of a wrapper
    subclass, whose own storage reports its size but holds nothing (a DTensor's local shard, the
    AsyncCollectiveTensor an all-to-all returns)."""
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        inner = [getattr(t, name) for name in names]
        return [held for x in inner if isinstance(x, torch.Tensor) for held in holding_tensors(x)]
    return [t]


class _StorageTracker(TorchDispatchMode):
    """Remembers (weakly) every storage created by an op while active."""

    def __init__(self):
        super().__init__()
        self.storages: dict[int, tuple[StorageWeakRef, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            for t in holding_tensors(leaf) if isinstance(leaf, torch.Tensor) else ():
                if t.device.type != "meta":
                    st = t.untyped_storage()
                    ref = StorageWeakRef(st)
                    self.storages[ref.cdata] = (ref, st.nbytes())
        return out

    def live_bytes(self, exclude: set[int]) -> int:
        # a storage can outlive its bytes: FSDP frees gathered parameters by resizing them to 0
        return sum(torch.UntypedStorage._new_with_weak_ptr(ref.cdata).nbytes()
                   for key, (ref, _) in self.storages.items() if not ref.expired() and key not in exclude)


def saved_activation_bytes(model: nn.Module, forward: Callable[[], torch.Tensor], backward: bool = True) -> int:
    """Bytes that autograd keeps alive for backward after `forward()` returns its loss.

    Measured, not estimated: every storage produced during the forward pass is tracked weakly,
    and those still alive once forward has returned (held by the graph, the checkpoint caches,
    or the returned loss) are counted. Parameters and buffers are left out.
    """
    exclude = {StorageWeakRef(h.untyped_storage()).cdata
               for t in [*model.parameters(), *model.buffers()] for h in holding_tensors(t)}
    gc.collect()
    tracker = _StorageTracker()
    with tracker:
        loss = forward()
    gc.collect()
    # parameters may have been swapped for gathered copies during forward (FSDP): leave them out too
    exclude |= {StorageWeakRef(h.untyped_storage()).cdata
                for t in [*model.parameters(), *model.buffers()] for h in holding_tensors(t)}
    held = tracker.live_bytes(exclude)
    if backward:
        loss.backward()  # frees the graph; also proves that what was kept suffices
    return held


def peak_allocated_bytes(fn: Callable[[], object], device: torch.device) -> int:
    """The most memory `fn()` held at once above what was allocated when it started.

    On CUDA: the caching allocator's peak. On CPU, where no allocator keeps statistics: the
    profiler's record of every allocation and free ("Total Allocated" of its memory events)."""
    return allocated_bytes(fn, device)[0]


def allocated_bytes(fn: Callable[[], object], device: torch.device) -> tuple[int, int]:
    """(peak, retained): the most memory `fn()` held at once above what was allocated when it
    started, and what it still holds when it returns (as `peak_allocated_bytes` measures)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base, torch.cuda.memory_allocated(device) - base
    import json
    import os
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    with _quiet_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    finally:
        os.unlink(path)
    memory = [e["args"] for e in sorted(events, key=lambda e: e.get("ts", 0))
              if e.get("name") == "[memory]" and e.get("args", {}).get("Device Type", 0) == 0]
    if not memory:
        return 0, 0
    # "Total Allocated" runs on from the process's earlier profiling sessions: count from this one's start
    start = memory[0]["Total Allocated"] - memory[0]["Bytes"]
    totals = [m["Total Allocated"] - start for m in memory]
    return max([0, *totals]), totals[-1]


@contextlib.contextmanager
def _quiet_stderr():
    """The profiler's C++ side prints start/stop notes straight to file descriptor 2."""
    import os
    import sys

    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
