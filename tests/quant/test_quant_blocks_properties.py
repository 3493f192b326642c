"""Properties of the quantization blocks (quant/frozen_base.py: QLoRA's int8 rows and NF4 blocks of
64 with their double-quantized scales; quant/ptq.py: int4 packed two to a byte) for generated
shapes: widths whose blocks do not divide the 256 scales of a second-level group, one block a row,
odd widths for int4, rows of zeros and of one outlier. Against the formats written out in numpy:
codes and scales exactly where they are defined exactly, the round-trip error within the bound
that follows from the block's scale where a rounding tie could go either way."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from scaletrain.quant.frozen_base import NF4_BLOCK, FrozenWeight, base_problems, nf4_scaler_block, quantized
from scaletrain.quant.ptq import pack_int4, unpack_int4


@st.composite
def weights(draw, widths):
    """A weight (rows, width) from a seed, with some rows all zero and some one large outlier."""
    rows, width = draw(st.integers(1, 6)), draw(widths)
    w = np.random.default_rng(draw(st.integers(0, 1000))).standard_normal((rows, width)).astype(np.float32)
    for r in range(rows):
        kind = draw(st.sampled_from(["plain", "plain", "zeros", "outlier"]))
        if kind == "zeros":
            w[r] = 0
        elif kind == "outlier":
            w[r, draw(st.integers(0, width - 1))] = 1e4
    return w


@given(weights(st.integers(1, 70)))
@example(np.zeros((1, 1), np.float32))
def test_int8_rows_round_each_value_to_its_rows_absmax_over_127(w):
    q = FrozenWeight.quantize(torch.from_numpy(w), "int8")
    scale = np.maximum(np.abs(w).max(axis=1), np.float32(1e-12)) / np.float32(127)  # one per row, fp32
    codes = np.clip(np.round(w / scale[:, None]), -127, 127)
    assert q.qdata.numpy().tolist() == codes.astype(np.int8).tolist()
    assert q.scale.numpy().tolist() == scale.tolist()
    back = q.dequantize(torch.float32).numpy()
    np.testing.assert_array_equal(back, (codes * scale[:, None]).astype(np.float32))
    assert (np.abs(back - w) <= scale[:, None] / 2 * (1 + 1e-6)).all()  # half a step at most


def scaler_block_by_hand(blocks: int) -> int:
    size = 256
    while blocks % size:
        size //= 2
    return size


@given(st.integers(1, 2000))
def test_nf4_scale_groups_are_the_largest_power_of_two_to_256_dividing_a_rows_blocks(blocks):
    assert nf4_scaler_block(blocks * NF4_BLOCK) == scaler_block_by_hand(blocks)


@given(st.integers(1, 300))
def test_nf4_is_refused_for_widths_that_are_not_whole_blocks(width):
    lin = torch.nn.Linear(width, 2, device="meta")
    problems = base_problems("nf4", [("layers.0.attn.wq", lin)])
    assert bool(problems) == (width % 64 != 0)


LEVELS = np.array([-1.0, -0.6962, -0.5251, -0.3949, -0.2844, -0.1848, -0.0911, 0.0, 0.0796, 0.1609, 0.2461, 0.3379,
                   0.4407, 0.5626, 0.7230, 1.0])  # NormalFloat4 (Dettmers et al. 2023, QLoRA appendix E)


def nf4_by_hand(w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """NF4 with double quantization over a row-major weight, in float64: each block of 64 values
    has its absmax; the absmaxes less their mean over the whole tensor are rounded to int8 in
    groups (the group's largest |absmax - mean| maps to 128, clamped to 127); a value's code is
    the level nearest to it over its block's absmax. Returns each block's absmax, each block's
    dequantized scale, and the error of the nearest level (|value - level x absmax|) per value."""
    rows, width = w.shape
    blocks = w.astype(np.float64).reshape(-1, NF4_BLOCK)
    absmax = np.abs(blocks).max(axis=1)
    mean = absmax.mean()
    group = scaler_block_by_hand(width // NF4_BLOCK)
    centred = (absmax - mean).reshape(-1, group)
    span = np.abs(centred).max(axis=1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        factor = 256 / (2 * span)
        scales = (np.nan_to_num(np.clip(np.round(centred * factor), -128, 127)) / factor).ravel() + mean
        normed = np.where(absmax[:, None] > 0, blocks / absmax[:, None], 0.0)
    nearest = np.abs(normed[..., None] - LEVELS).min(axis=-1) * absmax[:, None]
    return absmax, scales, nearest


@given(weights(st.integers(1, 12).map(lambda blocks: blocks * NF4_BLOCK)))
@example(np.ones((1, 64), np.float32))  # one block: its absmax is the mean, the second level has nothing to scale
def test_nf4_blocks_round_trip_within_their_scales_bound(w):
    rows, width = w.shape
    nf4 = quantized(torch.from_numpy(w), "nf4")
    assert (nf4.block_size, nf4.scaler_block_size) == (NF4_BLOCK, scaler_block_by_hand(width // NF4_BLOCK))
    back = nf4.get_original_weight().double().numpy().reshape(-1, NF4_BLOCK)
    absmax, scales, nearest = nf4_by_hand(w)
    # the block's scale: its absmax through int8, off by at most its group's span / 128 (a clamped 128)
    span = np.abs(absmax - absmax.mean()).reshape(-1, scaler_block_by_hand(width // NF4_BLOCK)).max(axis=1)
    scale_err = np.repeat(span, scaler_block_by_hand(width // NF4_BLOCK)) / 128
    assert (np.abs(scales - absmax) <= scale_err * (1 + 1e-5) + 1e-6 * absmax.max()).all()
    # each value: a NormalFloat level times its block's dequantized scale (to fp32's rounding of the
    # scales, which add the mean of every absmax: relative to the largest) ...
    off = np.abs(back[..., None] - LEVELS * scales[:, None, None]).min(axis=-1)
    assert (off <= 1e-5 * absmax.max()).all(), off.max() / absmax.max()
    # ... and within the nearest level's error plus the scale's
    bound = nearest + scale_err[:, None] + 1e-5 * absmax.max()
    assert (np.abs(back - w.astype(np.float64).reshape(-1, NF4_BLOCK)) <= bound).all()


@given(st.integers(1, 5), st.integers(1, 41), st.integers(0, 1000))
def test_int4_packs_column_2i_low_and_2i_plus_1_high_offset_by_8(rows, cols, seed):
    q = np.random.default_rng(seed).integers(-8, 8, (rows, cols)).astype(np.int8)
    v = q.astype(int) + 8  # the stored nibbles: 0 .. 15
    packed = pack_int4(torch.from_numpy(q))
    want = [[int(v[r, 2 * i]) | (int(v[r, 2 * i + 1]) if 2 * i + 1 < cols else 8) << 4 for i in range((cols + 1) // 2)]
            for r in range(rows)]  # an odd width's last byte: its high half the code of 0
    assert packed.dtype == torch.uint8 and packed.tolist() == want
    assert unpack_int4(packed, cols).tolist() == q.tolist()
