"""The preference objective (train.objective=preference): DPO and its family trained on any layout.

What changes from language modelling is the loss and what it needs, never the layout's machinery:

* Data: `PreferenceWindows` gives a micro-batch of examples as fixed-width rows, a pair's chosen and
  rejected on adjacent rows; the sampler draws examples, so a pair is never split across micro-batches,
  ranks or pipeline micro-batches. `tap` takes the example ids off each micro-batch (the trainer and the
  pipeline schedule see (inputs, targets) as always) and queues them, with the reference log-probs, for
  the loss, which the trainer and every pipeline schedule call in the micro-batches' order.
* Loss: each row's summed log-probability of its completion tokens (`row_logps`; under tensor
  parallelism on the logits' vocabulary shards, under context parallelism summed over the cp ranks'
  chunks with a sum whose backward is the identity, so that each rank's tokens get d loss / d sum once),
  then scaletrain.model.preference's loss of the pairs. A micro-batch's loss is its pairs' sum divided by
  the pairs of the whole global batch (ORPO's NLL: by the chosen completion tokens of the global batch),
  so that micro-batches and data-parallel ranks add up to the mean over the global batch, whatever the
  accumulation and dp.
* Reference log-probs (`Reference`), one of three ways, one result: `model`, a frozen copy of the starting
  weights parallelized exactly like the policy (forward only); `adapters`, the policy with its adapters
  switched off; `precomputed`, one pass of the starting policy over the data before the first step, kept in
  the run folder (resuming reads it back). Each is a forward-only pass in eval mode over the step's
  micro-batches, through the pipeline schedule's forward-only pass under pipeline parallelism.
* Metrics: rewards of chosen and rejected, margins and accuracy (the fraction of pairs whose chosen earns
  the higher reward) and the log-probs, over the steps of a logged row and on the held-out split.
"""

from __future__ import annotations

import collections
import io
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from scaletrain.atomic import replacing
from scaletrain.config import preference_reference, rl_reference
from scaletrain.data.dataset import IGNORE_INDEX
from scaletrain.data.loader import rank_slices, validation_batches
from scaletrain.data.preference_dataset import PreferenceData, PreferenceWindows
from scaletrain.errors import ConfigError, DataError
from scaletrain.model.lora import adapters_off
from scaletrain.model.preference import Mean, PreferenceLoss, combined, kto_loss, mean_of, preference_loss
from scaletrain.objectives.passes import captured
from scaletrain.parallel import pipeline
from scaletrain.parallel.parallelize import initial_weights
from scaletrain.parallel.tensor_parallel import whole

REFERENCE_FILE = "reference_logps.pt"  # precomputed: the starting policy's log-probs of every example


def reference_mode(cfg) -> str:
    """Where the run's reference log-probs come from ("none" for the reference-free losses, and RL without a KL)."""
    return rl_reference(cfg) if cfg.train.objective == "rl" else preference_reference(cfg)


def reference_weights(cfg):
    """The frozen reference copy's weights: preference.reference_from's (its shapes and tokenizer checked against
    the run's), or those training starts from (model.init_from's; None: the seed's)."""
    section = "rl" if cfg.train.objective == "rl" else "preference"
    source = getattr(cfg, section).reference_from
    if not source:
        return initial_weights(cfg, resuming=False)
    from scaletrain.data.tokenizer import check_same_tokenizer
    from scaletrain.model.hf import load_hf_weights

    check_same_tokenizer(source, cfg.data.path, what=f"{section}.reference_from",
                         otherwise="give a reference trained with the data's tokenizer")
    return load_hf_weights(source, cfg.model)


