"""The built-in answer checkers, ``fn(prompt, response, answer) -> float`` (creditrl's convention).

- ``exact``: string equality up to surrounding whitespace;
- ``numeric``: the last number of the response (``last_number``: "a/b" and LaTeX's ``\\frac{a}{b}`` are
  one number, a whole number before a fraction a mixed number ("2 \\frac{1}{2}" is 5/2), "1,234"
  counts as 1234 only with separators every 3 digits, "1,2,3" is 3; a U+2212 minus is a minus) equals the number the answer states (``answer_number``: "3/4", "\\frac{3}{4}",
  "-0.75", "12%"), exactly unless an absolute ``tolerance`` is given;
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
from fractions import Fraction

BUILTIN_CHECKERS = ("exact", "numeric", "math")
MATH_TAIL_CHARS = 2000   # math-verify reads this tail of a response: where the final answer is
MATH_VERIFY_TIMEOUT = 5
_UNSIGNED = r"(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+)(?:[eE][-+]?\d+)?"
_NUMBER = re.compile(rf"[-+]?{_UNSIGNED}")
_FRACTION = re.compile(rf"[-+]?{_UNSIGNED}\s*/\s*{_UNSIGNED}")
# the minus signs of rendered math (U+2212, small and fullwidth hyphen-minus), which models copy
MINUS_SIGNS = str.maketrans({"\u2212": "-", "\ufe63": "-", "\uff0d": "-"})
MAX_EXPONENT = 1000   # |log10| of a number read: "1e999999999" would take minutes to make exact
# \frac{a}{b}, \dfrac and \tfrac, and the digit shorthand \frac12, of plain numbers, read as a/b; a
# whole number written against it is a mixed number ("2\frac{1}{2}" = 5/2, as MATH's answers write
# it; math mode ignores spaces, so "2 \frac{1}{2}" and "2\,\frac{1}{2}" too; not an exponent's or
# index's digit, x^2\frac{1}{2}). A fraction of anything else is left as written. \d, the gap's
# characters and \s are disjoint: linear on any text
_LATEX_FRACTION = re.compile(r"(?:(?<![\d.^_])(\d+)(?:[ \t~]|\\[,;:! ])*)?\\[dt]?frac\s*(?:\{\s*([-+]?\d+(?:\.\d+)?)\s*\}\s*"
                             r"\{\s*([-+]?\d+(?:\.\d+)?)\s*\}|(\d)(\d))")


def _plain(text: str) -> str:
    """``text`` with rendered math's minus signs as "-" and LaTeX fractions of numbers as "a/b"."""
    def as_slash(m: re.Match) -> str:
        top, bottom = (m[2], m[3]) if m[4] is None else (m[4], m[5])
        if len(m.group()) > 2 * MAX_EXPONENT:    # as _exact: no number (and no minutes of arithmetic)
            return m.group()
        gap = " " if m[1] is None and m.start() and text[m.start() - 1] in "0123456789." else ""
        if Decimal(bottom) == 0:
            return f"{m[1] or ''}{gap} {top}/0"            # a/0: no number
        # a mixed number's fraction is unsigned: before a signed one, the whole number stays its own
        mixed = m[1] is not None and top[0] not in "+-" and bottom[0] not in "+-"
        value = Fraction(Decimal(top)) / Fraction(Decimal(bottom)) + (int(m[1]) if mixed else 0)
        lead = f"{m[1]} " if m[1] is not None and not mixed else gap
        return f"{lead}{value.numerator}/{value.denominator}"
    text = text.translate(MINUS_SIGNS)
    return _LATEX_FRACTION.sub(as_slash, text)


def check_exact(prompt, response: str, answer: str) -> float:
    return float(response.strip() == answer.strip())


def _exact(token: str) -> Fraction | None:
    try:
        value = Decimal(token.replace(",", ""))
    except InvalidOperation:
        return None
    return Fraction(value) if value.is_finite() and abs(value.adjusted()) <= MAX_EXPONENT else None


