"""The math reward (math-verify) on the answer forms of DeepScaleR / GSM8K, reward plugins, the Grader that bounds
and guards every reward call, and `pat reward`."""

import logging
import signal
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from pat_operator.api import Reward
from pat_workers.cli import main as pat
from pat_workers.trainer.rewards import final_answer, load_reward, math_reward, overlong_penalty

LOCAL_JOB = Path(__file__).parents[2] / "examples" / "local.yaml"

CASES = [
    # (response, reference answer, reward)
    ("so the answer is \\boxed{42}.", "42", 1.0),
    # math-verify reads every \boxed{} of a response as one answer, the set of them (multi-part answers), so a
    # corrected answer is no longer the last box alone
    ("\\boxed{1} no wait, \\boxed{2}", "2", 0.0),
    ("\\boxed{1} and \\boxed{2}", "1,2", 1.0),
    ("\\boxed{2} then \\boxed{1}", "2", 0.0),
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}", 1.0),  # nested braces
    ("\\boxed{\\frac{2}{4}}", "0.5", 1.0),  # fractions compare as values
    ("\\boxed{-\\frac{1}{2}}", "-1/2", 1.0),
    ("\\boxed{\\dfrac{3}{4}}", "\\frac{3}{4}", 1.0),
    ("\\boxed{1/3}", "0.33", 0.0),
    ("\\boxed{0.3333333}", "1/3", 1.0),  # math-verify compares numbers to 6 decimal places
    ("\\boxed{1,000}", "1000", 1.0),  # thousands separators
    ("\\boxed{$12.50$}", "12.5", 1.0),  # $, trailing zeros after the point
    ("\\boxed{3.0}", "3", 1.0),
    ("\\boxed{+007}", "7", 1.0),  # plus sign, leading zeros
    ("\\boxed{ 12 }", "12", 1.0),  # spaces
    ("\\boxed{1 2}", "12", 0.0),  # math-verify reads adjacent numbers as a mixed number (1 2 = 1 + 2, as 1 \frac12)
    ("The total is 72 dollars.\n#### 72.", "72", 1.0),  # GSM8K marker, trailing period
    ("#### 1,234\nextra line", "Natalia sold 1234 clips.\n#### 1,234", 1.0),  # the reference is a GSM8K solution
    ("#### 0.5", "so it is \\boxed{\\frac{1}{2}}", 1.0),  # ... or a MATH solution
    ("#### $1,234", "1234", 1.0),
    ("#### 5 \\boxed{6}", "6", 1.0),  # whichever answer comes last
    ("3+4= #### 7 3+1=", "7", 1.0),  # a number after #### is the answer, whatever follows it
    ("#### 17+", "7", 0.0),  # ... but only a number right after it
    ("#### seven", "seven", 1.0),  # no number: the rest of the line
    ("\\boxed{6} #### 5", "6", 0.0),
    ("\\boxed{1,2}", "1,2", 1.0),
    ("\\boxed{(1, 2)}", "(1,2)", 1.0),
    ("\\boxed{\\sqrt{3}}", "\\sqrt{3}", 1.0),
    ("\\boxed{\\sqrt{2}}", "\\sqrt{3}", 0.0),
    ("\\boxed{\\pi}", "\\frac{1}{2}", 0.0),
    ("the answer is 42", "42", 0.0),  # no final answer given (no \boxed{}, no ####)
    ("\\boxed{42", "42", 0.0),  # unclosed
    # what math-verify gets right that the regular expressions did not: forms of one value, intervals, sets, algebra
    ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\sqrt{3}/2", 1.0),
    ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}", 1.0),
    ("\\boxed{50\\%}", "0.5", 1.0),
    ("\\boxed{(1,2]}", "(1, 2]", 1.0),
    ("\\boxed{x \\in (1,2]}", "(1, 2]", 1.0),
    ("\\boxed{[1,2)}", "(1, 2]", 0.0),
    ("\\boxed{\\{2, 1\\}}", "\\{1,2\\}", 1.0),
    ("\\boxed{x^2+2x+1}", "(x+1)^2", 1.0),
    ("\\boxed{x = 2}", "2", 1.0),
]


