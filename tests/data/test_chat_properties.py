"""Properties of chat data's loss masks (data/chat.py) and of the targets each step counts
(data/dataset.py: WindowDataset.counted_in_step, counts_nothing, the targets it leaves out) for
generated conversations and windows: turns of any role and length (empty ones, characters of
several bytes), records shorter and longer than a window, token counts that windows do not
divide, steps whose windows hold nothing to count. Each against a plain walk over the
characters or the tokens."""

from __future__ import annotations

import numpy as np
from hypothesis import example, given
from hypothesis import strategies as st

from scaletrain.data.chat import KNOWN_ROLES, ChatRenderer
from scaletrain.data.dataset import IGNORE_INDEX, TokenData, WindowDataset
from scaletrain.data.loader import StepSampler
from scaletrain.data.tokenizer import ByteTokenizer

# text with characters of 1 to 4 bytes in UTF-8 (no lone surrogates: JSON lines hold none)
TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=12)


@st.composite
def conversations(draw):
    turns = draw(st.lists(st.tuples(st.sampled_from(KNOWN_ROLES), TEXT), min_size=0, max_size=5))
    at = draw(st.integers(0, len(turns)))
    turns.insert(at, ("assistant", draw(TEXT)))  # every record has an assistant turn
    return [{"role": r, "content": c} for r, c in turns]


def mask_by_hand(messages: list[dict], loss_on_prompt: bool) -> tuple[list[int], list[int]]:
    """The plain format walked character by character: "Role: " is never counted, the content and
    its newline are counted in an assistant's turn; each character's bytes take its label; the
    separator after the record (a blank line: two newlines) is not counted."""
    ids, mask = [], []
    for m in messages:
        for part, counted in ((m["role"].capitalize() + ": ", 0), (m["content"] + "\n", int(m["role"] == "assistant"))):
            for ch in part:
                raw = ch.encode("utf-8")
                ids += list(raw)
                mask += [counted] * len(raw)
    ids += [10, 10]
    mask += [0, 0]
    return ids, [1] * len(mask) if loss_on_prompt else mask


@given(conversations(), st.booleans())
@example([{"role": "user", "content": "é"}, {"role": "assistant", "content": ""}], False)  # an empty answer
def test_the_plain_format_counts_exactly_the_assistants_bytes(messages, loss_on_prompt):
    ids, mask = ChatRenderer(ByteTokenizer(), "plain", loss_on_prompt=loss_on_prompt)(messages)
    want_ids, want_mask = mask_by_hand(messages, loss_on_prompt)
    assert ids.tolist() == want_ids
    assert mask.tolist() == want_mask


# ------------------------------------------------------------------------------------------------
# The targets each step counts: records of a prompt (not counted) and an answer (counted), each
# ended by a separator (not counted), cut into windows of any length

SEP = 3  # the token that ends each record (data.document_mask's separator when that is on)


@st.composite
def masked_steps(draw):
    """(tokens, loss mask, seq_len, global batch, separator or None, seed, step)."""
    records = draw(st.lists(st.tuples(st.integers(0, 9), st.sampled_from([0, 0, 1, 2, 7, 15])), min_size=1,
                            max_size=10))
    tokens, mask = [], []
    for prompt, answer in records:
        tokens += [4 + (len(tokens) + i) % 5 for i in range(prompt + answer)] + [SEP]
        mask += [0] * prompt + [1] * answer + [0]
    if len(tokens) < 2:  # one window needs seq_len + 1 tokens
        tokens, mask = tokens + [5], mask + [0]
    seq_len = draw(st.integers(1, len(tokens) - 1))  # shorter and longer than a record
    windows = (len(tokens) - 1) // seq_len
    global_batch = draw(st.integers(1, windows))
    separator = draw(st.sampled_from([None, SEP]))
    return (np.array(tokens, dtype=np.uint16), np.array(mask, dtype=np.uint8), seq_len, global_batch, separator,
            draw(st.integers(0, 1000)), draw(st.integers(0, 6)))


def counted_by_hand(tokens, mask, seq_len: int, windows, separator) -> tuple[int, list[list[bool]]]:
    """Window w's target t is token w * seq_len + t + 1: counted when its mask is 1 and (under
    document masks) its input, the token before it, is not the separator."""
    rows = []
    for w in windows:
        row = []
        for t in range(seq_len):
            p = int(w) * seq_len + t + 1
            row.append(bool(mask[p]) and (separator is None or int(tokens[p - 1]) != separator))
        rows.append(row)
    return sum(map(sum, rows)), rows


@given(masked_steps())
# every window of the step is prompt tokens: nothing is counted, the step trains nothing
@example((np.array([4, 5, 6, 3, 4, 5, 3, 7, 3], np.uint16), np.array([0, 0, 0, 0, 0, 0, 0, 1, 0], np.uint8),
          3, 2, None, 0, 0))
def test_each_step_counts_the_targets_a_walk_over_its_windows_counts(case):
    tokens, mask, seq_len, global_batch, separator, seed, step = case
    data = TokenData.from_array(tokens, ByteTokenizer(), "generated")
    data.mask = TokenData.from_array(mask, ByteTokenizer(), "generated (loss mask)")
    ds = WindowDataset(data, seq_len, loss_mask=True, separator=separator)
    assert len(ds) == (len(tokens) - 1) // seq_len
    sampler = StepSampler(len(ds), global_batch, global_batch, 1, 0, 1, seed)
    windows = sampler.global_batch_indices(step)
    want, rows = counted_by_hand(tokens, mask, seq_len, windows, separator)

    assert ds.counted_in_step(step, lambda s: sampler) == max(1, want)  # at least 1: no division by 0
    assert ds.counts_nothing(step, lambda s: sampler) == (want == 0)
    inputs, targets = ds[windows]
    for row, w in enumerate(windows):
        start = int(w) * seq_len
        assert inputs[row].tolist() == tokens[start:start + seq_len].tolist()
        assert targets[row].tolist() == [int(tokens[start + t + 1]) if rows[row][t] else IGNORE_INDEX
                                         for t in range(seq_len)]
