"""Reward functions: (response text, reference answer) -> float. The built-in math reward and plugins, each called
through a Grader, which bounds its time and turns its failures into a score of 0."""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import math
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator
from types import ModuleType

from pat_operator.api import Reward

RewardFn = Callable[[str, str], float]

log = logging.getLogger("pat.trainer.reward")

_BOXED = "\\boxed"
_MARKER = "####"
_LEADING_NUMBER = re.compile(r"\$?([-+]?(\d[\d,]*(\.\d+)?(/\d+)?|\.\d+))")


@functools.cache
def _math_verify() -> ModuleType:
    """math-verify, imported on first use: it takes half a second (sympy), and the trainer's loop is imported
    without it too (make gpu-check on a bare machine)."""
    import math_verify.grader
    import math_verify.parser

    # Its own timeouts are off: a Grader bounds the whole call (see _alarm). Its one-time warning that nothing
    # bounds parse and verify then would only mislead.
    math_verify.parser.TIMEOUT_WARNING_SHOWN = math_verify.grader.TIMEOUT_WARNING_SHOWN = True
    return math_verify


def _parse(latex: str) -> list:
    """math-verify's reading of the answers in LaTeX text (every final answer reaches it in a \\boxed{})."""
    math_verify = _math_verify()
    return math_verify.parse(latex, (math_verify.LatexExtractionConfig(),), parsing_timeout=None)


def _boxed(answer: str) -> str:
    return f"{_BOXED}{{{answer}}}"


def _marked_answer(text: str) -> str | None:
    """What follows the text's last #### (GSM8K's final-answer marker) unless a \\boxed comes after it; None
    without such a marker. A number right after #### is the answer whatever follows it (GSM8K's "#### 72", a tiny
    model's "3+4= #### 7 3+1="); otherwise the rest of the line is."""
    marker = text.rfind(_MARKER)
    if marker < 0 or text.rfind(_BOXED) > marker:
        return None
    rest = text[marker + len(_MARKER):].lstrip()
    number = _LEADING_NUMBER.match(rest)
    return number[1].rstrip(",") if number else rest.split("\n")[0].strip()


def final_answer(text: str) -> str | None:
    """The text's final answer for math-verify to read: \\boxed{what follows the last ####} when that comes
    after every \\boxed{}, else the text itself when it has a \\boxed{} (math-verify reads the boxes); None when it
    has neither, that is no final answer."""
    if (marked := _marked_answer(text)) is not None:
        return _boxed(marked)
    return text if _BOXED in text else None


def math_reward(response: str, answer: str, format_score: float = 0.0) -> float:
    """1.0 if math-verify finds the response's final answer (its last #### or its \\boxed{}) equal to `answer`,
    format_score if the response has a final answer that math-verify can read but that differs, 0.0 if it has none.
    `answer` is wrapped in \\boxed{} as verl does, unless it is a solution that ends in \\boxed{} or #### itself
    (MATH, GSM8K)."""
    given = final_answer(response)
    given = _parse(given) if given is not None else []
    if not given:
        return 0.0
    expected = _parse(final_answer(answer) or _boxed(answer))
    return 1.0 if _math_verify().verify(expected, given, timeout_seconds=None) else format_score


def overlong_penalty(length: int, max_tokens: int, buffer: int, penalty: float = 1.0) -> float:
    """DAPO's soft overlong punishment: 0 up to max_tokens - buffer tokens, then falling linearly to -penalty at
    max_tokens, so that the policy learns to finish before the cap instead of being cut off."""
    if buffer <= 0:
        return 0.0
    over = length - (max_tokens - buffer)
    return -penalty * min(max(over, 0), buffer) / buffer


class RewardTimeout(BaseException):
    """A reward call ran past its time. A BaseException, as math-verify's own TimeoutException: the `except
    Exception` of a plugin or of math-verify's parse must not swallow it and carry on unbounded."""