@pytest.mark.parametrize("response,answer,expected", CASES)
def test_math_reward(response, answer, expected):
    assert math_reward(response, answer) == expected


def test_format_score_rewards_a_wrong_but_extracted_answer_only():
    assert math_reward("\\boxed{5}", "6", format_score=0.1) == 0.1
    assert math_reward("5", "6", format_score=0.1) == 0.0
    assert math_reward("\\boxed{6}", "6", format_score=0.1) == 1.0
    # examples/local.yaml: a tiny model's "#### n" is well-formed; no answer after it is not
    assert math_reward("3+4= #### 8 1+", "7", format_score=0.1) == 0.1
    assert math_reward("3+4= ####", "7", format_score=0.1) == 0.0
    assert math_reward("\\boxed{}", "7", format_score=0.1) == 0.0


def test_final_answer():
    assert final_answer("a \\boxed{x^{2}} b") == "a \\boxed{x^{2}} b"  # math-verify reads the boxes
    assert final_answer("#### 3\n4") == "\\boxed{3}"
    assert final_answer("#### 3 then \\boxed{4}") == "#### 3 then \\boxed{4}"
    assert final_answer("nothing") is None


def test_load_reward_math_uses_the_format_score():
    reward = load_reward(Reward(function="math", format_score=0.25))
    assert reward("\\boxed{1}", "2") == 0.25 and reward("\\boxed{2}", "2") == 1.0
    assert reward.failures == 0


