"""Reward functions: (response text, reference answer) -> float. The built-in math reward and plugins."""

from __future__ import annotations

import functools
import importlib
import re
from collections.abc import Callable
from fractions import Fraction

from pat_operator.api import Reward

RewardFn = Callable[[str, str], float]

_BOXED = "\\boxed"
_MARKER = "####"
_NUMBER = re.compile(r"[-+]?(\d+(\.\d*)?|\.\d+)")
_THOUSANDS = re.compile(r"[-+]?\d{1,3}(,\d{3})+(\.\d*)?")
_SLASH_FRACTION = re.compile(r"([-+]?\d+)/([-+]?\d+)")
_LATEX_FRACTION = re.compile(r"(-?)\\[dt]?frac\{([-+]?\d+)\}\{([-+]?\d+)\}")
_LEADING_NUMBER = re.compile(r"\$?[-+]?(\d[\d,]*(\.\d+)?(/\d+)?|\.\d+)")


def _last_boxed(text: str) -> tuple[int, str] | None:
    """(position, content) of the last \\boxed{...}, braces nested; None if absent or unclosed."""
    start = text.rfind(_BOXED + "{")
    if start < 0:
        return None
    depth = 0
    for i in range(start + len(_BOXED), len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return start, text[start + len(_BOXED) + 1:i]
    return None


def extract_answer(text: str) -> str | None:
    """The final answer: the content of the last \\boxed{...} or what follows the last ####, whichever comes
    later in the text; None when there is neither. After ####, a number is the answer whatever follows it (as
    GSM8K graders read "#### 72"); otherwise the rest of the line is."""
    found = []
    if (boxed := _last_boxed(text)) is not None:
        found.append(boxed)
    if (marker := text.rfind(_MARKER)) >= 0:
        rest = text[marker + len(_MARKER):].lstrip()
        number = _LEADING_NUMBER.match(rest)
        found.append((marker, number[0].rstrip(",") if number else rest.split("\n")[0].strip()))
    return max(found)[1] if found else None


def _normalize(answer: str) -> str:
    """Spaces, $ and a trailing period dropped (what differs between equal answers only in form)."""
    return re.sub(r"\s+", "", answer).replace("$", "").rstrip(".")


def _value(answer: str) -> Fraction | None:
    """The exact value of a normalised integer, decimal (commas as thousands separators, leading + or zeros,
    trailing zeros), a/b or \\frac{a}{b}; None for anything else."""
    if _THOUSANDS.fullmatch(answer):
        answer = answer.replace(",", "")
    if _NUMBER.fullmatch(answer):
        return Fraction(answer)
    if (m := _SLASH_FRACTION.fullmatch(answer)) and int(m[2]) != 0:
        return Fraction(int(m[1]), int(m[2]))
    if (m := _LATEX_FRACTION.fullmatch(answer)) and int(m[3]) != 0:
        return Fraction(int(m[2]), int(m[3])) * (-1 if m[1] else 1)
    return None


def answers_match(given: str, expected: str) -> bool:
    given, expected = _normalize(given), _normalize(expected)
    given_value, expected_value = _value(given), _value(expected)
    if given_value is not None and expected_value is not None:
        return given_value == expected_value
    return given == expected


def math_reward(response: str, answer: str, format_score: float = 0.0) -> float:
    """1.0 if the response's final answer (last \\boxed{} or ####) equals `answer`, format_score if it has one
    that differs, 0.0 if it has none. `answer` may itself be a solution ending in \\boxed{} or #### (GSM8K)."""
    given = extract_answer(response)
    if given is None:
        return 0.0
    expected = extract_answer(answer)
    return 1.0 if answers_match(given, answer if expected is None else expected) else format_score


def overlong_penalty(length: int, max_tokens: int, buffer: int, penalty: float = 1.0) -> float:
    """DAPO's soft overlong punishment: 0 up to max_tokens - buffer tokens, then falling linearly to -penalty at
    max_tokens, so that the policy learns to finish before the cap instead of being cut off."""
    if buffer <= 0:
        return 0.0
    over = length - (max_tokens - buffer)
    return -penalty * min(max(over, 0), buffer) / buffer


def load_reward(spec: Reward) -> RewardFn:
    """The reward named by spec.function: "math" (with spec.format_score) or a plugin "module:function"
    taking (response, answer) and returning a float."""
    if spec.function == "math":
        return functools.partial(math_reward, format_score=spec.format_score)
    module_name, _, function_name = spec.function.partition(":")
    where = f"reward.function={spec.function!r}"
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name is not None and (module_name + ".").startswith(e.name + "."):
            raise ValueError(f"{where}: no module {module_name!r}; install it or put its directory on "
                             "PYTHONPATH") from None
        raise ValueError(f"{where}: module {module_name!r} imports {e.name!r}, which is not installed; "
                         "install it") from e
    function = getattr(module, function_name, None)
    if function is None:
        raise ValueError(f"{where}: module {module_name!r} has no {function_name!r}; define "
                         f"{function_name}(response: str, answer: str) -> float there or fix the name")
    if not callable(function):
        raise ValueError(f"{where}: {module_name}.{function_name} is not callable (type "
                         f"{type(function).__name__}); point reward.function at a function (response, answer) -> float")
    return function
