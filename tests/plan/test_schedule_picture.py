"""The schedule picture tells an interleaved rank's chunks apart by more than a shade: a hatch
pattern and the text picture's lower-case labels, with a legend that names the kinds and the
chunks."""

from __future__ import annotations

import pytest

from scaletrain.plan import timeline

from conftest import run_here

pytest.importorskip("matplotlib")


def bars(ax) -> list:
    """The operations' bars (the legend's patches are not among the axes' patches)."""
    return list(ax.patches)


def test_later_chunks_differ_by_pattern_and_label_not_only_shade():
    first, second = timeline.Op("F", 3, 0), timeline.Op("F", 3, 1)
    a, b = timeline.bar_style(first), timeline.bar_style(second)
    assert a["color"] == b["color"]  # the kind's colour for both
    assert a["hatch"] != b["hatch"] and b["hatch"]  # the second cue: a pattern
    assert (a["label"], b["label"]) == ("F3", "f3")  # as the text picture writes them


def test_interleaved_picture_has_a_legend_of_kinds_and_chunks():
    import matplotlib.pyplot as plt

    placed = timeline.simulate("interleaved-1f1b", 2, 4, 2)
    fig = timeline.figure("interleaved-1f1b", 2, 4, 2, placed)
    try:
        ax = fig.axes[0]
        legend = [t.get_text() for t in ax.get_legend().get_texts()]
        assert legend[:2] == ["F forward", "B backward"]
        assert any(t.startswith("chunk 0") for t in legend) and any(t.startswith("chunk 1") for t in legend)
        ops = [x for row in placed for x in row]
        drawn = bars(ax)
        assert len(drawn) == len(ops)
        # every chunk-1 bar is hatched, every chunk-0 bar is not
        for x, patch in zip(ops, drawn):
            assert bool(patch.get_hatch()) == (x.op.chunk == 1), (x, patch.get_hatch())
        labels = {t.get_text() for t in ax.texts}
        assert "F0" in labels and "f0" in labels
    finally:
        plt.close(fig)


def test_one_chunk_schedule_has_no_chunk_legend():
    import matplotlib.pyplot as plt

    placed = timeline.simulate("1f1b", 2, 4, 1)
    fig = timeline.figure("1f1b", 2, 4, 1, placed)
    try:
        legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
        assert legend == ["F forward", "B backward"]
    finally:
        plt.close(fig)


def test_schedule_png_is_written(tmp_path):
    out = tmp_path / "zb.png"
    r = run_here("schedule", "--pp", "2", "--microbatches", "4", "--schedule", "zero-bubble", "--virtual", "2",
                 "--png", str(out))
    assert r.returncode == 0, r.stderr
    assert out.stat().st_size > 0 and f"wrote {out}" in r.stdout
