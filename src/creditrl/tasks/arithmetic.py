"""Addition and multiplication: prompts like ``"37+45="``, answers checked exactly.

Character-level by design (a tiny model reads and writes one digit per token). The
multiplication scratchpad writes every partial product, so responses run to tens of
tokens and token-level credit matters; only the number after the last ``"="`` is scored.
"""
from __future__ import annotations

import random
import re

from creditrl.utils.validate import check_int
from creditrl.tasks.base import Problem, ProceduralTask, last_integer
from creditrl.tasks.checkers import first_number

DIGITS = "0123456789"
_ANSWER_MARKER = re.compile(r"answer:", re.IGNORECASE)
# "37 * 45 =" (or ×, x, ·, \times, \cdot, "times" ... "is") restated before the answer
_RESTATED = re.compile(r"^[\s*_$`(]*\d[\d,]*\s*(?:\*|×|x|X|·|\\times|\\cdot|times)\s*\d[\d,]*\s*[)$]*\s*(?:=|is)")


def _check_digits(digits: object, high: int) -> None:
    check_int("digits", digits, 1, high)


def exact(text: str, answer: str) -> float:
    """1.0 iff ``text`` equals ``answer`` up to surrounding whitespace."""
    return float(isinstance(text, str) and text.strip() == answer)


class Addition(ProceduralTask):
    """``a+b=`` with ``a, b`` uniform in ``[0, 10**digits)``; response ``str(a+b)``."""

    name = "addition"

    def __init__(self, digits: int = 2, *, seed: int = 0, test_size: int = 200, format: str = "auto",
                 chat_template="auto", system_prompt: str | None = None):
        _check_digits(digits, 9)
        super().__init__(seed=seed, test_size=test_size, format=format, chat_template=chat_template,
                         system_prompt=system_prompt, digits=digits)
        self.digits = digits

    def space_size(self) -> int:
        return 10 ** (2 * self.digits)

    def generate(self, rng: random.Random) -> Problem:
        a, b = rng.randrange(10 ** self.digits), rng.randrange(10 ** self.digits)
        return Problem(f"{a}+{b}=", str(a + b), {"a": a, "b": b})

    def compact_reward(self, problem: Problem, response: str) -> float:
        return exact(response, problem.answer)

    def compact_target(self, problem: Problem) -> str:
        return problem.answer

    def natural_prompt(self, problem: Problem) -> str:
        return f"What is {problem.meta['a']} + {problem.meta['b']}? Reply with just the number."

    def natural_target(self, problem: Problem) -> str:
        return f"{problem.meta['a']} + {problem.meta['b']} = {problem.answer}"

    def alphabet(self) -> str:
        return DIGITS + "+="


class Multiplication(ProceduralTask):
    """``a*b=`` with ``digits``-digit operands. With ``scratchpad`` the response lists the
    partial products by digit of ``b`` then their sum, e.g. for ``37*45=``::

        37*5=185,37*40=1480,185+1480=1665
    """

    name = "multiplication"

    def __init__(self, digits: int = 2, scratchpad: bool = True, *, seed: int = 0, test_size: int = 200,
                 format: str = "auto", chat_template="auto", system_prompt: str | None = None):
        _check_digits(digits, 4)
        if not isinstance(scratchpad, bool):
            raise TypeError(f"scratchpad: expected a bool, got {scratchpad!r}")
        super().__init__(seed=seed, test_size=test_size, format=format, chat_template=chat_template,
                         system_prompt=system_prompt, digits=digits, scratchpad=scratchpad)
        self.digits, self.scratchpad = digits, scratchpad

    def space_size(self) -> int:
        return (9 * 10 ** (self.digits - 1)) ** 2

    def generate(self, rng: random.Random) -> Problem:
        low, high = 10 ** (self.digits - 1), 10 ** self.digits
        a, b = rng.randrange(low, high), rng.randrange(low, high)
        return Problem(f"{a}*{b}=", str(a * b), {"a": a, "b": b})

    def final_answer(self, response: str) -> str:
        return response.rsplit("=", 1)[-1] if self.scratchpad else response

    def compact_reward(self, problem: Problem, response: str) -> float:
        return exact(self.final_answer(response), problem.answer)

    def natural_prompt(self, problem: Problem) -> str:
        a, b = problem.meta["a"], problem.meta["b"]
        if self.scratchpad:
            return (f"What is {a} * {b}? Work it out step by step, then write the final answer on the last "
                    f"line as 'Answer: <number>'.")
        return f"What is {a} * {b}? Reply with just the number."

    def natural_reward(self, problem: Problem, response: str) -> float:
        """With the scratchpad only the number stated after the last 'Answer:' (any case) counts: the
        first one, after a restated product ("Answer: 37 × 45 = 1665"); a check after it ("Answer:
        1600. Check: 37*45 = 1665") is not the answer."""
        if self.scratchpad:
            markers = list(_ANSWER_MARKER.finditer(response))
            stated = first_number(_RESTATED.sub("", response[markers[-1].end():], count=1)) if markers else None
            return float(stated is not None and stated == int(problem.answer))
        return float(last_integer(response) == problem.answer)

    def natural_target(self, problem: Problem) -> str:
        if self.scratchpad:
            return self.compact_target(problem).replace(",", "\n") + f"\nAnswer: {problem.answer}"
        return f"{problem.meta['a']} * {problem.meta['b']} = {problem.answer}"

    def compact_target(self, problem: Problem) -> str:
        if not self.scratchpad:
            return problem.answer
        a, b = problem.meta["a"], problem.meta["b"]
        shifted = [int(d) * 10 ** i for i, d in enumerate(reversed(str(b)))]
        steps = [f"{a}*{s}={a * s}" for s in shifted]
        total = "+".join(str(a * s) for s in shifted)
        return ",".join(steps + [f"{total}={a * b}"])

    def alphabet(self) -> str:
        return DIGITS + "*=+,"
