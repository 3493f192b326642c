"""Which windows each rank reads at each step, and the loader that reads them.

The order depends only on (seed, step): the windows of an epoch are permuted by a generator
seeded with (seed, epoch), and step s takes the next `global_batch` of them. A step's global
batch is split as [grad_accum][dp_size][micro_batch]: on micro-step k, data-parallel rank r
reads slice (k * dp_size + r). The union over ranks and micro-steps is exactly the global batch
of a single-process run, whatever the layout, and resuming at step s needs nothing but s.

With a batch-size warm-up (train.batch_rampup, scaletrain.schedule.BatchSchedule) step s takes the
batch(s) windows that follow the seen(s) windows read before it, in the same stream of epochs
(each epoch's permutation, cut to a whole number of full batches): still a function of
(seed, step), and without a ramp the same windows as above.

Validation windows are fixed for the run: a permutation seeded by (seed, "validation") picks
`batches` global batches of them once, split over ranks exactly like a training step's.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from scaletrain.data.dataset import WindowDataset
from scaletrain.errors import DataError


class StepSampler(torch.utils.data.Sampler):
    """Yields this rank's micro-batches (lists of window indices), step after step, forever."""

    def __init__(self, num_windows: int, global_batch: int, micro_batch: int, grad_accum: int,
                 dp_rank: int, dp_size: int, seed: int, start_step: int = 0, schedule=None):
        """`schedule`: a scaletrain.schedule.BatchSchedule when the batch grows (train.batch_rampup)."""
        if global_batch != micro_batch * grad_accum * dp_size:
            raise ValueError("global_batch must equal micro_batch * grad_accum * dp_size")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} outside [0, {dp_size})")
        if num_windows < global_batch:
            raise DataError(f"the data has {num_windows} windows, fewer than one global batch of "
                            f"{global_batch}; lower train.global_batch or data.seq_len, or add data")
        self.num_windows = num_windows
        self.global_batch = global_batch
        self.micro_batch = micro_batch
        self.grad_accum = grad_accum
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = seed
        self.start_step = start_step
        self.steps_per_epoch = num_windows // global_batch  # the remainder of an epoch is skipped
        self.schedule = schedule if schedule is not None and schedule.ramps else None
        self._epoch, self._perm = -1, None

    def _epoch_perm(self, epoch: int) -> np.ndarray:
        if epoch != self._epoch:
            self._epoch = epoch
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_windows)
        return self._perm

    def global_batch_indices(self, step: int) -> np.ndarray:
        """The window indices of step `step` over all ranks, in [accum][dp][micro] order."""
        if self.schedule is not None:
            return self._stream(self.schedule.seen(step), self.schedule.batch(step))
        epoch, within = divmod(step, self.steps_per_epoch)
        return self._epoch_perm(epoch)[within * self.global_batch:(within + 1) * self.global_batch]

    def _stream(self, start: int, count: int) -> np.ndarray:
        """Windows start .. start + count of the stream of epochs (each cut to whole full batches)."""
        per_epoch = self.steps_per_epoch * self.global_batch
        out = []
        while count:
            epoch, within = divmod(start, per_epoch)
            take = min(count, per_epoch - within)
            out.append(self._epoch_perm(epoch)[within:within + take])
            start, count = start + take, count - take
        return np.concatenate(out)

    def rank_micro_batches(self, step: int) -> list[list[int]]:
        accum = self.schedule.accum(step) if self.schedule is not None else self.grad_accum
        return rank_slices(self.global_batch_indices(step), self.micro_batch, accum, self.dp_rank, self.dp_size)

    def __iter__(self) -> Iterator[list[int]]:
        step = self.start_step
        while True:
            yield from self.rank_micro_batches(step)
            step += 1

    def __len__(self) -> int:  # infinite; DataLoader only asks for it when printing
        raise TypeError("StepSampler is infinite")


def rank_slices(global_batch: np.ndarray, micro_batch: int, grad_accum: int, dp_rank: int,
                dp_size: int) -> list[list[int]]:
    """This rank's micro-batches of a global batch laid out as [grad_accum][dp_size][micro_batch]."""
    b = micro_batch
    return [global_batch[(k * dp_size + dp_rank) * b:(k * dp_size + dp_rank + 1) * b].tolist()
            for k in range(grad_accum)]


_VALIDATION = int.from_bytes(b"validation", "big") % 2**63  # keeps its stream apart from the epochs'


def validation_batches(num_windows: int, global_batch: int, batches: int, seed: int, what: str) -> np.ndarray:
    """(batches, global_batch) window indices, the same on every rank and layout; `batches` = 0
    takes every whole batch. `what` names the data and the option in the error."""
    available = num_windows // global_batch
    if available < 1:
        raise DataError(f"{what}: {num_windows} windows are fewer than one validation batch of {global_batch}; "
                        "lower train.global_batch or data.seq_len, or hold out more data (--val-fraction)")
    if batches > available:
        raise DataError(f"{what}: {num_windows} windows hold {available} whole validation batch(es) of "
                        f"{global_batch}, fewer than train.eval_batches={batches}; lower it to at most "
                        f"{available} (0 = all)")
    n = batches or available
    order = np.random.default_rng([seed, _VALIDATION]).permutation(num_windows)
    return order[:n * global_batch].reshape(n, global_batch)


class _Shared(torch.utils.data.Dataset):
    """A dataset whose batches are cut to this rank's share by `share` (picklable: the loader's
    worker processes call it)."""

    def __init__(self, dataset, share):
        self.dataset, self.share = dataset, share

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, indices):
        return self.share(self.dataset[indices])


def build_loader(dataset: WindowDataset, sampler: StepSampler, *, num_workers: int, pin_memory: bool,
                 prefetch_factor: int, share=None) -> torch.utils.data.DataLoader:
    """A DataLoader over whole micro-batches (the dataset gathers a batch at once). `share`: a
    function that cuts this rank's part of each batch's (inputs, targets) (context parallelism's
    chunks of every sequence), as the sampler cuts each data-parallel rank's windows."""
    kwargs = {}
    if num_workers > 0:
        kwargs = {"prefetch_factor": prefetch_factor, "persistent_workers": True}
    # its own generator: starting an iteration draws the workers' base seed from it, not from the
    # global one, so dropout's random numbers after a resume continue those of the saved run
    return torch.utils.data.DataLoader(
        _Shared(dataset, share) if share is not None else dataset, sampler=sampler, batch_size=None,
        num_workers=num_workers, pin_memory=pin_memory, generator=torch.Generator(), **kwargs)