def open_preference_data(data_cfg, vocab_size: int | None, split: str = "train",
                         loss: str | None = None) -> PreferenceWindows | None:
    """The examples of data.path (a folder written by `prepare --preference`) as fixed-width rows; `loss`: the
    preference loss they are for (KTO reads unpaired examples, the others pairs)."""
    if not data_cfg.path:
        raise ConfigError("train.objective=preference trains on a folder written by `scaletrain prepare --preference "
                          "FILE.jsonl --out FOLDER`; set data.path to it")
    try:
        data = PreferenceData.open(data_cfg.path, split, data_cfg.verify_checksums)
    except DataError as e:
        if split != "train" and "no index for the" in str(e):
            return None
        raise
    if vocab_size is not None and data.tokenizer.vocab_size > vocab_size:
        raise DataError(f"{data.tokens.source}: the tokenizer has {data.tokenizer.vocab_size} tokens but "
                        f"model.vocab_size={vocab_size}; set model.vocab_size to at least {data.tokenizer.vocab_size}")
    if loss is not None and (loss == "kto") != (data.kind == "unpaired"):
        raise ConfigError(f"preference.loss={loss} trains on {'unpaired examples' if loss == 'kto' else 'pairs'}, and "
                          f"{data.tokens.source} holds {data.kind} ({'pairs' if data.kind == 'pairs' else 'examples'} "
                          f"written by prepare --preference {data.kind}); "
                          + ("set preference.loss=kto, or prepare pairs" if data.kind == "unpaired" else
                             "use a paired loss (sigmoid, ...), or prepare unpaired rows (prompt, completion, label)"))
    windows = PreferenceWindows(data, data_cfg.seq_len)
    if windows.longest > data_cfg.seq_len:
        raise DataError(f"{data.tokens.source}: its longest example is {windows.longest + 1} tokens, more than "
                        f"data.seq_len + 1 = {data_cfg.seq_len + 1}; raise data.seq_len to at least {windows.longest}, "
                        "or prepare the data again with --max-length")
    return windows


class _SumOver(torch.autograd.Function):
    """Forward: the sum over a group's ranks; backward: the identity (each rank's share of the sum
    gets d loss / d sum once, and the ranks' parameter gradients are summed by their step hook)."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def row_logps(logits: torch.Tensor, targets: torch.Tensor, cp_group=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: the summed log-probability (fp32) of its completion tokens (targets not IGNORE_INDEX), and
    their count. `logits` may be split by vocabulary (tensor parallel: computed under loss_parallel);
    `cp_group`: this rank holds chunks of each row, summed over the group."""
    mask = targets != IGNORE_INDEX
    nll = F.cross_entropy(logits.flatten(0, 1).float(), targets.masked_fill(~mask, 0).flatten(), reduction="none")
    nll = whole(nll).view(targets.shape)
    sums = -(nll * mask).sum(-1)
    counts = mask.sum(-1).to(sums.dtype)
    if cp_group is not None:
        sums = _SumOver.apply(sums, cp_group)
        counts = counts.clone()
        dist.all_reduce(counts, group=cp_group)
    return sums, counts


def examples_loss(cfg, sums: torch.Tensor, counts: torch.Tensor, ref: dict | None) -> PreferenceLoss:
    """The [preference] loss (`cfg`) of a micro-batch's rows: their completion log-probs `sums` and token
    `counts`, each example's two rows adjacent (a pair's chosen and rejected; KTO: an example's own row and its
    KL row), and the reference's {"chosen", "rejected"} (KTO adds "labels" and the batch's "kl")."""
    if cfg.loss == "kto":  # an example's own row, then its KL row
        own = sums[0::2]
        part = kto_loss(own, ref["chosen"], ref["labels"], ref["kl"], beta=cfg.beta,
                        desirable_weight=cfg.desirable_weight, undesirable_weight=cfg.undesirable_weight)
        part.metrics["kl"] = Mean(ref["kl"].double() * own.numel(), torch.tensor(float(own.numel())))
        return part
    chosen, rejected = sums[0::2], sums[1::2]
    policy = {"chosen": chosen, "rejected": rejected, "chosen_tokens": counts[0::2],
              "rejected_tokens": counts[1::2], "nll": -chosen.sum(), "nll_tokens": counts[0::2].sum()}
    part = preference_loss(cfg, policy, ref)
    part.metrics["logps/chosen"] = mean_of(chosen.detach())
    part.metrics["logps/rejected"] = mean_of(rejected.detach())
    if part.nll is not None:
        part.metrics["nll"] = Mean(part.nll.total.detach(), part.nll.count)
    return part


