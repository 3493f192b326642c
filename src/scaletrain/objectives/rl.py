"""The RL objective (train.objective=rl): GRPO, Dr. GRPO and DAPO on completions the run samples itself.

A round of rollouts feeds rl.updates optimizer steps (μ):

    draw      this data-parallel rank's share of the step's prompts (global_batch / G of them), from
              (seed, round, attempt) alone (objectives.rl_data.PromptSet.draw)
    sample    G completions of each with the rollout engine on the live, sharded policy (scaletrain.rollout;
              or read back from rl.rollouts), scored by the reward functions (objectives.rewards), the
              advantages normalised within each group; DAPO's dynamic sampling drops the groups whose rewards
              are all equal and samples again, rl.sampling_rounds at most
    prepare   the rows (prompt + completion, targets only on completion tokens) cut into the step's
              micro-batches; forward-only passes for the old policy's log-probs (μ > 1, or the truncated
              importance-sampling correction) and the reference's (rl.beta > 0); the loss's divisor over the
              whole global batch (its completion tokens, sequences, or sequences x rl.max_new_tokens)
    update    μ times: the micro-batches through the trainer's usual machinery (accumulation, the pipeline
              schedule, every layout); `micro_loss` is scaletrain.model.rl's loss of each, its Mean's sum over
              the global divisor, so that micro-batches and ranks add up to the global batch's loss

The per-token log-probs are of the logits divided by rl.temperature, in rollout and training alike. Under
context parallelism each rank holds a chunk of every row, and its loss is its chunk's share (the cp step hook
sums gradients); each sequence's token count comes whole from the rows.
"""

from __future__ import annotations

import codecs
import collections
import io
import json
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from scaletrain.atomic import replacing
from scaletrain.data.dataset import IGNORE_INDEX
from scaletrain.errors import ConfigError, DataError
from scaletrain.model import rl
from scaletrain.model.lora import adapters_off
from scaletrain.model.preference import Mean
from scaletrain.objectives import rewards as rw
from scaletrain.objectives.passes import captured
from scaletrain.objectives.rl_data import Completion, PromptSet, RolloutRecord, to_rows
from scaletrain.parallel import pipeline
from scaletrain.parallel.context_parallel import shard_sequence
from scaletrain.parallel.tensor_parallel import whole

BUFFER_FILE = "rl_rollouts_rank{rank}.pt"  # rl.updates > 1: the round being trained on, for a resume inside it


def load_rewards(cfg) -> list[rw.Reward]:
    """rl.rewards' functions (a built-in by its name alone), weights and rl.reward_args' arguments."""
    args = json.loads(cfg.reward_args) if cfg.reward_args else {}
    out = []
    for item in (s.strip() for s in cfg.rewards.split(",")):
        if not item:
            continue
        spec, _, weight = item.partition("*")
        spec = spec.strip()
        if ":" not in spec and callable(getattr(rw, spec, None)):
            spec = f"{rw.__name__}:{spec}"
        try:
            w = float(weight) if weight else 1.0
        except ValueError:
            raise ConfigError(f"rl.rewards: the weight {weight!r} of {spec} is not a number; write "
                              "module:function*WEIGHT") from None
        name = spec.rpartition(":")[2]
        out.append(rw.load_reward(spec, w, args.get(name, args.get(spec))))
    if not out:
        raise ConfigError("rl.rewards names no reward function; give module:function, or a built-in: answer_match, "
                          "format_match, overlong_penalty")
    return out


@dataclass
class Micro:
    """What the loss of one micro-batch needs besides its logits (rows of this rank's share of the step)."""

    advantages: torch.Tensor  # (B,)
    lengths: torch.Tensor  # (B,) completion tokens of each whole row
    rollout: torch.Tensor  # (B, T) the rollout engine's log-probs, aligned with the targets (this rank's chunk)
    old: torch.Tensor | None = None  # (B, T) the trainer's log-probs before the round's first update
    ref: torch.Tensor | None = None  # (B, T) the reference's
    weights: torch.Tensor | None = None  # truncated importance weights (rl.is_correction)


ENTROPY_ROWS = 1024  # tokens a chunk of counted_entropy: its fp32 copy of their logits, never the whole batch's


