"""A model, however it is sharded, as an lm-evaluation-harness language model (`lm_eval.api.model.LM`).

`HarnessLM` answers lm-eval's three requests: the log-likelihood of a continuation after a context
(multiple-choice tasks), the rolling log-likelihood of a whole text (perplexity tasks) and greedy
generation up to a stop sequence (generation tasks). The text is split into tokens exactly as
lm-eval's Hugging Face backend (`hf`) splits it (lm-eval's TemplateLM: the context's trailing spaces
go with the continuation, an empty context is the prefix token), inputs longer than the model's
window are cut from the left as there, and generation greedily continues each context for at most
the task's max_gen_toks, so a model scores what its `export --format hf` scores under `hf`.

Requests are batched: rows of different lengths are padded on the right, which a causal model's
real positions never see. Every rank of a sharded model (ZeRO-3, tensor parallel) runs this on the
same requests in the same order: each forward is taken by all of them together, vocabulary shards
are gathered, and the stopping of generation is decided from those same logits on every rank.
lm-eval is told rank 0 of 1 so that it does not split the requests over the ranks itself.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext

import torch
import torch.nn.functional as F
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from torch.distributed.tensor import DTensor

from scaletrain.errors import ConfigError

DEFAULT_MAX_GEN_TOKS = 256  # lm-eval's Hugging Face backend's, for a task that names none


class HarnessLM(TemplateLM):
    """`module` (tokens (B, T) -> logits (B, T, vocab), maybe sharded) with `tokenizer` (encode,
    decode, and the special ids it has) as an lm-eval model. `max_length`: the longest input, the
    window the model was trained for. `batch_size`: sequences per forward."""

    def __init__(self, module: torch.nn.Module, tokenizer, *, max_length: int, device: torch.device,
                 batch_size: int = 8, autocast: Callable[[], AbstractContextManager] = nullcontext):
        super().__init__()
        self.module, self.tok = module, tokenizer
        self._device = device  # (lm-eval's LM.device)
        self.max_length, self.batch_size, self.autocast = max_length, batch_size, autocast
        end = _end_of_text(tokenizer)
        self.end_id = end  # generation stops there (None: no such token, only the task's stop strings)
        # what stands before a text that has no context: the tokenizer's BOS (else its end-of-text), as for `hf`;
        # byte-level text, which has neither, starts after the blank line that separates documents
        bos = getattr(tokenizer, "bos_id", None)
        self.prefix = bos if bos is not None else end if end is not None else tokenizer.separator[-1]

    # what TemplateLM asks
    @property
    def eot_token_id(self) -> int:
        return self.prefix if self.end_id is None else self.end_id

    @property
    def prefix_token_id(self) -> int:
        return self.prefix

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        return super().loglikelihood(requests, disable_tqdm=True)  # (no progress bar for the tokenizing)

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.tok.encode(string)

    # ------------------------------------------------------------------------------------------
    # forwards

    @torch.no_grad()
    def log_probs(self, rows: list[list[int]]) -> torch.Tensor:
        """Log-probabilities (B, T, vocab), fp32, of rows of token ids padded on the right to the longest."""
        width = max(len(r) for r in rows)
        x = torch.zeros(len(rows), width, dtype=torch.long)
        for i, r in enumerate(rows):
            x[i, :len(r)] = torch.tensor(r)
        with self.autocast():
            logits = self.module(x.to(self.device))
        if isinstance(logits, DTensor):  # vocabulary shards (tensor parallel): every rank takes the whole
            logits = logits.full_tensor()
        return F.log_softmax(logits.float(), dim=-1)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """(log-likelihood, is greedy) of each continuation after its context, in the requests' order;
        the longest first, so a batch is padded little."""
        out: list[tuple[float, bool] | None] = [None] * len(requests)
        if too_long := next((r for r in requests if len(r[2]) > self.max_length), None):
            raise ConfigError(f"a continuation of {len(too_long[2])} tokens is longer than the model's window of "
                              f"{self.max_length} (model.max_seq_len): a task that asks for it cannot be scored "
                              f"with this model ({too_long[0][1][:40]!r}...)")
        order = sorted(range(len(requests)), key=lambda i: -len(requests[i][1]) - len(requests[i][2]))
        for batch in _batches(order, self.batch_size):
            # the input: context + continuation, its last token dropped, cut to the window from the left
            rows = [(requests[i][1] + requests[i][2])[-(self.max_length + 1):][:-1] for i in batch]
            logp = self.log_probs(rows)
            for i, row, lp in zip(batch, rows, logp):
                cont = requests[i][2]
                picked = lp[len(row) - len(cont):len(row)]  # (len(cont), vocab): the positions predicting it
                target = torch.tensor(cont, device=picked.device)
                total = picked.gather(1, target[:, None]).sum()
                out[i] = (float(total), bool((picked.argmax(-1) == target).all()))
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each text's log-likelihood, in windows of the model's length that each predict new tokens
        (lm-eval's rolling windows, one token of context at the start)."""
        windows, owner = [], []
        for n, (text,) in enumerate(req.args for req in requests):
            for context, continuation in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append(((None,), context, continuation))
                owner.append(n)
        totals = [0.0] * len(requests)
        for n, (logp, _) in zip(owner, self._loglikelihood_tokens(windows)):
            totals[n] += logp
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy continuations, each cut at the first of its stop strings; requests with the same
        generation settings are batched, the longest context first."""
        out: list[str | None] = [None] * len(requests)
        groups: dict[str, list[int]] = {}
        for i, req in enumerate(requests):
            groups.setdefault(repr(sorted(req.args[1].items())), []).append(i)
        for members in groups.values():
            kwargs = normalize_gen_kwargs(requests[members[0]].args[1], DEFAULT_MAX_GEN_TOKS)
            if kwargs.get("do_sample"):
                raise ConfigError(f"task {requests[members[0]].task_name} samples its generations (do_sample=true); "
                                  "scaletrain's evaluation generates greedily: set do_sample: false in its YAML")
            until = handle_stop_sequences(kwargs["until"], eos=None)  # the end-of-text token stops by its id
            steps = kwargs["max_gen_toks"]
            if steps >= self.max_length:
                raise ConfigError(f"task {requests[members[0]].task_name} generates up to {steps} tokens, not fewer "
                                  f"than the model's window of {self.max_length}; lower max_gen_toks in its YAML")
            contexts = {i: self.tok_encode(requests[i].args[0])[-(self.max_length - steps):] for i in members}
            order = sorted(members, key=lambda i: (-len(contexts[i]), requests[i].args[0]))
            for batch in _batches(order, self.batch_size):
                for i, text in zip(batch, self.greedy([contexts[i] for i in batch], steps, until)):
                    out[i] = postprocess_generated_text(text, until, None)
        return out

    @torch.no_grad()
    def greedy(self, contexts: list[list[int]], steps: int, until: list[str]) -> list[str]:
        """The greedy continuation of each context (at most `steps` tokens), as text: a row stops at
        the end-of-text token or once its text holds a stop string; all stop when every row has."""
        rows = [list(c) for c in contexts]
        new: list[list[int]] = [[] for _ in rows]
        done = [False] * len(rows)
        for _ in range(steps):
            logp = self.log_probs(rows)
            for k, row in enumerate(rows):
                token = int(logp[k, len(row) - 1].argmax())
                row.append(token)  # a finished row goes on being fed: its later tokens are not kept
                if done[k]:
                    continue
                if token == self.end_id:
                    done[k] = True
                    continue
                new[k].append(token)
                text = self.tok.decode(new[k])
                done[k] = any(s and s in text for s in until)
            if all(done):
                break
        return [self.tok.decode(t) for t in new]


def _end_of_text(tokenizer) -> int | None:
    """The token that ends a text: the tokenizer's EOS, or the <|endoftext|> that joined documents."""
    if getattr(tokenizer, "eos_id", None) is not None:
        return tokenizer.eos_id
    separator = getattr(tokenizer, "separator", [])
    return separator[0] if len(separator) == 1 else None


def _batches(items: list[int], size: int) -> Iterator[list[int]]:
    for start in range(0, len(items), size):
        yield items[start:start + size]
