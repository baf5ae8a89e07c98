"""The math reward on the answer forms of DeepScaleR / GSM8K, and reward plugins."""

import sys
import textwrap

import pytest

from pat_operator.api import Reward
from pat_workers.trainer.rewards import extract_answer, load_reward, math_reward, overlong_penalty

CASES = [
    # (response, reference answer, reward)
    ("so the answer is \\boxed{42}.", "42", 1.0),
    ("\\boxed{1} no wait, \\boxed{2}", "2", 1.0),  # the last box counts
    ("\\boxed{2} then \\boxed{1}", "2", 0.0),
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}", 1.0),  # nested braces
    ("\\boxed{\\frac{2}{4}}", "0.5", 1.0),  # fractions compare as values
    ("\\boxed{-\\frac{1}{2}}", "-1/2", 1.0),
    ("\\boxed{\\dfrac{3}{4}}", "\\frac{3}{4}", 1.0),
    ("\\boxed{1/3}", "0.33", 0.0),
    ("\\boxed{1,000}", "1000", 1.0),  # thousands separators
    ("\\boxed{$12.50$}", "12.5", 1.0),  # $, trailing zeros after the point
    ("\\boxed{3.0}", "3", 1.0),
    ("\\boxed{+007}", "7", 1.0),  # plus sign, leading zeros
    ("\\boxed{ 1 2 }", "12", 1.0),  # spaces
    ("The total is 72 dollars.\n#### 72.", "72", 1.0),  # GSM8K marker, trailing period
    ("#### 1,234\nextra line", "Natalia sold 1234 clips.\n#### 1,234", 1.0),  # the reference is a GSM8K solution
    ("#### 5 \\boxed{6}", "6", 1.0),  # whichever answer comes last
    ("3+4= #### 7 3+1=", "7", 1.0),  # a number after #### is the answer, whatever follows it
    ("#### 17+", "7", 0.0),  # ... but only a number right after it
    ("#### seven", "seven", 1.0),  # no number: the rest of the line
    ("\\boxed{6} #### 5", "6", 0.0),
    ("\\boxed{1,2}", "1,2", 1.0),  # not a number: compared as text
    ("\\boxed{(1, 2)}", "(1,2)", 1.0),
    ("\\boxed{\\sqrt{3}}", "\\sqrt{3}", 1.0),
    ("\\boxed{\\sqrt{2}}", "\\sqrt{3}", 0.0),
    ("\\boxed{\\pi}", "\\frac{1}{2}", 0.0),
    ("the answer is 42", "42", 0.0),  # no final answer given
    ("\\boxed{42", "42", 0.0),  # unclosed
]


@pytest.mark.parametrize("response,answer,expected", CASES)
def test_math_reward(response, answer, expected):
    assert math_reward(response, answer) == expected


def test_format_score_rewards_a_wrong_but_extracted_answer_only():
    assert math_reward("\\boxed{5}", "6", format_score=0.1) == 0.1
    assert math_reward("5", "6", format_score=0.1) == 0.0
    assert math_reward("\\boxed{6}", "6", format_score=0.1) == 1.0


def test_extract_answer():
    assert extract_answer("a \\boxed{x^{2}+\\frac{1}{2}} b") == "x^{2}+\\frac{1}{2}"
    assert extract_answer("#### 3\n4") == "3"
    assert extract_answer("nothing") is None


def test_load_reward_math_uses_the_format_score():
    reward = load_reward(Reward(function="math", format_score=0.25))
    assert reward("\\boxed{1}", "2") == 0.25 and reward("\\boxed{2}", "2") == 1.0


@pytest.fixture
def plugin_dir(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(textwrap.dedent("""
        import json
        LIMIT = 3
        def length_penalty(response, answer):
            return -len(response)
    """))
    (tmp_path / "broken_rewards.py").write_text("import not_installed_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in ("my_rewards", "broken_rewards"):
        sys.modules.pop(name, None)


def test_load_reward_plugin(plugin_dir):
    assert load_reward(Reward(function="my_rewards:length_penalty"))("abc", "") == -3


@pytest.mark.parametrize("function,message", [
    ("no_such_module:f", "no module 'no_such_module'; install it or put its directory on PYTHONPATH"),
    ("broken_rewards:f", "imports 'not_installed_dependency', which is not installed"),
    ("my_rewards:missing", "has no 'missing'; define missing"),
    ("my_rewards:LIMIT", "my_rewards.LIMIT is not callable (type int)"),
])
def test_load_reward_plugin_errors_name_the_field_and_fix(plugin_dir, function, message):
    with pytest.raises(ValueError, match="reward.function=") as e:
        load_reward(Reward(function=function))
    assert message in str(e.value)


@pytest.mark.parametrize("length, expected", [(0, 0.0), (32, 0.0), (36, -0.25), (40, -0.5), (48, -1.0), (60, -1.0)])
def test_overlong_penalty_by_hand(length, expected):
    # max 48 tokens, buffer 16: free up to 32, then -1/16 per token
    assert overlong_penalty(length, 48, 16) == pytest.approx(expected)
    assert overlong_penalty(length, 48, 0) == 0.0  # off
