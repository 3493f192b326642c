"""The colocated rollout engine: completions sampled from the live training module, on the training ranks,
with the weights as training shards them (issue 50, point 1).

Batching: the completions of prompts of one length go through the model together, n per prompt, so no row
is padded and each row's forward is the one a single sequence would get (positions from 0, the causal
mask alone). Prompts of other lengths go in batches of their own, one after the other. A row that has
stopped is fed its last token again until its batch ends (its outputs are thrown away): the batch keeps
its shape, and the key/value cache (scaletrain.model.kv_cache) stays one buffer per block.

Each token costs the forward of one position with the cache; without it (`use_cache=False`: a module
whose forward takes no cache, or a compiled one) every token re-runs the whole sequence so far.

Sharded modules: under ZeRO-3 / FSDP2 each forward gathers the weights of each block as it goes, and
under tensor parallelism each forward's collectives join the tp ranks, so every rank of the group must
run the same number of forwards. `group` names those ranks: before each forward they agree, with a
one-number all-reduce, whether any of them still has a row running; one that has finished its own
prompts runs a forward of one token (thrown away) while the others go on. The ranks of a tp group are
given the same prompts and seed, so they draw the same tokens from the same (gathered) logits. Under
sequence parallelism each forward's length must split evenly over the tp ranks: the engine pads each
forward at its end (`length_multiple`), which no real position sees under the causal mask. Pipeline
stages hold part of the model and cannot sample on their own: refused.

The log-probability kept per token is log_softmax(logits / temperature) of the full distribution at the
drawn token, in fp32. By default (`rescore=True`) it comes from one more forward per completion, of the
prompt and the completion whole, as `logprobs_of` (the trainer's side) computes it: the same numbers, bit
for bit, on any layout. The forwards that drew the tokens (one position at a time against the cache) give
the same distribution up to fp32 rounding: on the demo model their log-probs are within 2e-6 of the whole
forward's (benchmarks/rollout.py; `Rollouts.sampling_gap` reports it per call). `rescore=False` keeps
those and saves the forwards (B x (prompt + completion) positions, about one step of training's forward).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from scaletrain.errors import ConfigError
from scaletrain.model.generate import forward_logits
from scaletrain.model.kv_cache import KVCache
from scaletrain.model.preference import token_logps
from scaletrain.rollout.engine import Rollouts, SamplingParams
from scaletrain.rollout.sampling import completion_generator, draw, filtered_probs, full_logprobs, scaled

PIPELINE_REFUSAL = "generation under pipeline parallelism is not supported yet; use tp or ZeRO-3"
WINDOW_PADDING_REFUSAL = ("generation of a model with local attention (model.sliding_window or model.attn_chunk) "
                          "under sequence parallelism is not supported yet: its cache cannot take back the "
                          "padding; turn parallel.sp off")


def _device_of(module: nn.Module) -> torch.device:
    p = next(module.parameters())
    return p.to_local().device if isinstance(p, DTensor) else p.device


def completion_logprobs(logits: torch.Tensor, tokens: torch.Tensor, prompt_len: int,
                        temperature: float) -> torch.Tensor:
    """(C,) fp32 from the logits (1, P + C, V) of tokens (1, P + C): the positions that predict each
    completion token, divided by the temperature, log-softmax at that token (model.preference.token_logps,
    as the trainer computes them)."""
    targets = tokens[:, prompt_len:]
    return token_logps(scaled(logits[:, prompt_len - 1:-1], temperature), targets, torch.ones_like(targets))[0]


class _Batch:
    """The n completions of each of some prompts of one length, drawn one token per forward."""

    def __init__(self, prompts: list[tuple[int, list[int]]], params: SamplingParams, device: torch.device,
                 use_cache: bool, tokenizer, first_index: int, multiple: int):
        self.params, self.tokenizer = params, tokenizer
        self.rows = [(i, j) for i, _ in prompts for j in range(params.n)]
        self.prompt_of = dict(prompts)
        ids = [ids for _, ids in prompts for _ in range(params.n)]
        self.tokens = torch.tensor(ids, dtype=torch.long, device=device)  # (B, P), then what is fed
        self.generators = [completion_generator(params.seed, first_index + i, j, device) for i, j in self.rows]
        # (room for the padding of the last forward, `multiple` - 1 positions past the last real one)
        self.cache = KVCache(self.tokens.shape[1] + params.max_new_tokens + multiple - 1) if use_cache else None
        self.completions: list[list[int]] = [[] for _ in self.rows]
        self.logprobs: list[list[torch.Tensor]] = [[] for _ in self.rows]
        self.finished = [False] * len(self.rows)
        self.running = [True] * len(self.rows)
        self.fed = 0  # forwards so far

    @property
    def done(self) -> bool:
        return not any(self.running)

    def next_input(self) -> tuple[torch.Tensor, KVCache | None]:
        """The positions to run next: the prompts first, then with the cache the last token alone."""
        return (self.tokens if self.cache is None or self.fed == 0 else self.tokens[:, -1:]), self.cache

    def take(self, logits: torch.Tensor) -> None:
        """Draw each running row's next token from the logits (B, T, V) of the positions run."""
        self.fed += 1
        p = self.params
        s = scaled(logits[:, -1], p.temperature)
        live = [b for b, r in enumerate(self.running) if r]
        nxt = self.tokens[:, -1].clone()  # a stopped row is fed its last token again (thrown away)
        nxt[live] = draw(filtered_probs(s[live], p.top_k, p.top_p), [self.generators[b] for b in live])
        lps = full_logprobs(s, nxt)
        for b in live:
            self.completions[b].append(int(nxt[b]))
            self.logprobs[b].append(lps[b])
            self.finished[b] = self._stops(self.completions[b])
            self.running[b] = not self.finished[b] and len(self.completions[b]) < p.max_new_tokens
        self.tokens = torch.cat([self.tokens, nxt[:, None]], dim=1)

    def _stops(self, completion: list[int]) -> bool:
        """Whether the completion's last token ends it: a stop id, or the one that completes a stop string
        (checked after every token, so the first time a string appears is the token that completed it)."""
        if completion[-1] in self.params.stop_token_ids:
            return True
        if self.params.stop_strings:
            text = self.tokenizer.decode(completion)
            return any(s in text for s in self.params.stop_strings)
        return False

    def results(self):
        for b, (i, j) in enumerate(self.rows):
            yield (i, j), self.prompt_of[i], self.completions[b], torch.stack(self.logprobs[b]), self.finished[b]