@contextlib.contextmanager
def _alarm(seconds: float) -> Iterator[None]:
    """RewardTimeout raised inside the block after `seconds`, by SIGALRM: a signal interrupts the running Python
    code (sympy's simplification, a plugin's sleep), where a thread could only be abandoned, still running. Main
    thread only. A call stuck inside one C function is interrupted when that returns."""
    def expire(signum, frame):
        raise RewardTimeout

    handler = signal.signal(signal.SIGALRM, expire)
    outer, _ = signal.setitimer(signal.ITIMER_REAL, seconds)
    started = time.monotonic()
    try:
        yield
    finally:
        try:
            signal.setitimer(signal.ITIMER_REAL, 0)
        finally:  # also when the alarm goes off just before it is cancelled
            signal.signal(signal.SIGALRM, handler)
            if outer:  # someone else's alarm was set (pytest-timeout's, say): re-armed with what was left of it
                signal.setitimer(signal.ITIMER_REAL, max(outer - (time.monotonic() - started), 1e-6))


class Grader:
    """A reward function as the trainer calls it: a call never raises. A call that raises, runs past
    timeout_seconds or returns no finite number scores 0 and counts in `failures`; the first failure of each kind
    is logged (every response may fail alike)."""

    def __init__(self, function: RewardFn, name: str, timeout_seconds: float):
        self.function, self.name, self.timeout_seconds = function, name, timeout_seconds
        self.failures = 0
        self._warned: set[str] = set()

    def __call__(self, response: str, answer: str) -> float:
        try:
            with self._deadline():
                score = float(self.function(response, answer))
            if not math.isfinite(score):
                raise ValueError(f"returned {score}, not a finite number")
            return score
        except RewardTimeout:
            return self._failed("timeout", f"ran past reward.timeoutSeconds={self.timeout_seconds}")
        except Exception as e:
            return self._failed(type(e).__name__, f"raised {type(e).__name__}: {e}")

    def _deadline(self) -> contextlib.AbstractContextManager[None]:
        # Signals reach the main thread only (the trainer's loop runs there); elsewhere a call runs unbounded.
        if threading.current_thread() is threading.main_thread():
            return _alarm(self.timeout_seconds)
        self._warn_once("unbounded", f"reward.function={self.name!r} runs without reward.timeoutSeconds outside "
                        "the main thread: the alarm that bounds it is a signal, which only the main thread receives")
        return contextlib.nullcontext()

    def _failed(self, kind: str, error: str) -> float:
        self.failures += 1
        self._warn_once(kind, f"reward.function={self.name!r} {error}; that response scores 0 (further {kind} "
                        f"failures are counted, not logged; check the function with `pat reward`)")
        return 0.0

    def _warn_once(self, kind: str, message: str) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            log.warning(message)


def load_reward(spec: Reward) -> Grader:
    """The reward named by spec.function, "math" (with spec.format_score) or a plugin "module:function" taking
    (response, answer) and returning a float, in a Grader with spec.timeout_seconds."""
    if spec.function == "math":
        _math_verify()  # imported here, not in the first timed call
        function = functools.partial(math_reward, format_score=spec.format_score)
    else:
        function = _plugin(spec.function)
    return Grader(function, spec.function, spec.timeout_seconds)


def _plugin(name: str) -> RewardFn:
    module_name, _, function_name = name.partition(":")
    where = f"reward.function={name!r}"
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name is not None and (module_name + ".").startswith(e.name + "."):
            raise ValueError(f"{where}: no module {module_name!r}; install it or put its directory on "
                             "PYTHONPATH") from None
        raise ValueError(f"{where}: module {module_name!r} imports {e.name!r}, which is not installed; "
                         "install it") from e
    except Exception as e:  # a plugin that fails as it loads stops the run here, not at its first response
        raise ValueError(f"{where}: importing {module_name!r} raised {type(e).__name__}: {e}; fix the module") from e
    function = getattr(module, function_name, None)
    if function is None:
        raise ValueError(f"{where}: module {module_name!r} has no {function_name!r}; define "
                         f"{function_name}(response: str, answer: str) -> float there or fix the name")
    if not callable(function):
        raise ValueError(f"{where}: {module_name}.{function_name} is not callable (type "
                         f"{type(function).__name__}); point reward.function at a function (response, answer) -> float")
    return function