def last_number(text: str) -> Fraction | None:
    """The last number written in ``text``, exactly: "a/b" (not a date's "11/27/2026") is the one
    number a/b, as is ``\\frac{a}{b}``; thousands separators count in valid places only; None without
    one (or for a/0)."""
    text = _plain(text)
    found = list(_NUMBER.finditer(text))
    if not found:
        return None
    last = found[-1]
    value = _exact(last.group())
    if len(found) > 1 and value is not None and last.group()[0] not in "+-":
        head = found[-2]
        before = text[:head.start()].rstrip()
        if text[head.end():last.start()].strip() == "/" and not before.endswith("/"):
            numerator = _exact(head.group())
            return None if numerator is None or value == 0 else numerator / value
    return value


def first_number(text: str) -> Fraction | None:
    """The first number written in ``text``, read as ``last_number`` reads one (no fractions)."""
    found = _NUMBER.search(_plain(text))
    return None if found is None else _exact(found.group())


def answer_number(answer: str) -> Fraction | None:
    """The number a gold answer states: the whole answer as one number or fraction (inside $...$
    or not), else the only number it holds ("12%", "x = 5"); None when it holds none or several
    ("1:2", "2 or 3": use ``checker=math`` or a function of your own)."""
    text = _plain(answer).strip().strip("$").strip()
    if _NUMBER.fullmatch(text) or _FRACTION.fullmatch(text):
        return last_number(text)
    found = _NUMBER.findall(text)
    return _exact(found[0]) if len(found) == 1 else None


def check_numeric(prompt, response: str, answer: str, tolerance: float = 0.0) -> float:
    got, want = last_number(response), answer_number(answer)
    if got is None or want is None:
        return 0.0
    return float(got == want if tolerance == 0 else abs(got - want) <= Fraction(repr(tolerance)))


# digit groups of 3 after a separator: LaTeX's thin spaces and typographic no-break spaces (math-verify
# reads "1\\,000" as 1 times 000 = 0), and, in a gold answer only, a plain space ("1 000")
_GROUP_SEPARATOR = r"(?:\\[,; ]|~|[\u00a0\u2009\u202f])"
_GROUPED = re.compile(rf"(?<![\d.,])\d{{1,3}}(?:{_GROUP_SEPARATOR}\d{{3}})+(?!\d)")
_GROUPED_OR_SPACED = re.compile(rf"(?<![\d.,])\d{{1,3}}(?:(?:{_GROUP_SEPARATOR}| )\d{{3}})+(?!\d)")


def _ungrouped(text: str, pattern: re.Pattern) -> str:
    """``text`` with the digit-group separators ``pattern`` finds removed: "1\\,000" -> "1000"."""
    return pattern.sub(lambda m: re.sub(r"\D", "", m.group()), text)


def check_math(prompt, response: str, answer: str) -> float:
    """math-verify: parse both sides (LaTeX, ``\\boxed{}``, plain expressions) and compare, with
    thousands grouped by thin spaces ("1\\,000") read as one number (and by spaces, in the answer)."""
    from math_verify import parse, verify

    # math-verify's timeouts use SIGALRM, which only works on the main thread.
    timeout = MATH_VERIFY_TIMEOUT if threading.current_thread() is threading.main_thread() else None
    answer, response = _ungrouped(answer, _GROUPED_OR_SPACED), _ungrouped(response[-MATH_TAIL_CHARS:], _GROUPED)
    gold = answer if "$" in answer or "\\boxed" in answer else f"${answer}$"
    quiet = logging.getLogger("math_verify")
    level, quiet.level = quiet.level, logging.CRITICAL   # it logs the whole response on a timeout
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            return float(verify(parse(gold, parsing_timeout=timeout),
                                parse(response, parsing_timeout=timeout), timeout_seconds=timeout))
    except Exception:  # noqa: BLE001 - malformed model output is reward 0, never a crash
        return 0.0
    finally:
        quiet.level = level