class PreferenceObjective:
    """The loss of train.objective=preference, its reference log-probs and its metrics, for Trainer `t`
    (which calls `tap` on its batches, `micro_loss` as the loss of a micro-batch, `metrics` per row,
    `evaluate` on the held-out split)."""

    def __init__(self, t, reference_pm=None):
        self.t, self.cfg = t, t.cfg.preference
        self.mode = reference_mode(t.cfg)
        self.ref_pm = reference_pm  # mode "model": the frozen copy, parallelized like the policy
        self.cp_group = t.rt.axis("cp").get_group() if t.layout.cp > 1 else None
        self.queue: collections.deque = collections.deque()  # per micro-batch: (ids, reference or None)
        self.capture: list | None = None  # a forward-only pass's row log-probs (the loss then returns 0)
        self.window: PreferenceLoss | None = None  # the metrics since the last logged row
        self.table: torch.Tensor | None = None  # mode "precomputed": (examples, rows) starting log-probs
        self.ref_seconds = 0.0  # the reference passes' time since it was last taken (not the data's wait)
        self.last_val: dict[str, float] = {}  # the latest held-out metrics (the summary's accuracy)
        self.val = open_preference_data(t.cfg.data, None, "val") if t.cfg.train.eval_every else None
        if t.cfg.train.eval_every and self.val is None:
            raise ConfigError(f"train.eval_every={t.cfg.train.eval_every} needs a validation split, and data.path "
                              f"{t.cfg.data.path} has none; prepare it again with --val-fraction (e.g. 0.05), or set "
                              "train.eval_every=0")
        # the held-out batches, fixed for the run (checked here: a split too small is said before training)
        self.val_batches = None if self.val is None else validation_batches(
            len(self.val), t.layout.global_batch, t.cfg.train.eval_batches, t.cfg.train.seed,
            f"{self.val.data.tokens.source} (validation split)")
        if self.ref_pm is not None and self.ref_pm.stages:
            self.ref_pm.schedule(t.layout.pp_schedule, t.layout.grad_accum, self.micro_loss)

    def describe(self) -> str:
        """What the run trains on, for the log's data line."""
        data, cfg = self.t.data, self.t.cfg
        return (f"{data.corpus.num_tokens:,} tokens, {len(data.dataset):,} "
                f"{'pairs' if data.dataset.kind == 'pairs' else 'unpaired examples'}, two rows of {cfg.data.seq_len} "
                f"each; preference.loss={cfg.preference.loss}, reference {self.mode}")

    def summary(self) -> dict[str, str]:
        """The end-of-run summary's lines: the held-out accuracy, where the run evaluated."""
        if "val_rewards/accuracies" not in self.last_val:
            return {}
        return {"held-out preference accuracy": f"{self.last_val['val_rewards/accuracies']:.1%}"}

    # ---- the step -----------------------------------------------------------------------------

    def copies(self) -> int:
        """Ranks of a data-parallel rank and the last stage that hold the same loss: tp's (vocabulary shards
        reduced) and cp's (each row's sum over the chunks)."""
        return self.t.layout.tp * self.t.layout.cp

    def batches(self, loader):
        """The step's micro-batches: the loader's (`loader()` opens it), their reference log-probs queued."""
        return self.tap(loader())

    def tap(self, batches):
        """(inputs, targets) micro-batches from the loader's (inputs, targets, ids): each step's micro-batches
        are drawn together, their reference log-probs computed, then handed on one by one."""
        t = self.t
        while True:
            parts = [next(batches) for _ in range(t.layout.grad_accum)]
            t0 = time.perf_counter()
            refs = self._with_kl(parts, self.reference(parts), t.data.dataset)
            self.ref_seconds += time.perf_counter() - t0
            for (inputs, targets, _ids), ref in zip(parts, refs):
                self.queue.append(ref)
                yield inputs, targets

    def micro_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """A micro-batch's loss as a share of the global batch's mean (its pairs' sum / the step's pairs)."""
        if pipeline.inferring():  # a stage learning its gradients' shapes: no micro-batch of the step
            return logits.float().sum() * 0
        sums, counts = row_logps(logits, targets, self.cp_group)
        if self.capture is not None:
            self.capture.append((sums.detach(), counts.detach()))
            return sums.sum() * 0
        part = examples_loss(self.cfg, sums, counts, self.queue.popleft())
        self.window = part if self.window is None else self.window + part
        pairs, chosen_tokens = self.t.data.dataset.step_counts(self.t.step, self.t.sampler)
        value = part.loss.total / pairs
        if part.nll is not None:  # ORPO's NLL: a mean over the chosen completion tokens of the global batch
            value = value + part.nll.total / max(1, chosen_tokens)
        return value

    def _with_kl(self, parts, refs: list, dataset, rows: list | None = None) -> list:
        """KTO: each micro-batch's reference with its examples' labels and the KL estimate of the whole global
        batch (`parts`, over every rank): the mean of the policy's log-ratio to the reference on the KL rows
        (an example's prompt with another's completion), at least 0, a constant to the gradient. `rows`: the
        policy's row log-probs, where the caller has them (evaluation); else a forward pass without gradients."""
        if self.cfg.loss != "kto":
            return refs
        rows = rows if rows is not None else self.forward_logps(self.t.pm, parts)
        total = torch.zeros(2, dtype=torch.float64, device=self.t.rt.device)
        for r, ref in zip(rows, refs):
            if r is not None:  # the stages with the head
                total[0] += (r[0][1::2].double() - ref["rejected"].double()).sum()
                total[1] += ref["rejected"].numel()
        if self.t.rt.distributed:  # tp and cp copies add to the sum and the count alike
            dist.all_reduce(total)
        kl = (total[0] / total[1].clamp(min=1)).clamp(min=0).float()
        return [None if ref is None else {**ref, "kl": kl, "labels": dataset.labels(ids).to(kl.device)}
                for (_, _, ids), ref in zip(parts, refs)]

    def metric_names(self) -> list[str]:
        """The names of a row's metrics, known on every rank (the stages without the head compute none)."""
        if self.cfg.loss == "kto":  # rewards of the desirable (chosen) and undesirable (rejected) examples
            return ["loss", "kl", "rewards/chosen", "rewards/rejected"]
        names = ["logps/chosen", "logps/rejected", "rewards/accuracies", "rewards/chosen", "rewards/margins",
                 "rewards/rejected"]
        return ["loss", *names, *(["log_odds_chosen", "log_odds_ratio", "nll"] if self.cfg.loss == "orpo" else [])]

    # ---- reference log-probs --------------------------------------------------------------------

    def reference(self, parts) -> list[dict | None]:
        """The reference log-probs {"chosen", "rejected"} (B,) of each micro-batch of `parts`."""
        if self.mode == "none":
            return [None] * len(parts)
        if self.mode == "precomputed":
            return [self._looked_up(ids) for _, _, ids in parts]
        if self.mode == "model":
            rows = self.forward_logps(self.ref_pm, parts)
        else:  # adapters: the policy with its adapters switched off
            with adapters_off(self.t.pm.dp.modules):
                rows = self.forward_logps(self.t.pm, parts)
        return [None if r is None else {"chosen": r[0][0::2], "rejected": r[0][1::2]} for r in rows]

    def _looked_up(self, ids: torch.Tensor) -> dict | None:
        if self.table is None:
            return None  # a stage without the head computes no loss
        rows = self.table[ids.to(self.table.device)]
        return {"chosen": rows[:, 0].float(), "rejected": rows[:, 1].float()}

    def forward_logps(self, pm, parts) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
        """Row log-probs and counts of each micro-batch of `parts` under `pm`'s model in eval mode, without
        gradients (pipeline: the schedule's forward-only pass; None on the stages without the head)."""
        return captured(self, self.t, pm, parts)

    def before_training(self, folder: Path) -> None:
        """Before the first step. Mode precomputed: the starting policy's log-probs of every training (and
        held-out) example, in one pass, or read back from the run folder (a resumed run's policy has moved)."""
        if self.mode != "precomputed":
            return
        path = folder / REFERENCE_FILE
        dataset = self.t.data.dataset
        if self.t.step > 0 or path.exists():
            if not path.exists():
                raise DataError(f"{path} is missing: preference.reference=precomputed keeps the starting policy's "
                                "log-probs there, and this run resumes past step 0; restore the file, or start a new "
                                "run folder")
            saved = torch.load(path, map_location="cpu", weights_only=True)
            self.table, self.val_table = saved["train"].to(self.t.rt.device), saved.get("validation")
            return
        self.table = self._pass(dataset)
        self.val_table = self._pass(self.val) if self.val is not None else None
        if self.t.rt.rank == 0:
            buf = io.BytesIO()
            torch.save({"train": self.table.cpu(), "validation": None if self.val_table is None else
                        self.val_table.cpu()}, buf)
            with replacing(path, durable=True) as tmp:
                tmp.write_bytes(buf.getvalue())

    def _pass(self, dataset: PreferenceWindows) -> torch.Tensor:
        """(examples, 2) log-probs of the starting policy, every example once, the same on every rank."""
        t, b = self.t, self.t.layout
        n = len(dataset)
        table = torch.zeros(n, 2, dtype=torch.float64, device=t.rt.device)
        seen = torch.zeros(n, dtype=torch.float64, device=t.rt.device)
        for start in range(0, n, b.global_batch):
            chunk = np.arange(start, start + b.global_batch) % n  # the last chunk wraps round: seen twice
            micro = rank_slices(chunk, b.micro_batch, b.grad_accum, t.data.dp_rank, b.dp)
            parts = [self._share(dataset[ids]) for ids in micro]
            for (_, _, ids), rows in zip(parts, self.forward_logps(t.pm, parts)):
                if rows is not None:
                    ids = ids.to(t.rt.device)
                    table.index_put_((ids,), rows[0].double().view(-1, 2), accumulate=True)
                    seen.index_put_((ids,), torch.ones(len(ids), dtype=torch.float64, device=t.rt.device),
                                    accumulate=True)
        if t.rt.distributed:  # over every rank: copies (tp, cp) add to `seen` alike; stages without the head add 0
            dist.all_reduce(table)
            dist.all_reduce(seen)
        return table / seen.clamp(min=1).unsqueeze(1)

    def _share(self, batch):
        share = self.t.pm.batch_share
        return share(batch) if share is not None else batch

    # ---- metrics --------------------------------------------------------------------------------

    def metrics(self) -> dict[str, float]:
        """The rewards, margins, accuracy and log-probs of the steps since the last row (every rank calls
        it: one all-reduce over the world; copies of a row's sums cancel in each mean)."""
        part, self.window = self.window, None
        return self._reduced(part, prefix="")

    def _reduced(self, part: PreferenceLoss | None, prefix: str) -> dict[str, float]:
        names = self.metric_names()
        values = torch.zeros(len(names), 2, dtype=torch.float64, device=self.t.rt.device)
        if part is not None:
            for i, name in enumerate(names):
                m = part.loss if name == "loss" else part.metrics[name]
                values[i, 0], values[i, 1] = m.total.detach().double(), m.count.double()
        if self.t.rt.distributed:
            dist.all_reduce(values)
        out = {f"{prefix}{name}": float(values[i, 0] / values[i, 1].clamp(min=1)) for i, name in enumerate(names)
               if name != "loss"}
        if prefix:  # the held-out loss: the pairs' mean (and ORPO's NLL, a mean over its tokens)
            out[f"{prefix}loss"] = float(values[0, 0] / values[0, 1].clamp(min=1)) + out.get(f"{prefix}nll", 0.0)
        return out

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """The held-out split's loss, rewards, margins and accuracy: fixed batches of examples split over ranks
        and micro-batches like a training step's, the policy and the reference in eval mode."""
        t, b = self.t, self.t.layout
        t.health.enter("evaluation")
        parts_total: list[PreferenceLoss] = []
        for global_batch in self.val_batches:
            micro = rank_slices(global_batch, b.micro_batch, b.grad_accum, t.data.dp_rank, b.dp)
            parts = [self._share(self.val[ids]) for ids in micro]
            policy = self.forward_logps(t.pm, parts)
            refs = self._with_kl(parts, self._val_reference(parts), self.val, policy)
            for rows, ref in zip(policy, refs):
                if rows is not None:
                    parts_total.append(examples_loss(self.cfg, rows[0], rows[1], ref))
        self.last_val = self._reduced(combined(parts_total) if parts_total else None, prefix="val_")
        return self.last_val

    def take_ref_seconds(self) -> float:
        seconds, self.ref_seconds = self.ref_seconds, 0.0
        return seconds

    def _val_reference(self, parts):
        if self.mode != "precomputed":
            return self.reference(parts)
        if self.val_table is None or self.table is None:
            return [None] * len(parts)
        table = self.val_table.to(self.t.rt.device)
        return [{"chosen": table[ids.to(table.device), 0].float(), "rejected": table[ids.to(table.device), 1].float()}
                for _, _, ids in parts]