@torch.no_grad()
def counted_entropy(logits: torch.Tensor, mask: torch.Tensor, temperature: float) -> Mean:
    """The sampling policy's entropy (nats) at the counted tokens of `mask`, summed, with their count. Under
    tensor parallelism `logits` is split by vocabulary (a DTensor): each rank works on its shard and three
    numbers a token are all-reduced over the tp group (the largest logit, the sum of exp, the exp-weighted sum of
    logits) — no logits gathered; the counted tokens go ENTROPY_ROWS at a time in fp32."""
    group, local = None, logits
    if isinstance(logits, DTensor):
        split = [i for i, p in enumerate(logits.placements) if p.is_shard() and p.dim % logits.ndim == logits.ndim - 1]
        group = logits.device_mesh.get_group(split[0]) if split else None
        local = logits.to_local() if split else logits.full_tensor()
    chosen = local[mask.bool()]
    total = torch.zeros((), dtype=torch.float64, device=local.device)
    for part in chosen.split(ENTROPY_ROWS):
        z = part.float() / temperature
        top = z.max(-1).values
        if group is not None:
            dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        shifted = z - top[:, None]
        e = shifted.exp()
        sums = torch.stack([e.sum(-1), (e * shifted).sum(-1)])
        if group is not None:
            dist.all_reduce(sums, group=group)
        total += (sums[0].log() - sums[1] / sums[0]).double().sum()  # H = log Σe^z - Σ e^z z / Σe^z (z shifted)
    return Mean(total, mask.sum())


