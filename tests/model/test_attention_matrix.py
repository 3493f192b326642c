"""Every mask kind on every attention path, as one matrix (issue 48, point 3): the kinds (causal,
packed documents, sliding and chunked windows, soft-capped scores) down, the paths across (the plain
one-process kernel, a packed window through the model's own forward, context parallelism's ring,
allgather and Ulysses attention, generation through the KV cache). Each cell is either attention as the
path computes it against attention written as a loop over queries and keys in numpy
(test_attention_properties.attention_by_hand, with the keys each query sees worked out by hand), or a
combination the job refuses in one line, with that line, or one that cannot occur, with the reason.
Shapes divide nothing: 13 positions in one process, 20 over 2 cp ranks (chunks of 5), windows of 3 and 7."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from scaletrain.layout import Layout
from scaletrain.legality import Techniques, job_errors
from scaletrain.model.config import ModelConfig
from scaletrain.model.kv_cache import KVCache
from scaletrain.model.transformer import Attention, Transformer, document_ids, document_mask
from scaletrain.model.window import Window
from test_attention_properties import attention_by_hand

KINDS = ("causal", "document", "sliding", "chunked", "softcap")
PATHS = ("plain", "packed", "cp-ring", "cp-allgather", "cp-ulysses", "cache")
# the model's fields of each kind (a document mask is the model's `separator`, not a field)
FIELDS = {"causal": {}, "document": {}, "sliding": {"sliding_window": 3}, "chunked": {"attn_chunk": 7},
          "softcap": {"attn_softcap": 2.0}}
SEP = 0
# a packed window of 13: documents of 4, 1 (a separator alone), 5 and 3 (the last cut off by the window)
PACKED = [5, 9, 3, SEP, SEP, 7, 7, 2, 4, SEP, 6, 1, 8]
TOL = 2e-5  # fp32 against float64
# what cannot occur, or is refused, and why
REFUSED = {("document", p): "data.document_mask with parallel.cp=2 is not supported: each rank holds chunks of a "
           "window, not the token ids before them" for p in PATHS if p.startswith("cp-")}
REFUSED.update({("softcap", p): "model.attn_softcap=2 change the attention scores, which context parallelism's "
                "attention (parallel.cp > 1) computes unchanged" for p in PATHS if p.startswith("cp-")})
NEVER = {("document", "cache"): "generation extends one sequence: Transformer.forward builds document masks only "
         "without a cache (training and evaluation)"}


def config(kind: str) -> ModelConfig:
    return ModelConfig(vocab_size=11, dim=16, n_layers=1, n_heads=4, n_kv_heads=2, max_seq_len=32, position="rope",
                       **FIELDS[kind])


def window_of(kind: str) -> Window | None:
    return {"sliding": Window(3), "chunked": Window(7, chunked=True)}.get(kind)


def qkv(T: int, seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 4, T, 4, generator=g) * 2  # wide scores: the soft cap bites
    return q, torch.randn(2, 2, T, 4, generator=g) * 2, torch.randn(2, 2, T, 4, generator=g)


def same_document_by_hand(row: list[int]) -> torch.Tensor:
    """(1, 1, T, T): key j is at or before query i and no separator lies in [j, i) (a separator ends its
    own document)."""
    T = len(row)
    return torch.tensor([[[[j <= i and SEP not in row[j:i] for j in range(T)] for i in range(T)]]])


def by_hand(kind: str, q, k, v, mask=None) -> np.ndarray:
    return attention_by_hand(q, k, v, mask, mask is None, 2.0 if kind == "softcap" else 0.0, 0, window_of(kind))


def plain(kind: str) -> float:
    """Attention.attend as Transformer.forward calls it: causal, or the documents' mask of a packed row."""
    attn = Attention(config(kind), window_of(kind))
    q, k, v = qkv(len(PACKED))
    mask = None
    if kind == "document":
        mask = document_mask(document_ids(torch.tensor([PACKED, PACKED]), SEP))
    with torch.no_grad():
        got = attn.attend(q, k, v, mask, mask is None)
    return float(np.abs(got.double().numpy() - by_hand(kind, q, k, v, mask)).max())


def recording(attn: Attention, method: str) -> list:
    """Wrap attn.<method> on the instance: each call's arguments and result, in order."""
    calls, inner = [], getattr(attn, method)

    def wrapped(*args):
        out = inner(*args)
        calls.append((args, out))
        return out
    setattr(attn, method, wrapped)
    return calls


def packed(kind: str) -> float:
    """A packed window through the model's forward (data.document_mask): the documents found from the token
    ids; the kind's mask within each document. The causal kind: a window of one document (no separator)."""
    model = Transformer(config(kind), separator=SEP).eval()
    model.init_buffers("cpu")
    row = [t if t != SEP else 10 for t in PACKED] if kind == "causal" else PACKED
    calls = recording(model.layers["0"].attn, "attend")
    with torch.no_grad():
        model(torch.tensor([row, row[::-1]]))
    (q, k, v, mask, causal), out = calls[0]
    expected = torch.cat([same_document_by_hand(row), same_document_by_hand(row[::-1])])
    assert torch.equal(mask, expected) and not causal
    return float(np.abs(out.double().numpy() - by_hand(kind, q, k, v, expected)).max())


def cache(kind: str) -> float:
    """Generation: a prompt of 4, then 1, 3, 1, 4 positions at a time through the KV cache; every position's
    queries, keys and values (before the cache trims any) against the whole sequence's attention."""
    model = Transformer(config(kind)).eval()
    model.init_buffers("cpu")
    calls = recording(model.layers["0"].attn, "_cached")
    tokens, kv = torch.tensor([PACKED, PACKED[::-1]]), KVCache(max_len=13)
    with torch.no_grad():
        at = 0
        for n in (4, 1, 3, 1, 4):
            model(tokens[:, at:at + n], kv)
            at += n
    q, k, v = (torch.cat([args[i] for args, _ in calls], dim=2) for i in range(3))  # (B, heads, 13, head_dim)
    out = torch.cat([got for _, got in calls], dim=2)
    return float(np.abs(out.double().numpy() - by_hand(kind, q, k, v)).max())


def refusal(kind: str) -> str:
    errors = job_errors(Layout(cp=2), config(kind), Techniques(document_mask=kind == "document"), seq_len=20)
    assert len(errors) == 1, errors
    return errors[0]


@pytest.mark.slow
@pytest.mark.multiproc
def test_every_mask_kind_on_every_attention_path(tmp_path):
    from forked_ranks import run_forked

    out = tmp_path / "cp.json"
    code, err = run_forked("attention_probe:main", [str(out)], 2, timeout=300)
    assert code == 0, err
    on_ranks = json.loads(out.read_text())
    run = {"plain": plain, "packed": packed, "cache": cache}
    table, wrong = {}, []
    for kind in KINDS:
        for path in PATHS:
            cell = (kind, path)
            if cell in NEVER:
                table[cell] = "never"
            elif cell in REFUSED:
                line = refusal(kind)
                table[cell] = "refused"
                if REFUSED[cell] not in line:
                    wrong.append(f"{kind} x {path}: refused as {line!r}")
            else:
                error = run[path](kind) if path in run else on_ranks.pop(f"{kind} x {path}")
                table[cell] = f"{error:.1e}"
                if not error < TOL:
                    wrong.append(f"{kind} x {path}: {error:.2e} from attention by hand")
    assert on_ranks == {}, f"the probe ran cells the matrix does not hold: {sorted(on_ranks)}"
    assert not wrong, "\n".join(wrong) + "\n" + str(table)
