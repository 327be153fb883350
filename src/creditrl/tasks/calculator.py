"""Calculator: multi-step arithmetic with a tool (multi-turn, tool-integrated).

Prompt ``"47*38+215="``. The model may write ``<calc>expr</calc>``; the environment then
appends ``<out>value</out>`` computed by the safe parser and generation resumes, up to
``max_tool_calls`` times. The final answer goes in ``<answer>…</answer>``; only it is scored.
Tool-output characters are environment text: never trained on (mask 0), see
``tool_output_spans``. Example SFT transcript::

    <calc>47*38+215</calc><out>2001</out><answer>2001</answer>
"""
from __future__ import annotations

import random
import re

from creditrl.utils.validate import check_int
from creditrl.tasks.base import Problem, ProceduralTask
from creditrl.tasks.checkers import answer_number
from creditrl.tasks.safe_math import MAX_ABS, format_number, safe_eval

CALL_OPEN, CALL_CLOSE = "<calc>", "</calc>"
OUT_OPEN, OUT_CLOSE = "<out>", "</out>"
TOOL_ERROR = "error"
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_OUT = re.compile(re.escape(OUT_OPEN) + r".*?" + re.escape(OUT_CLOSE), re.DOTALL)


def tool_output_spans(text: str) -> list[tuple[int, int]]:
    """``[start, end)`` character spans of every ``<out>…</out>`` block in ``text``."""
    return [m.span() for m in _OUT.finditer(text)]


class Calculator(ProceduralTask):
    name = "calculator"
    tool_stop = CALL_CLOSE

    def __init__(self, max_tool_calls: int = 2, digits: int = 2, n_terms: int = 3, *,
                 seed: int = 0, test_size: int = 200, format: str = "auto", chat_template="auto",
                 system_prompt: str | None = None):
        for arg, value, low, high in (("max_tool_calls", max_tool_calls, 1, 16), ("digits", digits, 1, 4),
                                      ("n_terms", n_terms, 2, 6)):
            check_int(arg, value, low, high)
        largest = (10 ** digits - 1) ** n_terms        # every term the largest, every operator '*'
        if largest > MAX_ABS:
            fits = max(n for n in range(2, n_terms) if (10 ** digits - 1) ** n <= MAX_ABS)
            raise ValueError(f"n_terms: with digits={digits} a product of {n_terms} terms can reach {largest:.4g}, "
                             f"beyond the calculator's limit of 10**15 on every value; expected n_terms <= {fits} "
                             f"with digits={digits}, got {n_terms}")
        super().__init__(seed=seed, test_size=test_size, format=format, chat_template=chat_template,
                         system_prompt=system_prompt, max_tool_calls=max_tool_calls, digits=digits, n_terms=n_terms)
        self.max_tool_calls, self.digits, self.n_terms = max_tool_calls, digits, n_terms

    def generate(self, rng: random.Random) -> Problem:
        low, high = 10 ** (self.digits - 1), 10 ** self.digits
        terms = [str(rng.randrange(low, high)) for _ in range(self.n_terms)]
        ops = [rng.choice("+-*") for _ in range(self.n_terms - 1)]
        expr = terms[0] + "".join(op + t for op, t in zip(ops, terms[1:]))
        value = safe_eval(expr)
        return Problem(expr + "=", format_number(value), {"expr": expr})

    def tool_output(self, response_so_far: str) -> str | None:
        """``"<out>value</out>"`` if the response just closed a tool call within budget, else
        None. A malformed call yields ``"<out>error</out>"`` (the model sees its mistake)."""
        if not isinstance(response_so_far, str) or not response_so_far.endswith(CALL_CLOSE):
            return None
        if response_so_far.count(CALL_CLOSE) > self.max_tool_calls:
            return None
        body = response_so_far[: -len(CALL_CLOSE)]
        start = body.rfind(CALL_OPEN)
        value = safe_eval(body[start + len(CALL_OPEN):]) if start >= 0 else None
        return OUT_OPEN + (TOOL_ERROR if value is None else format_number(value)) + OUT_CLOSE

    def compact_reward(self, problem: Problem, response: str) -> float:
        """The last ``<answer>`` states the value (``checkers.answer_number``: "2,001", "2001.0" and
        "−333" are numbers too)."""
        answers = _ANSWER.findall(response)
        return float(bool(answers) and answer_number(answers[-1]) == answer_number(problem.answer))

    natural_reward = compact_reward  # the tags are the protocol in both formats

    def natural_prompt(self, problem: Problem) -> str:
        return (f"Compute {problem.meta['expr']}. You have a calculator: write {CALL_OPEN}expression{CALL_CLOSE} "
                f"(digits, + - * / and parentheses) and its result appears right after as "
                f"{OUT_OPEN}value{OUT_CLOSE}; you may use it up to {self.max_tool_calls} times. "
                f"Give the final answer as <answer>number</answer>.")

    def natural_target(self, problem: Problem) -> str:
        return self.compact_target(problem)

    def compact_target(self, problem: Problem) -> str:
        out = self.tool_output(CALL_OPEN + problem.meta["expr"] + CALL_CLOSE)
        return f"{CALL_OPEN}{problem.meta['expr']}{CALL_CLOSE}{out}<answer>{problem.answer}</answer>"

    def tool_output_spans(self, text: str) -> list[tuple[int, int]]:
        return tool_output_spans(text)

    def alphabet(self) -> str:
        letters = sorted(set(CALL_OPEN + CALL_CLOSE + OUT_OPEN + OUT_CLOSE + TOOL_ERROR + "<answer></answer>"))
        return "0123456789+-*/()=" + "".join(c for c in letters if c not in "/")
