"""The built-in answer checkers, ``fn(prompt, response, answer) -> float`` (creditrl's convention).

- ``exact``: string equality up to surrounding whitespace;
- ``numeric``: the last number of the response equals the answer, exactly unless an absolute
  ``tolerance`` is given; "1,234" counts as 1234 only with separators every 3 digits ("1,2,3" is 3);
- ``math``: math-verify's parse + verify of the last ``MATH_TAIL_CHARS`` characters (LaTeX,
  ``\\boxed{}``, plain expressions), quiet, with math-verify's own 5 s limits where it can use
  them (the main thread; ``tasks/rewards.py`` runs it in a child process's main thread).
"""
from __future__ import annotations

import contextlib
import io
import logging
import re
import threading
from decimal import Decimal, InvalidOperation

BUILTIN_CHECKERS = ("exact", "numeric", "math")
MATH_TAIL_CHARS = 2000   # math-verify reads this tail of a response: where the final answer is
MATH_VERIFY_TIMEOUT = 5
_NUMBER = re.compile(r"[-+]?(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+)(?:[eE][-+]?\d+)?")


def check_exact(prompt, response: str, answer: str) -> float:
    return float(response.strip() == answer.strip())


def last_number(text: str) -> Decimal | None:
    """The last number written in ``text``, exactly (thousands separators in valid places only)."""
    found = _NUMBER.findall(text)
    try:
        value = Decimal(found[-1].replace(",", "")) if found else None
    except InvalidOperation:
        return None
    return value if value is not None and value.is_finite() else None


def check_numeric(prompt, response: str, answer: str, tolerance: float = 0.0) -> float:
    got, want = last_number(response), last_number(answer)
    if got is None or want is None:
        return 0.0
    return float(got == want if tolerance == 0 else abs(got - want) <= Decimal(repr(tolerance)))


def check_math(prompt, response: str, answer: str) -> float:
    """math-verify: parse both sides (LaTeX, ``\\boxed{}``, plain expressions) and compare."""
    from math_verify import parse, verify

    # math-verify's timeouts use SIGALRM, which only works on the main thread.
    timeout = MATH_VERIFY_TIMEOUT if threading.current_thread() is threading.main_thread() else None
    gold = answer if "$" in answer or "\\boxed" in answer else f"${answer}$"
    quiet = logging.getLogger("math_verify")
    level, quiet.level = quiet.level, logging.CRITICAL   # it logs the whole response on a timeout
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            return float(verify(parse(gold, parsing_timeout=timeout),
                                parse(response[-MATH_TAIL_CHARS:], parsing_timeout=timeout), timeout_seconds=timeout))
    except Exception:  # noqa: BLE001 - malformed model output is reward 0, never a crash
        return 0.0
    finally:
        quiet.level = level
