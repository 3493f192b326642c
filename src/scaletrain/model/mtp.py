"""Multi-token prediction (DeepSeek-V3 technical report, section 2.2; model.mtp_depth, model.mtp_loss_weight).

Besides the next token, D extra modules predict the tokens 2 .. D + 1 ahead, one after the other, each
keeping the causal chain: depth k at position i takes the previous depth's hidden state there (the main
model's last block output for k = 1, before its final norm) and the embedding of token t_{i+k}, and

    h_i^k = Block_k( M_k [ RMSNorm(Emb(t_{i+k})) ; RMSNorm(h_i^{k-1}) ] )      (M_k: eh_proj, 2 dim -> dim)
    P_i^k = OutHead( RMSNorm_k(h_i^k) )                                        predicts t_{i+k+1}

with the model's own embedding and output head (shared, not copies). The report writes the concatenation
with the hidden state first; DeepSeek's released checkpoints (and every engine that loads them) put the
embedding first, and so do we, so that eh_proj's columns are the checkpoint's.

Loss: L = L_main + (lambda / D) * sum_k L_k, where L_k sums the cross-entropy of depth k over the positions
that have a target and divides by the same count as the main loss (the report's 1/T), so accumulation and
data parallelism treat both alike (model/loss.py). Depth k at position i counts when the main head's
targets at i .. i + k all count: positions too near the window's end have none, and a chain that
crosses a document's end (data.document_mask: the target of each separator is not counted) or a
masked target (a loss mask) is left out.

In training (`Transformer.forward` in train mode, no cache) the model's output holds the main logits
followed by each depth's, concatenated along the sequence: (B, (1 + D) T, vocab), depth k's last k
positions filled but never counted; `mtp_loss` splits them. Evaluation and generation (eval mode, or a
cache) compute the main head alone: MTP is a training signal, ignored at inference.

Costs per depth: one block, eh_proj (2 dim^2) and the head's matmul again (forward and backward), the
head's logits again in memory.
"""

from __future__ import annotations

import torch
from torch import nn

from scaletrain.model.loss import cross_entropy_sum

IGNORE = -100  # a target the loss does not count (cross_entropy's ignore_index; data.dataset.IGNORE_INDEX)


class MTPDepth(nn.Module):
    """One depth of multi-token prediction: its two norms, its projection, its block and the norm
    before the shared head. `block` and `norm` come from the caller (model/transformer.py), so that
    this module needs nothing of the transformer's."""

    def __init__(self, dim: int, block: nn.Module, norm):
        """`norm()`: a new normalisation layer of the model's kind (model.norm)."""
        super().__init__()
        self.enorm = norm()  # of the embedding of the token k ahead
        self.hnorm = norm()  # of the previous depth's hidden state
        self.eh_proj = nn.Linear(2 * dim, dim, bias=False)  # M_k: [embedding; hidden] -> dim
        self.block = block
        self.head_norm = norm()  # before the shared output head (the checkpoint's shared_head.norm)

    def forward(self, h: torch.Tensor, ahead: torch.Tensor, rope, mask: torch.Tensor | None = None) -> torch.Tensor:
        """h (B, T, dim): the previous depth's hidden states; ahead (B, T, dim): the embeddings of the
        tokens k ahead of each position -> this depth's hidden states (B, T, dim), before head_norm."""
        x = self.eh_proj(torch.cat([self.enorm(ahead), self.hnorm(h)], dim=-1))
        return self.block(x, rope) if mask is None else self.block(x, rope, mask=mask)


def tokens_ahead(tokens: torch.Tensor, k: int) -> torch.Tensor:
    """(B, T) -> (B, T): the token k positions later at each position; the last k positions (which have
    none in the window) repeat the last token (their predictions are never counted)."""
    return torch.cat([tokens[:, k:], tokens[:, -1:].expand(-1, k)], dim=1)


def depth_targets(targets: torch.Tensor, k: int) -> torch.Tensor:
    """(B, T) the targets of depth k: targets[i + k] where the main targets i .. i + k all count,
    IGNORE elsewhere (no token that far ahead, a document's end or a masked target in between)."""
    T = targets.shape[1]
    out = torch.full_like(targets, IGNORE)
    if k >= T:
        return out
    counted = targets != IGNORE
    chain = counted[:, :T - k].clone()
    for j in range(1, k + 1):  # every target on the way counts
        chain &= counted[:, j:T - k + j]
    out[:, :T - k] = torch.where(chain, targets[:, k:], IGNORE)
    return out


def split_logits(logits: torch.Tensor, depth: int) -> list[torch.Tensor]:
    """The training output (B, (1 + depth) T, vocab) as [main, depth 1, ..., depth D], each (B, T, vocab)."""
    T = logits.shape[1] // (1 + depth)
    return [logits[:, i * T:(i + 1) * T] for i in range(1 + depth)]


class MTPLoss:
    """The training loss with multi-token prediction: sum of the main token losses plus lambda / D times
    each depth's, a sum as `cross_entropy_sum` is (the trainer divides by the step's counted tokens).
    Each depth's summed loss and counted positions (detached) are kept until `take()`: the metrics'."""

    def __init__(self, depth: int, weight: float):
        self.depth, self.weight = depth, weight
        self.sums: torch.Tensor | None = None  # (depth,) summed losses; (depth,) counted positions beside
        self.counts: torch.Tensor | None = None

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if logits.shape[1] == targets.shape[1]:  # the main head alone (evaluation mode)
            return cross_entropy_sum(logits, targets)
        main, *depths = split_logits(logits, self.depth)
        total = cross_entropy_sum(main, targets)
        ahead = [depth_targets(targets, k) for k in range(1, self.depth + 1)]
        per_depth = [cross_entropy_sum(d, t) for d, t in zip(depths, ahead, strict=True)]
        self._keep(torch.stack([_plain(x).detach().float() for x in per_depth]),
                   torch.stack([(t != IGNORE).sum() for t in ahead]).float())
        return total + self.weight / self.depth * sum(per_depth)

    def _keep(self, sums: torch.Tensor, counts: torch.Tensor) -> None:
        if self.sums is None:
            self.sums, self.counts = sums, counts
        else:
            self.sums, self.counts = self.sums + sums, self.counts + counts

    def take(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(each depth's summed loss, its counted positions) since the last call, on the loss's device;
        None if no loss was computed since. Starts again from zero."""
        if self.sums is None:
            return None
        out, self.sums, self.counts = (self.sums, self.counts), None, None
        return out


def _plain(x: torch.Tensor) -> torch.Tensor:
    """A loss computed on vocabulary shards (tensor parallel: a DTensor) as a plain tensor."""
    return x.full_tensor() if hasattr(x, "full_tensor") else x
