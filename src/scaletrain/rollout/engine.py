"""What every rollout engine provides (issue 50): completions sampled from prompts, with the log-probability
of each sampled token, for reinforcement learning with verifiable rewards.

An engine takes prompts as token ids and `SamplingParams`, and returns `Rollouts`: the completions in
prompt-major order (prompt i's n completions on adjacent rows), each with its tokens, the fp32
log-probability of each token under the policy that drew it, and whether it ended by a stop or was cut by
the length limit. Ours is `scaletrain.rollout.local.LocalEngine`, colocated: it samples from the live
training module on the training ranks, with its weights as they are sharded.

An external engine (vLLM, SGLang; a GPU server of its own) plugs in through the same two methods. What it
must provide, for a trainer to use it as it uses ours:

* `generate(prompts, params) -> Rollouts`, honouring every field of `SamplingParams`: n completions per
  prompt, temperature, top-p and top-k applied in that order (temperature, then top-k, then top-p on what
  top-k kept), stop ids kept in the completion, stop strings cutting after the token that completes them,
  at most `max_new_tokens`, and draws fixed by `seed` and each prompt's index (`first_index` + i);
* log-probs of the FULL distribution at the temperature, log_softmax(logits / temperature) at the sampled
  token, before top-k/top-p filtering (what the trainer computes on the same tokens; vLLM's "processed
  logprobs" mode), in fp32;
* `finished` per completion (False: cut by `max_new_tokens`);
* `sync_weights(named)`: take the policy's weights by Hugging Face name (`model.layers.0.self_attn.q_proj.
  weight`, ...), whole tensors (the trainer gathers a sharded one first), and serve the next `generate`
  from them; it returns once they are in use. Its log-probs then differ from the trainer's by the
  engine's own kernels and precision: the trainer measures that gap and corrects for it (truncated
  importance sampling).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from scaletrain.errors import ConfigError


@dataclass(frozen=True)
class SamplingParams:
    """How completions are drawn. Each field is checked when made: a bad one is a ConfigError naming it."""

    n: int = 1  # completions per prompt (G, the group size of GRPO)
    max_new_tokens: int = 64  # a completion longer than this is cut (finished = False)
    temperature: float = 1.0  # logits / temperature before sampling; the log-probs are at this temperature too
    top_p: float = 1.0  # keep the fewest most likely tokens whose probability adds up to top_p (1 = off)
    top_k: int = 0  # keep the k most likely tokens (0 = off)
    stop_token_ids: tuple[int, ...] = ()  # a completion ends at one of these (EOS), which it keeps
    stop_strings: tuple[str, ...] = ()  # ... or at the token that completes one of these texts (needs a tokenizer)
    seed: int = 0  # completion j of prompt i draws from (seed, i, j) alone (i counted from generate's first_index)

    def __post_init__(self):
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        object.__setattr__(self, "stop_strings", tuple(self.stop_strings))
        checks = [
            (self.n >= 1, f"n={self.n} must be 1 or more (completions per prompt)"),
            (self.max_new_tokens >= 1, f"max_new_tokens={self.max_new_tokens} must be 1 or more"),
            (self.temperature > 0, f"temperature={self.temperature} must be above 0 (for greedy use top_k=1)"),
            (0 < self.top_p <= 1, f"top_p={self.top_p} must lie in (0, 1] (1 = off)"),
            (self.top_k >= 0, f"top_k={self.top_k} must be 0 (off) or more"),
            (all(s for s in self.stop_strings), "stop_strings holds an empty string, which would stop every "
                                                "completion at once; remove it"),
        ]
        bad = [f"sampling: {text}" for ok, text in checks if not ok]
        if bad:
            raise ConfigError(*bad)


@dataclass
class Rollouts:
    """Completions in prompt-major order: rows i*n .. i*n + n - 1 are prompt i's (of the prompts given)."""

    prompt_index: list[int] = field(default_factory=list)  # which prompt of the call each row continues
    prompt_ids: list[list[int]] = field(default_factory=list)
    completion_ids: list[list[int]] = field(default_factory=list)  # a stop id included, no padding
    logprobs: list[torch.Tensor] = field(default_factory=list)  # fp32 (len(completion),) per row, full distribution
    finished: list[bool] = field(default_factory=list)  # True: a stop id or string ended it; False: cut by length
    generation_seconds: float = 0.0  # wall time of the whole call
    tokens_generated: int = 0  # completion tokens (what the rows hold, not the fillers of finished rows)
    forwards: int = 0  # forwards run (the same on every rank of a sharded group)
    sampling_gap: float = 0.0  # the largest |log-prob| difference of the forwards that drew the tokens from
    # those kept (0 when they are the same: LocalEngine without rescoring); a measure of the cache's rounding

    def __len__(self) -> int:
        return len(self.completion_ids)

    @property
    def lengths(self) -> list[int]:
        return [len(c) for c in self.completion_ids]

    @property
    def tokens_per_second(self) -> float:
        return self.tokens_generated / self.generation_seconds if self.generation_seconds > 0 else 0.0


@runtime_checkable
class RolloutEngine(Protocol):
    """Samples completions for prompts; the module's docstring says what each method must honour."""

    def generate(self, prompts: list[list[int]], params: SamplingParams, *, first_index: int = 0) -> Rollouts:
        """`params.n` completions of each prompt (token ids), prompt-major; completion j of prompts[i]
        draws from (params.seed, first_index + i, j), so a rank's share of a step's prompts, given the
        index of its first, draws what one process would."""
        ...

    def sync_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Serve the next `generate` from these weights (Hugging Face names, whole tensors)."""
        ...