@pytest.fixture
def plugin_dir(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(textwrap.dedent("""
        import math
        import time
        LIMIT = 3
        def length_penalty(response, answer):
            return -len(response)
        def boom(response, answer):
            raise RuntimeError("cannot score " + response)
        def slow(response, answer):  # sleeps `answer` seconds
            time.sleep(float(answer))
            return 1.0
        def nan(response, answer):
            return math.nan
        def greedy(response, answer):  # an except Exception must not swallow the timeout
            try:
                time.sleep(float(answer))
            except Exception:
                pass
            return 1.0
    """))
    (tmp_path / "broken_rewards.py").write_text("import not_installed_dependency\n")
    (tmp_path / "failing_rewards.py").write_text("raise RuntimeError('no config')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in ("my_rewards", "broken_rewards", "failing_rewards"):
        sys.modules.pop(name, None)


def test_load_reward_plugin(plugin_dir):
    assert load_reward(Reward(function="my_rewards:length_penalty"))("abc", "") == -3


@pytest.mark.parametrize("function,message", [
    ("no_such_module:f", "no module 'no_such_module'; install it or put its directory on PYTHONPATH"),
    ("broken_rewards:f", "imports 'not_installed_dependency', which is not installed"),
    ("failing_rewards:f", "importing 'failing_rewards' raised RuntimeError: no config; fix the module"),
    ("my_rewards:missing", "has no 'missing'; define missing"),
    ("my_rewards:LIMIT", "my_rewards.LIMIT is not callable (type int)"),
])
def test_load_reward_plugin_errors_name_the_field_and_fix(plugin_dir, function, message):
    with pytest.raises(ValueError, match="reward.function=") as e:
        load_reward(Reward(function=function))
    assert message in str(e.value)


def test_a_plugin_that_raises_scores_0_counted_and_warned_once(plugin_dir, caplog):
    reward = load_reward(Reward(function="my_rewards:boom"))
    assert reward("x", "1") == 0.0 and reward("y", "1") == 0.0
    assert reward.failures == 2
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == ["reward.function='my_rewards:boom' raised RuntimeError: cannot score x; that response "
                        "scores 0 (further RuntimeError failures are counted, not logged; check the function with "
                        "`pat reward`)"]


def test_a_plugin_that_returns_no_number_scores_0(plugin_dir):
    reward = load_reward(Reward(function="my_rewards:nan"))
    assert reward("x", "1") == 0.0 and reward.failures == 1


@pytest.mark.parametrize("function", ["my_rewards:slow", "my_rewards:greedy"])
def test_a_plugin_past_the_timeout_scores_0_and_counts(plugin_dir, caplog, function):
    reward = load_reward(Reward(function=function, timeout_seconds=0.2))
    started = time.monotonic()
    assert reward("x", "30") == 0.0  # would sleep 30 s
    assert time.monotonic() - started < 2
    assert reward.failures == 1
    assert "ran past reward.timeoutSeconds=0.2" in caplog.text


def test_the_same_slow_plugin_within_its_timeout_returns_its_score(plugin_dir):
    # the negative control of the above: a 0.3 s call fails at 0.2 s only for its time
    assert load_reward(Reward(function="my_rewards:slow", timeout_seconds=0.2))("x", "0.3") == 0.0
    reward = load_reward(Reward(function="my_rewards:slow", timeout_seconds=2))
    assert reward("x", "0.3") == 1.0 and reward.failures == 0


def test_outside_the_main_thread_a_call_runs_unbounded_and_says_so(plugin_dir, caplog):
    reward = load_reward(Reward(function="my_rewards:slow", timeout_seconds=0.2))
    scores = []
    thread = threading.Thread(target=lambda: scores.append(reward("x", "0.3")))
    thread.start()
    thread.join()
    assert scores == [1.0] and reward.failures == 0
    assert "runs without reward.timeoutSeconds outside the main thread" in caplog.text


def test_a_call_keeps_an_alarm_set_before_it(plugin_dir):
    # pytest-timeout's, say: still pending after the call, less the call's time
    previous = signal.setitimer(signal.ITIMER_REAL, 60)
    try:
        assert load_reward(Reward(function="my_rewards:slow"))("x", "0.1") == 1.0
        assert 59 < signal.getitimer(signal.ITIMER_REAL)[0] < 60
    finally:
        signal.setitimer(signal.ITIMER_REAL, *previous)


@pytest.mark.parametrize("argv,score", [
    (["--function", "math", "--answer", "\\sqrt{3}/2", "--response", "so \\boxed{\\frac{\\sqrt{3}}{2}}"], "1.0"),
    (["--function", "math", "--answer", "7", "--response", "3+4= #### 8"], "0.0"),
    (["--function", "math", "--answer", "7", "--response", "3+4= #### 8", "--format-score", "0.1"], "0.1"),
    ([str(LOCAL_JOB), "--answer", "7", "--response", "3+4= #### 8"], "0.1"),  # the job's formatScore
    ([str(LOCAL_JOB), "--answer", "7", "--response", "3+4= #### 7 3+1="], "1.0"),
    (["--function", "my_rewards:length_penalty", "--answer", "", "--response", "abcd"], "-4.0"),
])
def test_pat_reward_prints_the_score_last(plugin_dir, capsys, argv, score):
    assert pat(["reward", *argv]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == score


def test_pat_reward_of_a_failing_plugin_prints_0_and_exits_1(plugin_dir, capsys):
    assert pat(["reward", "--function", "my_rewards:boom", "--answer", "1", "--response", "x"]) == 1
    assert capsys.readouterr().out.splitlines()[-1] == "0.0"


@pytest.mark.parametrize("argv,message", [
    (["--function", "no_such_module:f"], "pat reward: reward.function='no_such_module:f': no module 'no_such_module'"),
    (["no-such-job.yaml"], "cannot read no-such-job.yaml"),
])
def test_pat_reward_bad_input_exits_2_with_the_error(plugin_dir, capsys, argv, message):
    assert pat(["reward", *argv, "--answer", "1", "--response", "1"]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("length, expected", [(0, 0.0), (32, 0.0), (36, -0.25), (40, -0.5), (48, -1.0), (60, -1.0)])
def test_overlong_penalty_by_hand(length, expected):
    # max 48 tokens, buffer 16: free up to 32, then -1/16 per token
    assert overlong_penalty(length, 48, 16) == pytest.approx(expected)
    assert overlong_penalty(length, 48, 0) == 0.0  # off