class _Rescore:
    """The log-probs of a sampled batch's completions again, one forward of prompt + completion per row,
    as `logprobs_of` computes them (run once the batch is done)."""

    def __init__(self, batch: _Batch):
        self.batch, self.row, self.logprobs = batch, 0, []

    @property
    def done(self) -> bool:
        return self.row == len(self.batch.rows)

    def next_input(self) -> tuple[torch.Tensor, None]:
        i, _ = self.batch.rows[self.row]
        ids = self.batch.prompt_of[i] + self.batch.completions[self.row]
        return torch.tensor([ids], dtype=torch.long, device=self.batch.tokens.device), None

    def take(self, logits: torch.Tensor) -> None:
        tokens, _ = self.next_input()
        i, _ = self.batch.rows[self.row]
        self.logprobs.append(completion_logprobs(logits, tokens, len(self.batch.prompt_of[i]),
                                                 self.batch.params.temperature))
        self.row += 1


class LocalEngine:
    """Completions from the live training module (a scaletrain Transformer, plain or sharded).

    `group`: the ranks that must run the same number of forwards (a sharded module's: the data-parallel
    shards of ZeRO-3 and the tp ranks; None for a module this process runs alone). `tokenizer` (with a
    `decode(ids) -> str`): needed for stop strings. `use_cache=False`: every token re-runs the sequence.
    `autocast`: the context the forwards run in (the run's precision). `max_len`: the longest prompt +
    completion (default: the model's max_seq_len). `length_multiple`: what every forward's length must be
    a multiple of: under sequence parallelism (parallel.sp) the tp size, as the sequence is cut in equal
    shards; each forward is then padded at its end (a decode step runs `length_multiple` positions).
    `rescore`: the log-probs from a forward of each prompt + completion whole (see the module's docstring)."""

    def __init__(self, module: nn.Module, *, tokenizer=None, group=None, use_cache: bool = True,
                 autocast: Callable[[], AbstractContextManager] = contextlib.nullcontext, max_len: int | None = None,
                 length_multiple: int = 1, rescore: bool = True):
        if getattr(module, "tok_emb", True) is None or getattr(module, "output", True) is None:
            raise ConfigError(PIPELINE_REFUSAL)
        self.module, self.tokenizer, self.group = module, tokenizer, group
        self.use_cache, self.autocast, self.multiple, self.rescore = use_cache, autocast, length_multiple, rescore
        windowed = any(getattr(m, "window", None) is not None for m in module.modules())
        if length_multiple > 1 and use_cache and windowed:  # (the padding's keys cannot be taken back)
            raise ConfigError(WINDOW_PADDING_REFUSAL)
        cfg = getattr(module, "cfg", None)
        self.max_len = max_len if max_len is not None else getattr(cfg, "max_seq_len", None)
        self.device = _device_of(module)

    def sync_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Nothing to do: this engine samples from the training module itself, whose weights are the
        trainer's at every moment."""

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams, *, first_index: int = 0) -> Rollouts:
        """`params.n` completions of each prompt, prompt-major (see the module's docstring). Completion j
        of prompts[i] draws from (params.seed, first_index + i, j) alone: a data-parallel rank given the
        prompts first_index, first_index + 1, ... of a step draws what one process given them all would."""
        self._check(prompts, params)
        t0 = time.perf_counter()
        by_length: dict[int, list[tuple[int, list[int]]]] = {}
        for i, ids in enumerate(prompts):
            by_length.setdefault(len(ids), []).append((i, list(ids)))
        batches = [_Batch(same, params, self.device, self.use_cache, self.tokenizer, first_index, self.multiple)
                   for same in by_length.values()]
        rescores = [_Rescore(b) for b in batches] if self.rescore else []
        was_training = self.module.training
        self.module.eval()
        try:
            forwards = self._run([*batches, *rescores])
        finally:
            self.module.train(was_training)
            self._release()
        out = self._collect(batches, rescores)
        out.forwards = forwards
        out.generation_seconds = time.perf_counter() - t0
        return out

    @staticmethod
    def _collect(batches: list[_Batch], rescores: list[_Rescore]) -> Rollouts:
        """The rows of every batch in prompt-major order, with the rescored log-probs where there are."""
        rows = []
        for k, batch in enumerate(batches):
            for b, (key, prompt, completion, sampled, finished) in enumerate(batch.results()):
                final = rescores[k].logprobs[b] if rescores else sampled
                rows.append((key, prompt, completion, final, finished, (final - sampled).abs().max().item()))
        out = Rollouts()
        for (i, _), prompt, completion, lps, finished, gap in sorted(rows, key=lambda row: row[0]):
            out.prompt_index.append(i)
            out.prompt_ids.append(prompt)
            out.completion_ids.append(completion)
            out.logprobs.append(lps)
            out.finished.append(finished)
            out.sampling_gap = max(out.sampling_gap, gap)
        out.tokens_generated = sum(out.lengths)
        return out

    def _run(self, jobs: list[_Batch | _Rescore]) -> int:
        """Every job's forwards, one at a time, in order; with a group, as many as the busiest rank's."""
        pending, forwards = iter(jobs), 0
        current = next(pending, None)
        while True:
            while current is not None and current.done:
                current = next(pending, None)
            if not self._anyone_running(current is not None):
                return forwards
            with self.autocast():
                if current is None:  # the others still run: a forward of one token, thrown away
                    forward_logits(self.module, torch.zeros(1, 1, dtype=torch.long, device=self.device),
                                   KVCache(self.multiple) if self.use_cache else None, self.multiple)
                else:
                    tokens, cache = current.next_input()
                    current.take(forward_logits(self.module, tokens, cache, self.multiple))
            forwards += 1

    def _anyone_running(self, mine: bool) -> bool:
        if self.group is None:
            return mine
        flag = torch.tensor([1.0 if mine else 0.0], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return bool(flag.item() > 0)

    def _release(self) -> None:
        """Free what FSDP gathered for the forwards (its root keeps its weights whole after a forward)."""
        for m in self.module.modules():
            if hasattr(m, "reshard"):
                m.reshard()

    def _check(self, prompts: list[list[int]], params: SamplingParams) -> None:
        if params.stop_strings and self.tokenizer is None:
            raise ConfigError(f"sampling: stop_strings={list(params.stop_strings)} need a tokenizer to decode "
                              "completions; give the engine one, or stop by stop_token_ids")
        for i, ids in enumerate(prompts):
            if not ids:
                raise ConfigError(f"prompt {i} holds no token: the model has nothing to continue from")
            padding = self.multiple - 1  # (the last forward's, under sequence parallelism)
            if self.max_len is not None and len(ids) + params.max_new_tokens + padding > self.max_len:
                extra = f" + {padding} of padding" if padding else ""
                raise ConfigError(f"prompt {i} of {len(ids)} tokens + max_new_tokens={params.max_new_tokens}{extra} "
                                  f"exceeds the model's context of {self.max_len} positions; lower "
                                  f"max_new_tokens or shorten the prompt")


@torch.no_grad()
def logprobs_of(module: nn.Module, prompt_ids: list[int], completion_ids: list[int], temperature: float,
                autocast: Callable[[], AbstractContextManager] = contextlib.nullcontext,
                length_multiple: int = 1) -> torch.Tensor:
    """(len(completion_ids),) fp32: the trainer's side of the comparison. One forward of prompt +
    completion (padded at its end to `length_multiple`, as LocalEngine's), the logits of the positions
    that predict each completion token divided by the temperature, their log-softmax at that token."""
    tokens = torch.tensor([list(prompt_ids) + list(completion_ids)], dtype=torch.long, device=_device_of(module))
    with autocast():
        logits = forward_logits(module, tokens, None, length_multiple)
    return completion_logprobs(logits, tokens, len(prompt_ids), temperature)
