"""Countdown: reach a target from 3–5 given numbers with + − × ÷ and parentheses.

Prompt ``"3,5,7:50="`` (numbers, target); the response is an expression such as ``"(3+7)*5"``.
Reward 1 iff the expression parses with the safe parser, uses only given numbers, each at
most as often as given, and equals the target exactly. Every instance is solvable: the
target is the value of a random expression over all the numbers (kept as ``sft_target``).
Many answers are valid, so pass@k is meaningful.
"""
from __future__ import annotations

import random
import re
from collections import Counter
from fractions import Fraction

from creditrl.utils.validate import check_int
from creditrl.tasks.base import Problem, ProceduralTask
from creditrl.tasks.safe_math import literals, safe_eval

_PREC = {"+": 1, "-": 1, "*": 2, "/": 2}
# generation is rejection sampling on the target: options under which fewer than 1 draw in 1,000 lands
# at or below max_target (max_number=10000, max_target=2: 0.4 s a problem) are refused up front
TRIAL_DRAWS, MIN_ACCEPTED = 2000, 2


def _render(node) -> str:
    """Infix text of a (value, op, left, right) tree with only the parentheses needed."""
    value, op, left, right = node
    if op is None:
        return str(value)

    def child(sub, is_right: bool) -> str:
        text = _render(sub)
        sub_op = sub[1]
        if sub_op is not None and (_PREC[sub_op] < _PREC[op] or (is_right and _PREC[sub_op] == _PREC[op] and op in "-/")):
            return f"({text})"
        return text

    return child(left, False) + op + child(right, True)


def _combine(a, b, op: str):
    """Node for ``a op b`` if it stays a positive integer, else None."""
    x, y = a[0], b[0]
    value = {"+": x + y, "-": x - y, "*": x * y, "/": Fraction(x, y)}[op]
    if value <= 0 or Fraction(value).denominator != 1:
        return None
    return (int(value), op, a, b)


class Countdown(ProceduralTask):
    name = "countdown"

    def __init__(self, n_numbers: int = 3, max_number: int = 10, max_target: int = 100, *,
                 seed: int = 0, test_size: int = 200, format: str = "auto", chat_template="auto",
                 system_prompt: str | None = None):
        for arg, value, low, high in (("n_numbers", n_numbers, 3, 5), ("max_number", max_number, 2, 10_000),
                                      ("max_target", max_target, 2, 10 ** 9)):
            check_int(arg, value, low, high)
        super().__init__(seed=seed, test_size=test_size, format=format, chat_template=chat_template,
                         system_prompt=system_prompt, n_numbers=n_numbers,
                         max_number=max_number, max_target=max_target)
        self.n_numbers, self.max_number, self.max_target = n_numbers, max_number, max_target
        trial, accepted = random.Random(0), 0
        for _ in range(TRIAL_DRAWS):
            accepted += self._draw(trial) is not None
            if accepted == MIN_ACCEPTED:       # usual options: a few draws
                break
        else:
            raise ValueError(f"max_target: with n_numbers={n_numbers} and max_number={max_number}, {accepted} of "
                             f"{TRIAL_DRAWS} random expressions came out at or below max_target={max_target}, so "
                             f"each problem would take thousands of draws; raise max_target or lower max_number")

    def _random_tree(self, numbers: list[int], rng: random.Random):
        items = [(n, None, None, None) for n in numbers]
        while len(items) > 1:
            a, b = rng.sample(items, 2)
            ops = ["+", "-", "*", "/"]
            rng.shuffle(ops)
            node = next((n for op in ops if (n := _combine(a, b, op)) is not None), None)
            if node is None:
                return None
            items.remove(a)
            items.remove(b)
            items.append(node)
        return items[0]

    def _draw(self, rng: random.Random):
        """(numbers, expression tree) of one random draw, or None where it misses the target range."""
        numbers = [rng.randint(1, self.max_number) for _ in range(self.n_numbers)]
        tree = self._random_tree(numbers, rng)
        return (numbers, tree) if tree is not None and tree[0] <= self.max_target else None

    def generate(self, rng: random.Random) -> Problem:
        while (drawn := self._draw(rng)) is None:   # >= 1 in 1,000 draws lands (checked in __init__)
            pass
        numbers, tree = drawn
        prompt = ",".join(map(str, numbers)) + f":{tree[0]}="
        return Problem(prompt, str(tree[0]), {"numbers": numbers, "target": tree[0], "solution": _render(tree)})

    def compact_reward(self, problem: Problem, response: str) -> float:
        value = safe_eval(response)
        used = literals(response)
        if value is None or used is None or value != problem.meta["target"]:
            return 0.0
        if any(x.denominator != 1 for x in used):
            return 0.0
        allowed = Counter(problem.meta["numbers"])
        return float(not (Counter(int(x) for x in used) - allowed))

    def compact_target(self, problem: Problem) -> str:
        return problem.meta["solution"]

    def natural_prompt(self, problem: Problem) -> str:
        numbers = ", ".join(map(str, problem.meta["numbers"]))
        return (f"Using the numbers {numbers} (each at most once) with + - * / and parentheses, write an "
                f"expression that equals {problem.meta['target']}. Reply with just the expression.")

    def natural_reward(self, problem: Problem, response: str) -> float:
        """The expression on the last non-empty line (``natural_expression``)."""
        return self.compact_reward(problem, natural_expression(response))

    natural_target = compact_target

    def alphabet(self) -> str:
        return "0123456789+-*/(),:="


# how instruct models write an expression: LaTeX and unicode operators, math delimiters, a label
_OPERATORS = (("\\times", "*"), ("\\cdot", "*"), ("\\div", "/"), ("×", "*"), ("·", "*"), ("÷", "/"), ("−", "-"))
# \boxed{...} keeps its grouping as parentheses; [^{}]* (no nesting in an expression) keeps it linear
_WRAPPING = re.compile(r"\\boxed\{([^{}]*)\}|\\[()\[\]]|\\left|\\right|"
                       r"^[\s*_]*(?:final\s+)?(?:answer|expression)\s*:[*_]*", re.I)
MAX_EXPRESSION_CHARS = 1000   # a longer last line is not an expression (and is not parsed)
_SPACED_X = re.compile(r"(?<=[\d)])\s+[xX]\s+(?=[\d(])")


def natural_expression(response: str) -> str:
    """The last non-empty line of a reply as a plain expression: markdown and LaTeX wrapping
    (``$``, backticks, bold, ``\\(..\\)``), an "Answer:" label, a trailing period and any "= target"
    tail removed, ``\\boxed{e}`` read as (e); ``\\times``, ``\\cdot``, ×, · and a spaced x read as *,
    ``\\div`` and ÷ as /."""
    lines = [line for line in response.strip().splitlines() if line.strip()]
    if not lines:
        return ""
    if len(lines[-1]) > MAX_EXPRESSION_CHARS:
        return ""
    line = _WRAPPING.sub(lambda m: "" if m.group(1) is None else f"({m.group(1)})", lines[-1])
    for old, new in _OPERATORS:
        line = line.replace(old, new)
    line = _SPACED_X.sub(" * ", line)
    return line.split("=")[0].strip(" `$*").removesuffix(".").rstrip()
