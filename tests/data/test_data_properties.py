"""Properties of the windows (data/dataset.py: TokenData, WindowDataset) for generated data: shards
of any length, window lengths that do not divide the token count, shorter and longer than a
shard, and too long for one window. Against the concatenated tokens sliced by hand."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from scaletrain.data.dataset import TokenData, WindowDataset
from scaletrain.data.tokenizer import ByteTokenizer
from scaletrain.errors import DataError


@given(st.lists(st.integers(1, 9), min_size=1, max_size=5), st.integers(1, 50), st.integers(0, 100))
@example([1], 1, 0)  # one token: not one window
@example([3, 1, 4], 7, 0)  # 8 tokens, one window of 7 across all three shards
def test_windows_are_the_tokens_cut_every_seq_len_across_shards(lengths, seq_len, seed):
    rng = np.random.default_rng(seed)
    shards = [rng.integers(0, 256, n).astype(np.uint16) for n in lengths]
    data = TokenData(shards, np.uint16, lengths, ByteTokenizer(), "generated")
    tokens = np.concatenate(shards)
    n = len(tokens)
    if n < seq_len + 1:  # a window needs its inputs and the target one further
        with pytest.raises(DataError, match=f"{n} tokens are too few for one window of data.seq_len={seq_len}"):
            WindowDataset(data, seq_len)
        return
    ds = WindowDataset(data, seq_len)
    count = 0
    while (count + 1) * seq_len + 1 <= n:  # window i reads tokens i*T .. i*T + T (T + 1 of them)
        count += 1
    assert len(ds) == count
    every = list(range(count))
    inputs, targets = ds[every]
    assert inputs.tolist() == [tokens[i * seq_len:(i + 1) * seq_len].tolist() for i in every]
    assert targets.tolist() == [tokens[i * seq_len + 1:(i + 1) * seq_len + 1].tolist() for i in every]
    assert ds.counted_tokens(every) == count * seq_len and ds.counted_in_step(0, None) is None
    start = int(rng.integers(0, n))
    length = int(rng.integers(0, n - start + 1))
    assert data.read(start, length).tolist() == tokens[start:start + length].tolist()