class RLObjective:
    """The loss of train.objective=rl, its rollouts and metrics, for Trainer `t` (which calls `batches` for its
    micro-batches, `micro_loss` as their loss, `metrics` per logged row and `evaluate` on rl.eval_prompts)."""

    def __init__(self, t, reference_pm=None, engine=None):
        self.t, self.cfg = t, t.cfg.rl
        self.settings = self.cfg.settings()
        self.mode = "none" if reference_pm is None and self.cfg.beta == 0 else \
            ("model" if reference_pm is not None else "adapters")
        self.ref_pm, self.prompts = reference_pm, t.data.dataset
        self.rewards = load_rewards(self.cfg)
        rw.check_fields(self.rewards, list(self.prompts.fields))
        self.cp = (t.rt.axis("cp").get_group(), t.layout.cp, t.rt.axis("cp").get_local_rank()) \
            if t.layout.cp > 1 else None
        self.queue: collections.deque = collections.deque()
        self.capture: list | None = None
        self.divisor = 1.0  # the step's global divisor of the summed loss
        self.window: dict[str, Mean] = {}  # metrics since the last logged row
        self.gap_max = 0.0  # the largest |trainer - rollout| log-prob of a token since the last row
        self.last_val: dict[str, float] = {}
        self.rollout_seconds = 0.0
        self.record = RolloutRecord(self.cfg.record) if self.cfg.record else None
        self.replay = RolloutRecord(self.cfg.rollouts) if self.cfg.rollouts else None
        self._engine = engine
        if self.record is not None and t.rt.world_size > 1:
            raise ConfigError("rl.record writes the rollouts of one process; record them in a one-process run, then "
                              "replay them on any layout with rl.rollouts")
        self.val = None
        if self.cfg.eval_prompts:
            self.val = PromptSet(self.cfg.eval_prompts, self.prompts.tokenizer,
                                 t.cfg.data.seq_len - self.cfg.max_new_tokens, key="rl.eval_prompts")
            rw.check_fields(self.rewards, list(self.val.fields))
        if self.ref_pm is not None and self.ref_pm.stages:
            self.ref_pm.schedule(t.layout.pp_schedule, t.layout.grad_accum, self.micro_loss)

    def describe(self) -> str:
        """What the run trains on, for the log's data line."""
        c, s = self.cfg, self.settings
        dynamic = ", dynamic sampling" if s["dynamic_sampling"] else ""
        return (f"{len(self.prompts):,} prompts, {c.group_size} completions each of at most {c.max_new_tokens} tokens; "
                f"rl.algorithm={c.algorithm} (aggregation {s['aggregation']}, advantages {s['advantage_scaling']}, "
                f"clip [{1 - c.eps_low:g}, {1 + s['eps_high']:g}]{dynamic}), {c.updates} update(s) a round, "
                f"reference {self.mode}"
                f"{f', replaying {c.rollouts}' if c.rollouts else ''}")

    def summary(self) -> dict[str, str]:
        """The end-of-run summary's lines: the held-out reward, where the run evaluated."""
        if "val_reward" not in self.last_val:
            return {}
        val = self.last_val
        return {"held-out reward": f"{val['val_reward']:.3f} (pass rate {val['val_pass_rate']:.1%})"}

    def before_training(self, folder) -> None:
        """rl.record: a resumed run records its rounds again from where it goes on."""
        if self.record is not None:
            self.record.clear_from(self.t.step // self.cfg.updates)

    # ---- the step ---------------------------------------------------------------------------------

    def copies(self) -> int:
        """Ranks of a data-parallel rank holding the same loss: tp's (vocabulary shards reduced); cp's ranks hold
        parts of it, which add up."""
        return self.t.layout.tp

    def batches(self, loader=None):
        """(inputs, targets) micro-batches, step after step: a round of rollouts every rl.updates steps."""
        t = self.t
        while True:
            round_, first = divmod(t.step, self.cfg.updates)
            t0 = time.perf_counter()
            parts, micros = self._round(round_, resumed=first > 0)
            self.rollout_seconds += time.perf_counter() - t0
            for _ in range(first, self.cfg.updates):
                self.queue.clear()
                self.queue.extend(micros)
                yield from ((inputs, targets) for inputs, targets in parts)

    def take_ref_seconds(self) -> float:
        seconds, self.rollout_seconds = self.rollout_seconds, 0.0
        return seconds

    def micro_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """A micro-batch's loss as its share of the global batch's (model.rl's Mean, summed over the step's divisor)."""
        if pipeline.inferring():  # a stage learning its gradients' shapes: no micro-batch of the step
            return logits.float().sum() * 0
        logps, mask = self.token_logps(logits, targets)
        if self.capture is not None:
            self.capture.append(logps.detach())
            return logps.sum() * 0
        m = self.queue.popleft()
        c = self.cfg
        part = rl.rl_loss(logps, m.advantages, mask, old_logps=m.old, ref_logps=m.ref, beta=c.beta,
                          kl_estimator=c.kl_estimator, eps_low=c.eps_low, eps_high=self.settings["eps_high"],
                          aggregation=self.settings["aggregation"], max_completion_length=c.max_new_tokens,
                          weights=m.weights, row_tokens=m.lengths)
        gap = (logps.detach() - m.rollout).abs() * mask  # the trainer's log-probs against the rollout engine's
        part.metrics["logprob_gap"] = Mean(gap.sum(), mask.sum())
        self.gap_max = max(self.gap_max, float(gap.max()) if gap.numel() else 0.0)
        part.metrics["entropy"] = counted_entropy(logits, mask, self.cfg.temperature or 1.0)
        self._add(part.metrics)
        return part.loss.total / self.divisor

    def token_logps(self, logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token log-probs (B, T) of the targets under logits / rl.temperature (vocabulary shards under tensor
        parallelism), and the mask of the completion tokens."""
        mask = targets != IGNORE_INDEX
        temperature = self.cfg.temperature or 1.0
        nll = F.cross_entropy((logits.float() / temperature).flatten(0, 1), targets.masked_fill(~mask, 0).flatten(),
                              reduction="none")
        return -whole(nll).view(targets.shape) * mask, mask.float()

    def _add(self, metrics: dict[str, Mean]) -> None:
        for name, m in metrics.items():
            m = Mean(m.total.detach().double().cpu(), torch.as_tensor(m.count, dtype=torch.float64).cpu())
            self.window[name] = m if name not in self.window else self.window[name] + m

    # ---- a round of rollouts --------------------------------------------------------------------

    def _round(self, round_: int, resumed: bool = False) -> tuple[list, list[Micro]]:
        """This rank's micro-batches of round `round_`, with what their losses need (`resumed`: the run goes on
        inside the round, whose rollouts the run folder kept)."""
        t = self.t
        t.health.enter("the rollouts (sampling, rewards)")
        kept = self._kept(round_) if resumed else None
        mine = kept["completions"] if kept else self._completions(round_)
        rows = to_rows(mine, t.cfg.data.seq_len, mask_truncated=self.cfg.mask_truncated)
        advantages = torch.tensor([c.advantage for c in mine], dtype=torch.float32)
        self._global_divisor(rows["lengths"], len(mine))
        b = t.layout.micro_batch
        parts, micros = [], []
        for k in range(0, len(mine), b):
            cut = slice(k, k + b)
            inputs, targets, rollout = rows["inputs"][cut], rows["targets"][cut], rows["rollout_logps"][cut]
            if self.cp is not None:
                group, n, rank = self.cp
                inputs, targets, rollout = (shard_sequence(x, n, rank) for x in (inputs, targets, rollout))
            parts.append((inputs, targets))
            dev = t.rt.device
            micros.append(Micro(advantages[cut].to(dev), rows["lengths"][cut].to(dev), rollout.to(dev)))
        t.health.enter("the forward passes before the update (old and reference log-probs)")
        if self.cfg.updates > 1 or self.cfg.is_correction != "none":  # the policy that sampled, as the trainer has it
            for m, old in zip(micros, kept["old"] if kept else self._logps(t.pm, parts)):
                m.old = None if old is None else old.to(t.rt.device)
        if self.cfg.updates > 1 and not kept:  # a resume inside the round trains on these rollouts, this old policy
            self._keep(round_, mine, [m.old for m in micros])
        if self.mode != "none":
            for m, ref in zip(micros, self._reference(parts)):
                m.ref = ref
        if self.cfg.is_correction != "none":
            for m, (_, targets) in zip(micros, parts):
                if m.old is not None:
                    m.weights = self._is_weights(m, targets)
        return parts, micros

    def _keep(self, round_: int, completions: list[Completion], old: list) -> None:
        """The round's rollouts and the old policy's log-probs of this rank's micro-batches, in the run folder."""
        path = self.t.folder.run_dir / BUFFER_FILE.format(rank=self.t.rt.rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        buf = io.BytesIO()
        torch.save({"round": round_, "completions": [asdict(c) for c in completions],
                    "old": [None if x is None else x.cpu() for x in old]}, buf)
        with replacing(path, durable=True) as tmp:
            tmp.write_bytes(buf.getvalue())

    def _kept(self, round_: int) -> dict:
        path = self.t.folder.run_dir / BUFFER_FILE.format(rank=self.t.rt.rank)
        saved = torch.load(path, weights_only=True) if path.exists() else {}
        if saved.get("round") != round_:
            raise DataError(f"{path}: the run resumes inside round {round_} of its rollouts (rl.updates="
                            f"{self.cfg.updates}), and the rollouts of that round are not there; restore the file, or "
                            "resume from a checkpoint at a multiple of rl.updates")
        saved["completions"] = [Completion(**c) for c in saved["completions"]]
        self._truncated = sum(not c.finished for c in saved["completions"])
        return saved

    def _global_divisor(self, lengths: torch.Tensor, rows: int) -> None:
        """What the step's summed losses divide by, over the whole global batch (every rank's rows)."""
        t = self.t
        counts = torch.tensor([float(lengths.sum()), float(rows)], dtype=torch.float64, device=t.rt.device)
        if t.rt.distributed:  # every rank of a data-parallel rank holds the same rows: its copies divide out
            dist.all_reduce(counts)
            counts /= t.rt.world_size // t.layout.dp
        tokens, seqs = float(counts[0]), float(counts[1])
        self.divisor = {"token": max(tokens, 1.0), "sequence": seqs,
                        "constant": seqs * self.cfg.max_new_tokens}[self.settings["aggregation"]]
        self._add({"completions/mean_length": Mean(counts[0], counts[1]),
                   "completions/truncated": Mean(torch.tensor(float(self._truncated), dtype=torch.float64),
                                                 torch.tensor(float(rows), dtype=torch.float64))})

    def _is_weights(self, m: Micro, targets: torch.Tensor) -> torch.Tensor:
        mask = (targets != IGNORE_INDEX).float().to(m.old.device)
        if self.cfg.is_correction == "token" or self.cp is None:
            return rl.importance_weights(m.old, m.rollout, mask, self.cfg.is_correction, self.cfg.is_cap)
        log_ratio = ((m.old - m.rollout) * mask).sum(-1, keepdim=True)  # a sequence split over cp: sum its parts
        dist.all_reduce(log_ratio, group=self.cp[0])
        return torch.exp(log_ratio).clamp(max=self.cfg.is_cap)

    def _logps(self, pm, parts) -> list[torch.Tensor | None]:
        """Per-token log-probs of each micro-batch under `pm`'s model, forward only (None without the head)."""
        return captured(self, self.t, pm, parts)

    def _reference(self, parts) -> list[torch.Tensor | None]:
        if self.mode == "model":
            return self._logps(self.ref_pm, parts)
        with adapters_off(self.t.pm.dp.modules):
            return self._logps(self.t.pm, parts)

    # ---- sampling and scoring ---------------------------------------------------------------------

    def _completions(self, round_: int) -> list[Completion]:
        """This rank's completions of round `round_`, scored, with their advantages (`.advantage`)."""
        t, G = self.t, self.cfg.group_size
        per_rank = t.layout.global_batch // t.layout.dp
        if self.replay is not None:
            everyone = self.replay.read(round_)
            if len(everyone) != t.layout.global_batch:
                raise ConfigError(f"rl.rollouts: round {round_} records {len(everyone)} completions and "
                                  f"train.global_batch is {t.layout.global_batch}; replay with the recorded batch")
            mine = everyone[t.data.dp_rank * per_rank:(t.data.dp_rank + 1) * per_rank]
            self._score(mine, self.prompts)
            return self._advantaged(mine, dropped=0)
        kept: list[Completion] = []
        dropped = 0
        for attempt in range(self.cfg.sampling_rounds if self.settings["dynamic_sampling"] else 1):
            fresh = self._sample(round_, attempt, per_rank // G)
            self._score(fresh, self.prompts)
            if self.settings["dynamic_sampling"]:
                keep = rl.informative_groups(torch.tensor([c.reward for c in fresh]), G)
                dropped += int((~keep).sum()) // G
                fresh = [c for c, k in zip(fresh, keep.tolist()) if k]
            kept += fresh[:per_rank - len(kept)]
            if self._all_full(len(kept) >= per_rank):
                break
        if len(kept) < per_rank:  # what dynamic sampling left unfilled
            kept = self._fill(kept, per_rank, round_)
        if self.record is not None:
            self.record.write(round_, kept)
        return self._advantaged(kept, dropped)

    def _all_full(self, full: bool) -> bool:
        """Whether every rank has filled its share (each samples until all have: sharded generation runs the
        same forwards on every rank of a group)."""
        if not self.t.rt.distributed:
            return full
        flag = torch.tensor([0.0 if full else 1.0], device=self.t.rt.device)
        dist.all_reduce(flag)
        return bool(flag.item() == 0)

    def _fill(self, kept: list[Completion], per_rank: int, round_: int) -> list[Completion]:
        """A share dynamic sampling could not fill with groups that teach: the kept groups repeated, so the batch
        keeps its size (a repeated group counts again in the mean), said in the metrics."""
        self._add({"dynamic_sampling/unfilled": Mean(torch.tensor(float(per_rank - len(kept)), dtype=torch.float64),
                                                     torch.tensor(1.0, dtype=torch.float64))})
        if not kept:
            raise ConfigError(f"round {round_}: rl.sampling_rounds={self.cfg.sampling_rounds} rounds of sampling found "
                              "no group whose rewards differ (every completion scored alike); start from a model "
                              "that sometimes solves the task, or raise rl.group_size or rl.temperature")
        while len(kept) < per_rank:
            kept += kept[:per_rank - len(kept)]
        return kept

    def _sample(self, round_: int, attempt: int, prompts: int) -> list[Completion]:
        """G completions of each of this rank's `prompts` prompts of (round, attempt), from the rollout engine."""
        from scaletrain.rollout.engine import SamplingParams

        t, c = self.t, self.cfg
        # the step's prompts are a stretch of the run's stream, this rank's its share of it; each completion
        # draws from (seed, round, attempt, its index in the step): what one process would draw, on any layout
        mine = t.data.dp_rank * prompts
        start = (round_ * c.sampling_rounds + attempt) * t.layout.dp * prompts + mine
        chosen = self.prompts.draw(t.cfg.train.seed, start, prompts)
        params = SamplingParams(n=c.group_size, max_new_tokens=c.max_new_tokens, temperature=c.temperature or 1.0,
                                top_p=c.top_p, top_k=c.top_k if c.temperature else 1, stop_token_ids=self._stop_ids(),
                                stop_strings=self._stop_strings(),
                                seed=(t.cfg.train.seed * 1_000_003 + round_ * 1009 + attempt) % 2**62)
        out = self.engine().generate([self.prompts.ids[i] for i in chosen], params, first_index=mine)
        self._add({"time/generation_s": Mean(torch.tensor(out.generation_seconds, dtype=torch.float64),
                                             torch.tensor(1.0, dtype=torch.float64)),
                   "time/generated_tokens": Mean(torch.tensor(float(out.tokens_generated), dtype=torch.float64),
                                                 torch.tensor(1.0, dtype=torch.float64))})
        return [Completion(chosen[out.prompt_index[k]], list(out.prompt_ids[k]), list(out.completion_ids[k]),
                           [float(x) for x in out.logprobs[k]], bool(out.finished[k]))
                for k in range(len(out.completion_ids))]

    def _stop_strings(self) -> tuple[str, ...]:
        """rl.stop, its backslash escapes read (\\n on a command line is a newline)."""
        return (codecs.decode(self.cfg.stop, "unicode_escape"),) if self.cfg.stop else ()

    def _stop_ids(self) -> tuple[int, ...]:
        eos = getattr(self.prompts.tokenizer, "eos_id", None)
        return (eos,) if eos is not None else ()

    def engine(self):
        """The rollout engine: scaletrain's own, on the live policy (built at first use)."""
        if self._engine is None:
            from scaletrain.rollout.local import LocalEngine

            t = self.t  # (pipeline and context parallelism cannot sample: the legality check refuses them)
            self._engine = LocalEngine(t.pm.dp.module, tokenizer=self.prompts.tokenizer, autocast=t.precision.autocast,
                                       group=dist.group.WORLD if t.rt.distributed else None,  # forwards in step
                                       max_len=t.cfg.data.seq_len,
                                       length_multiple=t.pm.length_multiple)
        return self._engine

    def _score(self, completions: list[Completion], prompts: PromptSet) -> None:
        """Each completion's rewards, from its prompt's row fields."""
        if not completions:
            return
        tok = prompts.tokenizer
        fields = {name: [col[c.prompt] for c in completions] for name, col in prompts.fields.items()}
        fields["completion_ids"] = [c.completion_ids for c in completions]
        scores = rw.score(self.rewards, [prompts.texts[c.prompt] for c in completions],
                          [tok.decode(c.completion_ids) for c in completions], fields)
        for i, c in enumerate(completions):
            c.reward = float(scores.total[i])
            c.rewards = {name: float(v[i]) for name, v in scores.each.items()}

    def _advantaged(self, completions: list[Completion], dropped: int) -> list[Completion]:
        rewards = torch.tensor([c.reward for c in completions])
        adv = rl.group_advantages(rewards, self.cfg.group_size, scaling=self.settings["advantage_scaling"])
        for c, a in zip(completions, adv.tolist()):
            c.advantage = a
        self._truncated = sum(not c.finished for c in completions)
        n = torch.tensor(float(len(completions)), dtype=torch.float64)
        metrics = {"reward": Mean(rewards.double().sum(), n), "reward_sq": Mean((rewards.double() ** 2).sum(), n),
                   "pass_rate": Mean(torch.tensor(float(sum(c.reward > 0 for c in completions)), dtype=torch.float64),
                                     n),
                   "dynamic_sampling/dropped_groups": Mean(torch.tensor(float(dropped), dtype=torch.float64),
                                                           torch.tensor(1.0, dtype=torch.float64))}
        for name in completions[0].rewards if completions else []:
            short = name.rpartition(":")[2]
            each = torch.tensor([c.rewards[name] for c in completions], dtype=torch.float64)
            metrics[f"rewards/{short}"] = Mean(each.sum(), n)
            metrics[f"rewards/{short}_sq"] = Mean((each ** 2).sum(), n)
        self._add(metrics)
        return completions

    # ---- metrics and evaluation -----------------------------------------------------------------

    METRICS = ("reward", "reward_sq", "pass_rate", "clip_ratio/low", "clip_ratio/high", "clip_ratio/region",
               "kl", "entropy", "advantage", "logprob_gap", "completions/mean_length",
               "completions/truncated", "dynamic_sampling/dropped_groups", "dynamic_sampling/unfilled",
               "time/generation_s", "time/generated_tokens")

    def metric_names(self) -> list[str]:
        each = [f"rewards/{r.name.rpartition(':')[2]}" for r in self.rewards]
        return [*self.METRICS, *each, *(f"{name}_sq" for name in each)]

    def metrics(self) -> dict[str, float]:
        """The rollouts' rewards and the updates' clip, KL, entropy and log-prob gap since the last row (every
        rank calls it: one all-reduce over the world)."""
        names = self.metric_names()
        values = torch.zeros(len(names), 2, dtype=torch.float64, device=self.t.rt.device)
        for i, name in enumerate(names):
            if name in self.window:
                values[i, 0], values[i, 1] = self.window[name].total, self.window[name].count
        gap_max = torch.tensor([self.gap_max], dtype=torch.float64, device=self.t.rt.device)
        self.window, self.gap_max = {}, 0.0
        if self.t.rt.distributed:
            dist.all_reduce(values)
            dist.all_reduce(gap_max, op=dist.ReduceOp.MAX)
        means = {n: float(values[i, 0] / values[i, 1].clamp(min=1)) for i, n in enumerate(names) if values[i, 1] > 0}
        out = {n: v for n, v in means.items() if not n.endswith("_sq")}
        for name in [n for n in out if n == "reward" or n.startswith("rewards/")]:  # std from the mean of squares
            out[f"{name}_std"] = max(0.0, means[f"{name}_sq"] - out[name] ** 2) ** 0.5
        out["logprob_gap_max"] = float(gap_max)
        if out.get("time/generation_s"):  # the sampling's own rate (the step's tokens/s is training's)
            out["time/generation_tokens_per_s"] = out["time/generated_tokens"] / out["time/generation_s"]
        return out

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """rl.eval_prompts: one completion of each (greedy, or at rl.eval_temperature with the same draws every
        time), split over the data-parallel ranks; the rewards' mean (val_reward), each function's and the pass
        rate."""
        from scaletrain.rollout.engine import SamplingParams

        t = self.t
        t.health.enter("evaluation (sampling the held-out prompts)")
        n, dp, rank = len(self.val), t.layout.dp, t.data.dp_rank
        longest = (n + dp - 1) // dp  # every rank runs as many prompts (sharded generation goes in step)
        share = list(range(rank * longest, min(n, (rank + 1) * longest)))  # a stretch: each draws as one process
        temperature = self.cfg.eval_temperature
        params = SamplingParams(n=1, max_new_tokens=self.cfg.max_new_tokens, temperature=temperature or 1.0,
                                top_k=0 if temperature else 1,  # greedy at 0
                                stop_token_ids=self._stop_ids(), stop_strings=self._stop_strings(), seed=0)
        ids = [self.val.ids[i] for i in share] + [self.val.ids[0]] * (longest - len(share))
        out = self.engine().generate(ids, params, first_index=rank * longest)
        done = [Completion(share[k], list(out.prompt_ids[k]), list(out.completion_ids[k]), [], bool(out.finished[k]))
                for k in range(len(share))]
        self._score(done, self.val)
        names = ["reward", "pass_rate", *(r.name for r in self.rewards)]
        values = torch.zeros(len(names) + 1, dtype=torch.float64, device=t.rt.device)
        values[0] = sum(c.reward for c in done)
        values[1] = sum(c.reward > 0 for c in done)
        for i, r in enumerate(self.rewards):
            values[2 + i] = sum(c.rewards[r.name] for c in done)
        values[-1] = len(done)
        if t.rt.distributed:
            dist.all_reduce(values)
            values /= t.rt.world_size // dp
        count = float(values[-1].clamp(min=1))
        self.last_val = {"val_loss": -float(values[0]) / count, "val_reward": float(values[0]) / count,
                         "val_pass_rate": float(values[1]) / count,
                         **{f"val_rewards/{r.name.rpartition(':')[2]}": float(values[2 + i]) / count
                            for i, r in enumerate(self.rewards)}}
        return self.last_val
