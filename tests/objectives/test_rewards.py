"""Rewards for RL (issue 50, scaletrain.objectives.rewards): loading `module:function`, weights, the
built-in verifiable rewards by hand (and the overlong penalty against TRL's), and each bad input as one
ConfigError line naming the reward (and the row)."""

from __future__ import annotations

import textwrap

import pytest
import torch

from scaletrain.errors import ConfigError
from scaletrain.objectives.rewards import (
    check_fields,
    last_boxed,
    last_number,
    load_reward,
    score,
)

BUILTIN = "scaletrain.objectives.rewards"

USER_MODULE = """
import math

def length(prompts, completions, **_):
    return [len(c) for c in completions]

def echoes_prompt(prompts, completions, **_):
    return [1.0 if c.startswith(p) else 0.0 for p, c in zip(prompts, completions)]

def needs_label(prompts, completions, label, **_):
    return [float(c == l) for c, l in zip(completions, label)]

def strict(prompts, completions):
    return [0.0 for c in completions]

def one_short(prompts, completions, **_):
    return [0.0] * (len(completions) - 1)

def nan_on_empty(prompts, completions, **_):
    return [math.nan if not c else 1.0 for c in completions]

def a_string(prompts, completions, **_):
    return ["1" for c in completions]

def raises_on_x(prompts, completions, **_):
    return [1 / 0 if c == "x" else 0.0 for c in completions]
"""


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(textwrap.dedent(USER_MODULE))
    (tmp_path / "broken_rewards.py").write_text("import not_a_module_anywhere\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return "my_rewards"


def one_line(excinfo) -> str:
    assert len(excinfo.value.lines) == 1 and excinfo.value.exit_code == 2
    return excinfo.value.lines[0]


# ------------------------------------------------------------------------------------------
# Extractors and built-ins, by hand


@pytest.mark.parametrize("text, want", [
    ("so \\boxed{12}", "12"),
    ("first \\boxed{1}, then \\boxed{\\frac{3}{4}} done", "\\frac{3}{4}"),  # the last, braces balanced
    ("\\boxed{ 7 }.", "7"),
    ("no box here: 5", None),
    ("\\boxed{unclosed", None),
])
def test_last_boxed(text, want):
    assert last_boxed(text) == want


@pytest.mark.parametrize("text, want", [
    ("2 + 3 = 5", "5"), ("total: 1,024 bytes", "1024"), ("it is -3.5.", "-3.5"), ("none", None),
    ("x1 then 42 then 7 apples", "7"),
])
def test_last_number(text, want):
    assert last_number(text) == want


def test_answer_match_boxed_and_last_number():
    completions = ["so \\boxed{12}", "so \\boxed{12.0}", "\\boxed{13}", "it is 12", "\\boxed{x+1}"]
    answers = ["12", "12", "12", "12", "x+1"]
    boxed = load_reward(f"{BUILTIN}:answer_match")
    assert score([boxed], [""] * 5, completions, {"answer": answers}).total.tolist() == [1, 1, 0, 0, 1]
    number = load_reward(f"{BUILTIN}:answer_match", args={"extractor": "last_number"})
    assert score([number], [""] * 5, completions, {"answer": answers}).total.tolist() == [1, 1, 0, 1, 0]


def test_format_match_holds_the_whole_completion():
    fmt = load_reward(f"{BUILTIN}:format_match", args={"pattern": r"<think>.*?</think>\s*<answer>.*?</answer>"})
    completions = ["<think>a\nb</think> <answer>3</answer>", "<answer>3</answer>",
                   "<think>a</think><answer>3</answer> and more"]
    assert score([fmt], [""] * 3, completions).total.tolist() == [1.0, 0.0, 0.0]


def test_overlong_penalty_by_hand_and_against_trl():
    pen = load_reward(f"{BUILTIN}:overlong_penalty", args={"max_length": 8, "cache": 4})
    ids = [[1] * n for n in (3, 4, 5, 7, 8, 9)]
    got = score([pen], [""] * 6, ["c"] * 6, {"completion_ids": ids}).total.tolist()
    assert got == pytest.approx([0, 0, -0.25, -0.75, -1, -1])
    trl_rewards = pytest.importorskip("trl.rewards")
    assert got == pytest.approx(trl_rewards.get_soft_overlong_punishment(8, 4)(ids))


def test_weighted_rewards_add_up_and_each_is_kept(user_module):
    rewards = [load_reward(f"{user_module}:length", weight=0.5), load_reward(f"{user_module}:echoes_prompt", 2.0)]
    s = score(rewards, ["ab", "ab", "zz"], ["abc", "x", "zz!!"])
    assert s.each["my_rewards:length"].tolist() == [3, 1, 4]
    assert s.each["my_rewards:echoes_prompt"].tolist() == [1, 0, 1]
    assert torch.equal(s.total, torch.tensor([1.5 + 2, 0.5, 2 + 2]))


def test_fields_reach_the_reward_row_aligned(user_module):
    r = load_reward(f"{user_module}:needs_label")
    assert score([r], ["p", "q"], ["a", "b"], {"label": ["a", "c"], "other": [0, 0]}).total.tolist() == [1, 0]


# ------------------------------------------------------------------------------------------
# Bad input: one line each, naming the reward


def test_a_name_without_a_colon(user_module):
    with pytest.raises(ConfigError) as e:
        load_reward("my_rewards.length")
    assert one_line(e) == ("rl.rewards: 'my_rewards.length' is not module:function "
                           "(e.g. scaletrain.objectives.rewards:answer_match)")


def test_a_module_that_does_not_import(user_module):
    with pytest.raises(ConfigError) as e:
        load_reward("no_such_rewards:f")
    assert one_line(e).startswith("rl.rewards: reward module 'no_such_rewards' does not import "
                                  "(ModuleNotFoundError: No module named 'no_such_rewards')")
    with pytest.raises(ConfigError) as e:
        load_reward("broken_rewards:f")
    assert "reward module 'broken_rewards' does not import (ModuleNotFoundError: No module named " \
           "'not_a_module_anywhere')" in one_line(e)


def test_a_missing_function_lists_those_there_are(user_module):
    with pytest.raises(ConfigError) as e:
        load_reward("my_rewards:lenght")
    assert one_line(e).startswith("rl.rewards: module 'my_rewards' has no function 'lenght'; it defines: "
                                  "a_string, echoes_prompt, length,")


def test_arguments_the_function_does_not_take(user_module):
    with pytest.raises(ConfigError) as e:
        load_reward("my_rewards:strict", args={"cap": 3})
    assert one_line(e).startswith("rl.rewards: my_rewards:strict does not take the arguments ['cap'] (")
    with pytest.raises(ConfigError) as e:
        load_reward(f"{BUILTIN}:answer_match", args={"extractor": "first_number"})
    assert one_line(e) == (f"rl.rewards: {BUILTIN}:answer_match: unknown extractor 'first_number'; "
                           "one of ('boxed', 'last_number', 'first_line')")
    with pytest.raises(ConfigError) as e:
        load_reward(f"{BUILTIN}:format_match")
    assert one_line(e) == f"rl.rewards: {BUILTIN}:format_match needs the argument(s) pattern; set them in its args"
    with pytest.raises(ConfigError, match=r"format_match: .*unterminated character set"):
        load_reward(f"{BUILTIN}:format_match", args={"pattern": "[a-"})


def test_a_field_the_data_lacks(user_module):
    r = load_reward(f"{user_module}:needs_label")
    with pytest.raises(ConfigError) as e:
        check_fields([r], ["prompt", "answer"])
    assert one_line(e) == ("rl.rewards: my_rewards:needs_label needs the field(s) label, which the prompt "
                           "dataset lacks (it has: answer, prompt)")
    check_fields([r, load_reward(f"{BUILTIN}:overlong_penalty", args={"max_length": 4, "cache": 1})], ["label"])


@pytest.mark.parametrize("name, completions, line", [
    ("one_short", ["a", "b", "c"], "rl.rewards: reward my_rewards:one_short returned 2 values for 3 completions; "
                                    "return one float per completion"),
    ("nan_on_empty", ["a", "", "c"], "rl.rewards: reward my_rewards:nan_on_empty returned nan for row 1; "
                                      "a reward is a finite number"),
    ("a_string", ["a"], "rl.rewards: reward my_rewards:a_string returned '1' for row 0; a reward is a finite number"),
    ("raises_on_x", ["a", "b", "x", "x"], "rl.rewards: reward my_rewards:raises_on_x raised on row 2: "
                                          "ZeroDivisionError: division by zero"),
])
def test_a_bad_reward_names_itself_and_the_row(user_module, name, completions, line):
    r = load_reward(f"{user_module}:{name}")
    with pytest.raises(ConfigError) as e:
        score([r], [""] * len(completions), completions)
    assert one_line(e) == line


def test_fields_not_row_aligned_are_our_bug_not_the_users(user_module):
    with pytest.raises(ValueError, match="label has 1 rows for 2 completions"):
        score([load_reward(f"{user_module}:needs_label")], ["p", "q"], ["a", "b"], {"label": ["a"]})


def test_the_first_line_extractor_takes_the_answer_written_alone_on_its_line():
    from scaletrain.objectives.rewards import answer_match, first_line

    assert first_line("  cba \nmore") == "cba" and first_line("\n") is None
    assert answer_match([], ["cba\n", "cbaa", "\ncba"], ["cba"] * 3, extractor="first_line") == [1.0, 0.0, 0.0]
