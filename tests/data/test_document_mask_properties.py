"""Properties of packed documents (data.document_mask) for generated windows: documents of length 1
(a separator after a separator), a separator first or last in the window, a window of one document
or of separators alone. The model's documents, positions and attention mask
(model/transformer.py: document_ids, document_positions, document_mask) against a loop over the
tokens; a packed window's logits against each document run alone; the dataset's targets
(data/dataset.py: the one after a separator is not counted) against a walk over the windows."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from scaletrain.data.dataset import IGNORE_INDEX, TokenData, WindowDataset
from scaletrain.data.loader import StepSampler
from scaletrain.data.tokenizer import ByteTokenizer
from scaletrain.model.config import ModelConfig
from scaletrain.model.transformer import Transformer, document_ids, document_mask, document_positions

SEP = 0
# token rows of 1 to 12 positions over a vocabulary of 5 where the separator is frequent
ROWS = st.integers(1, 12).flatmap(lambda T: st.lists(st.lists(st.sampled_from([SEP, SEP, 1, 2, 3, 4]), min_size=T,
                                                                 max_size=T), min_size=1, max_size=3))


def documents_by_hand(row: list[int]) -> tuple[list[int], list[int]]:
    """Each position's document (a separator belongs to the document it ends) and its place in it."""
    docs, places, doc, place = [], [], 0, 0
    for token in row:
        docs.append(doc)
        places.append(place)
        place += 1
        if token == SEP:  # the next token starts a new document
            doc, place = doc + 1, 0
    return docs, places


@given(ROWS)
@example([[SEP]])  # a window of one separator
@example([[SEP, SEP, 1, SEP], [1, 2, 3, 4]])  # documents of length 1; a window of one document
def test_documents_positions_and_mask_follow_the_separators(rows):
    tokens = torch.tensor(rows)
    T = tokens.shape[1]
    docs, positions, mask = document_ids(tokens, SEP), document_positions(document_ids(tokens, SEP)), \
        document_mask(document_ids(tokens, SEP))
    assert mask.shape == (len(rows), 1, T, T)
    for b, row in enumerate(rows):
        want_docs, want_places = documents_by_hand(row)
        assert docs[b].tolist() == want_docs
        assert positions[b].tolist() == want_places
        for i in range(T):  # query i sees key j: j not after i, both in one document
            assert mask[b, 0, i].tolist() == [j <= i and want_docs[j] == want_docs[i] for j in range(T)]


def split_documents(row: list[int]) -> list[list[int]]:
    out = [[]]
    for token in row:
        out[-1].append(token)
        if token == SEP:
            out.append([])
    return [d for d in out if d]


@given(ROWS, st.sampled_from(["learned", "rope"]), st.integers(0, 100))
@example([[SEP, 1, SEP, SEP, 2, 3]], "rope", 0)
def test_a_packed_window_gives_each_document_the_logits_it_has_alone(rows, position, seed):
    """The mask and the restarting positions together: each document's logits in the packed window
    are those of the document given to the model alone (a lone document ends at most with its
    separator, which then masks nothing)."""
    cfg = ModelConfig(vocab_size=5, dim=16, n_layers=2, n_heads=2, max_seq_len=12, position=position)
    torch.manual_seed(seed)
    model = Transformer(cfg, separator=SEP).eval()
    model.init_buffers("cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.5)
        packed = model(torch.tensor(rows))
        for b, row in enumerate(rows):
            at = 0
            for doc in split_documents(row):
                alone = model(torch.tensor([doc]))[0]
                torch.testing.assert_close(packed[b, at:at + len(doc)], alone, rtol=1e-5, atol=1e-5)
                at += len(doc)


@st.composite
def packed_data(draw):
    """Documents of 1 to 6 tokens (a separator last in each), a window length shorter and longer
    than a document, a global batch and a step."""
    lengths = draw(st.lists(st.integers(1, 6), min_size=1, max_size=12))
    tokens = []
    for n in lengths:
        tokens += [1 + (len(tokens) + i) % 4 for i in range(n - 1)] + [SEP]
    tokens += [1]  # one more token: the last separator has a target
    seq_len = draw(st.integers(1, len(tokens) - 1))
    global_batch = draw(st.integers(1, (len(tokens) - 1) // seq_len))
    return np.array(tokens, np.uint16), seq_len, global_batch, draw(st.integers(0, 100)), draw(st.integers(0, 4))


@given(packed_data())
@example((np.array([SEP, SEP, 1, SEP, 1], np.uint16), 2, 2, 0, 0))  # separators at a window's start and end
def test_the_target_after_a_separator_is_not_counted(case):
    tokens, seq_len, global_batch, seed, step = case
    ds = WindowDataset(TokenData.from_array(tokens, ByteTokenizer(), "generated"), seq_len, separator=SEP)
    sampler = StepSampler(len(ds), global_batch, global_batch, 1, 0, 1, seed)
    windows = sampler.global_batch_indices(step)
    inputs, targets = ds[windows]
    want, counted = [], 0
    for w in windows:  # window w: inputs tokens[w*T : w*T + T], targets one further
        start = int(w) * seq_len
        row = [IGNORE_INDEX if tokens[start + t] == SEP else int(tokens[start + t + 1]) for t in range(seq_len)]
        counted += sum(v != IGNORE_INDEX for v in row)
        want.append(row)
    assert targets.tolist() == want
    assert inputs.tolist() == [tokens[int(w) * seq_len:int(w) * seq_len + seq_len].tolist() for w in windows]
    assert ds.counted_in_step(step, lambda s: sampler) == max(1, counted)
    assert ds.counts_nothing(step, lambda s: sampler) == (counted == 0)
