"""The config.json readers' rules by hand, one family's keys at a time: what each key left out means,
what each refused value is refused with (the key named), and the edge values (a window of 1, a
yarn parameter of 0, a bool where an integer goes). The readers' results against transformers' own
models are tests/model/families/test_fields_off_defaults.py's and test_hf*.py's."""

from __future__ import annotations

import pytest

from scaletrain.model.families import FAMILIES, Reader
from scaletrain.model.families._common import YARN_KEYS, _yarn_fields, every_layer_window


class Refusals(list):
    def __call__(self, key: str, why: str) -> None:
        self.append((key, why))


def test_yarns_keys_left_out_take_transformers_defaults_and_the_models_length():
    refuse = Refusals()
    out = _yarn_fields({}, refuse, "rope_parameters", 4096)
    assert refuse == [] and out == {"rope_original_max_seq_len": 4096, "rope_truncate": True,
                                    **{ours: default for ours, default in YARN_KEYS.values()}}
    # 0 is a number (not refused) and, as transformers reads it (`get("beta_fast") or 32`), the default
    out = _yarn_fields({"beta_fast": 0, "mscale": 0.5, "original_max_position_embeddings": 2048, "truncate": False},
                       refuse, "rope_parameters", 4096)
    assert refuse == [] and (out["rope_beta_fast"], out["rope_mscale"]) == (32.0, 0.5)
    assert (out["rope_original_max_seq_len"], out["rope_truncate"]) == (2048, False)


@pytest.mark.parametrize("params,why", [
    ({"truncate": "no"}, "needs true or false for truncate in rope_type yarn"),
    ({"beta_fast": -1.0}, "needs a non-negative number beta_fast for rope_type yarn"),
    ({"beta_slow": True}, "needs a non-negative number beta_slow for rope_type yarn"),
    ({"mscale": "1"}, "needs a non-negative number mscale for rope_type yarn"),
])
def test_a_bad_yarn_value_is_refused_under_its_key(params, why):
    refuse = Refusals()
    _yarn_fields(params, refuse, "rope_scaling", 4096)
    assert refuse == [("rope_scaling", why)]


@pytest.mark.parametrize("window,expected", [(None, 0), (0, 0), (-4, 0), (True, 0), ("64", 0), (1, 1), (4096, 4096)])
def test_a_window_is_a_positive_integer_or_none(window, expected):
    assert every_layer_window(Reader({"sliding_window": window}, {}, "config.json")) == expected


@pytest.mark.parametrize("config,expected", [
    ({"sliding_window": 64, "use_sliding_window": False}, 0),  # a window that is not used
    ({"sliding_window": 64, "use_sliding_window": True}, 64),  # no layer_types, no max_window_layers: every layer
    ({"sliding_window": 64, "use_sliding_window": True, "max_window_layers": "all"}, 64),  # not an integer: from 0
    ({"sliding_window": 64, "use_sliding_window": True, "max_window_layers": 4}, 0),  # from layer 4 of 4: none
    ({"sliding_window": 64, "use_sliding_window": True, "layer_types": ["sliding_attention"] * 4}, 64),
])
def test_qwen2s_window_needs_use_sliding_window_and_every_layer(config, expected):
    refuse = Refusals()
    assert FAMILIES["qwen2"].window(Reader(config, {}, "config.json"), 4, refuse) == expected
    assert refuse == []


def test_qwen2s_window_on_some_layers_is_refused_under_the_key_that_says_so():
    refuse = Refusals()
    FAMILIES["qwen2"].window(Reader({"sliding_window": 64, "use_sliding_window": True, "max_window_layers": 1},
                                      {}, "config.json"), 4, refuse)
    assert refuse == [("max_window_layers", "slides 3 of the 4 layers; scaletrain slides every layer or none (train "
                                            "it with use_sliding_window=false, or its window on every layer)")]
