"""Built-in tasks: generators, held-out sets, reward checkers (incl. adversarial output)."""
import json
import math
import random
import re
import sys
import warnings
from collections import Counter
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from creditrl.tasks import Problem, Task, get_task, list_tasks, task_options
from creditrl.tasks.calculator import tool_output_spans
from creditrl.tasks.safe_math import safe_eval

PROCEDURAL = ["addition", "multiplication", "countdown", "calculator"]
VARIANTS = [("addition", {}), ("addition", {"digits": 1}), ("multiplication", {}),
            ("multiplication", {"digits": 3, "scratchpad": False}), ("countdown", {}),
            ("countdown", {"n_numbers": 5}), ("calculator", {}), ("calculator", {"max_tool_calls": 1, "n_terms": 2})]
ADVERSARIAL = ["", " ", "\x00", "__import__('os')", "9**9**9", "1e999999", "(" * 500, "<answer>" * 100,
               "<calc>1/0</calc>", "=" * 50, "١٢٣", "\ud800", "x" * 10000, "<answer></answer>", "nan", "-",
               "+-*/", "<|eos|>"]


def test_registry():
    assert list_tasks() == ["addition", "multiplication", "countdown", "calculator", "jsonl", "reasoning_gym"]
    with pytest.raises(ValueError, match=r"unknown task 'adition'.*addition.*jsonl"):
        get_task("adition")
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['digit'\].*'digits'"):
        get_task("addition", digit=3)
    with pytest.raises(ValueError, match=r"missing required option\(s\) \['path'\]"):
        get_task("jsonl")
    with pytest.raises(ValueError, match=r"n_numbers: expected a value in \[3, 5\], got 6"):
        get_task("countdown", n_numbers=6)
    with pytest.raises(TypeError, match="digits: expected an int"):
        get_task("addition", digits="2")
    assert task_options("addition") == {"digits": 2, "seed": 0, "test_size": 200, "format": "auto",
                                        "chat_template": "auto", "system_prompt": None}


@pytest.mark.parametrize("name, options", VARIANTS)
def test_generator_contract(name, options):
    task = get_task(name, **options)
    assert isinstance(task, Task)
    test = task.test_set()
    assert test == get_task(name, **options).test_set()          # fixed across instances
    assert len({p.prompt for p in test}) == len(test) > 0          # no duplicates
    rng_a, rng_b = random.Random(1), random.Random(1)
    train = [task.sample(rng_a) for _ in range(300)]
    assert train == [task.sample(rng_b) for _ in range(300)]      # seeded stream
    if name != "addition" or options.get("digits", 2) > 1:
        assert not {p.prompt for p in train} & {p.prompt for p in test}  # held out
    alphabet = set(task.alphabet())
    for p in train[:100] + test[:100]:
        target = task.sft_target(p)
        assert task.reward(p, target) == 1.0, (p, target)
        assert set(p.prompt + target) <= alphabet
        for bad in ADVERSARIAL:
            assert task.reward(p, bad) == 0.0
    assert get_task(name, **options, seed=1).test_set() != test


def test_small_space_keeps_training_problems():
    task = get_task("addition", digits=1)
    assert len(task.test_set()) == 50          # at most half of the 100 problems
    rng = random.Random(0)
    test = {p.prompt for p in task.test_set()}
    assert sum(task.sample(rng).prompt not in test for _ in range(200)) == 200


def test_addition_reward_brute_force():
    task = get_task("addition")
    rng = random.Random(0)
    for _ in range(200):
        p = task.sample(rng)
        a, b = map(int, re.fullmatch(r"(\d+)\+(\d+)=", p.prompt).groups())
        assert p.answer == str(a + b)
        assert task.reward(p, f" {a + b}\n") == 1.0
        assert task.reward(p, str(a + b + 1)) == 0.0
        assert task.reward(p, f"{a + b}0") == 0.0
        assert task.reward(p, f"x={a + b}") == 0.0


def test_multiplication_scratchpad():
    task = get_task("multiplication", digits=3)
    rng = random.Random(0)
    for _ in range(50):
        p = task.sample(rng)
        a, b = map(int, re.fullmatch(r"(\d+)\*(\d+)=", p.prompt).groups())
        target = task.sft_target(p)
        *steps, total = target.split(",")
        partial = [int(d) * 10 ** i for i, d in enumerate(reversed(str(b)))]
        assert steps == [f"{a}*{s}={a * s}" for s in partial]
        assert total == "+".join(str(a * s) for s in partial) + f"={a * b}"
        assert len(target) >= 30                         # tens of tokens
        assert task.reward(p, f"wrong work={a * b}") == 1.0   # only the final answer is checked
        assert task.reward(p, target[:-1]) == 0.0
        assert task.reward(p, f"{a * b}=0") == 0.0
    plain = get_task("multiplication", scratchpad=False)
    p = plain.sample(rng)
    assert plain.sft_target(p) == p.answer and plain.reward(p, "1=" + p.answer) == 0.0


def _countdown(numbers, target):
    return Problem(",".join(map(str, numbers)) + f":{target}=", str(target), {"numbers": numbers, "target": target})


@pytest.mark.parametrize("response, reward", [
    ("2+3", 1), ("(2+3)", 1), ("3+2", 1), ("4/2+3", 1), ("2*4-3", 1), ("4-2+3", 1), (" 2 + 3 ", 1),
    ("3+3-1", 0), ("4+1", 0), ("2*2+1", 0), ("5", 0), ("10/2", 0), ("2+3+0", 0), ("2+3.0", 1),
    ("2+3.5", 0), ("2+3=5", 0), ("(2+3", 0), ("__import__('os')", 0), ("4*4/4+1", 0),
])
def test_countdown_reward_rules(response, reward):
    task = get_task("countdown")
    assert task.reward(_countdown([2, 3, 4], 5), response) == reward


def test_countdown_generator_is_solvable():
    task = get_task("countdown", n_numbers=4, max_target=500)
    rng = random.Random(3)
    for _ in range(300):
        p = task.sample(rng)
        numbers, target = p.meta["numbers"], p.meta["target"]
        solution = task.sft_target(p)
        assert 1 <= target <= 500 and len(numbers) == 4
        assert safe_eval(solution) == target
        assert Counter(int(n) for n in re.findall(r"\d+", solution)) == Counter(numbers)  # uses every number once
        assert p.prompt == ",".join(map(str, numbers)) + f":{target}="


def test_countdown_refuses_a_target_range_its_draws_almost_never_reach():
    """Generation is rejection sampling: max_number=10000 with max_target=2 took ~0.4 s a problem
    (minutes for a test set). Options under which fewer than 2 of 2,000 trial draws land are refused,
    naming both; a narrow range that is still reached often enough is accepted."""
    with pytest.raises(ValueError, match=r"max_target: with n_numbers=3 and max_number=10000, \d of 2000 random "
                                         r"expressions came out at or below max_target=2"):
        get_task("countdown", max_number=10000, max_target=2)
    task = get_task("countdown", max_number=10000, max_target=10 ** 6, test_size=5)
    assert all(p.meta["target"] <= 10 ** 6 for p in task.test_set())


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(1, 12), min_size=3, max_size=5), st.data())
def test_countdown_reward_matches_brute_force(numbers, data):
    """reward == [value == target] for expressions over a sub-multiset of the numbers."""
    chosen = data.draw(st.permutations(numbers)).copy()[: data.draw(st.integers(1, len(numbers)))]
    ops = data.draw(st.lists(st.sampled_from("+-*/"), min_size=len(chosen) - 1, max_size=len(chosen) - 1))
    expr = str(chosen[0]) + "".join(op + str(n) for op, n in zip(ops, chosen[1:]))
    value = _left_to_right_with_precedence(chosen, ops)
    target = data.draw(st.integers(1, 50))
    expected = float(value is not None and value == target)
    assert get_task("countdown").reward(_countdown(numbers, target), expr) == expected
    extra = max(numbers) + 1   # a number not given
    assert get_task("countdown").reward(_countdown(numbers, target), f"{expr}+{extra}-{extra}") == 0.0


def _left_to_right_with_precedence(nums, ops):
    """Reference evaluation: fold * and / first, then + and -, with Fractions."""
    terms, signs, current = [], ["+"], Fraction(nums[0])
    for op, n in zip(ops, nums[1:]):
        if op in "*/":
            if op == "/" and n == 0:
                return None
            current = current * n if op == "*" else current / n
        else:
            terms.append(current)
            signs.append(op)
            current = Fraction(n)
    terms.append(current)
    return sum(t if s == "+" else -t for s, t in zip(signs, terms))


def test_calculator_tool_output():
    task = get_task("calculator", max_tool_calls=2)
    assert task.tool_stop == "</calc>" and task.max_tool_calls == 2
    assert task.tool_output("<calc>12*3+4</calc>") == "<out>40</out>"
    assert task.tool_output("<calc>7/2</calc>") == "<out>7/2</out>"
    assert task.tool_output("<calc>1/0</calc>") == "<out>error</out>"
    assert task.tool_output("<calc>__import__('os')</calc>") == "<out>error</out>"
    assert task.tool_output("</calc>") == "<out>error</out>"
    assert task.tool_output("<calc>1+<calc>2*3</calc>") == "<out>6</out>"        # the last open tag
    assert task.tool_output("<calc>2*3") is None                                # call not closed
    assert task.tool_output("<answer>6</answer>") is None
    two = "<calc>1+1</calc><out>2</out><calc>2+2</calc>"
    assert task.tool_output(two) == "<out>4</out>"
    assert task.tool_output(two + "<out>4</out><calc>3+3</calc>") is None       # budget of 2 spent
    for bad in ADVERSARIAL:
        out = task.tool_output(bad + "</calc>")
        assert out is None or re.fullmatch(r"<out>[^<]*</out>", out)
    assert task.tool_output(None) is None


def test_calculator_reward_and_spans():
    task = get_task("calculator")
    p = task.sample(random.Random(0))
    target = task.sft_target(p)
    assert target == f"<calc>{p.meta['expr']}</calc><out>{p.answer}</out><answer>{p.answer}</answer>"
    assert p.answer == str(safe_eval(p.prompt[:-1]))
    assert task.reward(p, f"<answer>0</answer><answer> {p.answer} </answer>") == 1.0   # the last answer counts
    assert task.reward(p, f"<answer>{p.answer}</answer><answer>0</answer>") == 0.0
    assert task.reward(p, p.answer) == 0.0
    spans = tool_output_spans(target)
    assert [target[s:e] for s, e in spans] == [f"<out>{p.answer}</out>"]
    assert tool_output_spans("<out>1</out>x<out>2</out>") == [(0, 12), (13, 25)]


@given(st.fractions(max_denominator=12).filter(lambda x: abs(x) < 1000),
       st.fractions(max_denominator=12).filter(lambda x: abs(x) < 1000), st.booleans(), st.booleans(),
       st.sampled_from(["plain", "frac", "dfrac", "boxed"]))
@settings(max_examples=200, deadline=None)
def test_numeric_checker_compares_the_stated_values_exactly(gold, said, gold_as_decimal, unicode_minus, latex):
    """``numeric`` against the exact comparison of the two values, whatever the writing: the gold as
    a fraction "a/b" (or a decimal where it ends), the reply as "a/b" or LaTeX's \\frac{a}{b}, with
    the minus of rendered math."""
    from creditrl.tasks.checkers import check_numeric

    def fraction(x, form="plain"):
        if x.denominator == 1:
            return str(x.numerator)
        if form == "plain":
            return f"{x.numerator}/{x.denominator}"
        sign, body = "-" if x < 0 else "", f"{{{abs(x.numerator)}}}{{{x.denominator}}}"
        return f"{sign}\\dfrac{body}" if form == "dfrac" else f"{sign}\\frac{body}"

    terminating = all(p in (2, 5) for p in _prime_factors(gold.denominator))
    answer = str(gold.numerator / gold.denominator) if gold_as_decimal and terminating else fraction(gold)
    reply = f"So the value is {fraction(said, latex)}"
    if latex == "boxed":
        reply = f"So the value is $\\boxed{{{fraction(said, 'frac')}}}$."
    if unicode_minus:
        reply = reply.replace("-", "\u2212")
    assert check_numeric(None, reply, answer) == float(gold == said)
    if gold.denominator == 1:   # a gold with more text around its one number
        assert check_numeric(None, reply, f"${gold.numerator}$ apples") == float(gold == said)


def _prime_factors(n):
    out, p = set(), 2
    while n > 1:
        while n % p == 0:
            out.add(p)
            n //= p
        p += 1
    return out


@pytest.mark.parametrize("reply, answer, reward", [
    ("The answer is 1/4", "3/4", 0), ("So there are 4 of them", "3/4", 0), ("0.75", "3/4", 1),
    ("it is 3/4", "-3/4", 0), ("\u22125", "5", 0), ("\u22125", "-5", 1), ("dated 11/27/2026", "2026", 1),
    ("1e999999999", "1", 0), ("3/0", "0", 0), ("3/0", "3", 0), ("2.50", "2.5", 1), ("12.0", "12", 1),
    ("\\boxed{\\frac{3}{4}}", "0.75", 1), ("x = -\\frac{3}{4}.", "-3/4", 1), ("\\dfrac{1}{4}", "3/4", 0),
    ("\\frac12", "0.5", 1), ("0.75", "$\\frac{3}{4}$", 1), ("\\tfrac{6}{8}", "\\dfrac{3}{4}", 1),
    ("\\frac{1}{0}", "1", 0), ("\\frac{}{}", "1", 0),
    # a whole number against a fraction is a mixed number; a fraction of anything but numbers is left alone
    ("2.5", "2\\frac{1}{2}", 1), ("it is 2 \\frac{1}{2}", "2.5", 1), ("$2\\,\\frac12$", "2.5", 1),
    ("-2 \\frac{1}{2}", "-2.5", 1), ("x^2 \\frac{1}{2}", "0.5", 1), ("2\n\\frac{1}{2}", "2.5", 0), ("2.5", "2 \\frac{1}{2}", 1),
    ("3 \\frac{1}{-2}", "-0.5", 1), ("2\\frac{-1}{2}", "-0.5", 1), ("2 \\frac{+1}{2}", "0.5", 1),
    ("10.5", "2\\frac{1}{2}", 0), ("21/2", "2\\frac{1}{2}", 0), ("6.25", "$6\\frac{1}{4}$", 1),
    ("\\frac{x+1}{2}", "1/2", 0), ("\\frac{1}{2x}", "1/2", 0), ("x = \\frac{-1}{2}", "-0.5", 1),
    ("\\frac{1}{-2}", "-1/2", 1), ("2\\frac{1}{0}", "2", 0), ("x^2\\frac{1}{2}", "5/2", 0), ("is.\\frac{1}{2}", "0.5", 1),
    ("\\frac{" + "1" * 5000 + "}{3}", "1", 0), ("9" * 4299 + "\\frac{1}{3}", "1/3", 0),   # no int-digit limit error
])
def test_numeric_checker_cases(reply, answer, reward):
    from creditrl.tasks.checkers import check_numeric
    assert check_numeric(None, reply, answer) == reward
    assert check_numeric(None, reply, answer, tolerance=1e-9) == reward


@pytest.mark.parametrize("reply, answer, reward", [
    ("1000", "1 000", 1), ("1000", "1\\,000", 1), ("$\\boxed{1\\,000}$", "1000", 1), ("$\\boxed{1\\,000}$", "10", 0),
    ("$\\boxed{2\\,345\\,678}$", "2345678", 1), ("$\\boxed{12\u202f345}$", "12345", 1), ("1~000", "1000", 1),
    ("$\\boxed{3\\,1000}$", "31000", 0), ("$\\boxed{0.5}$", "1/2", 1), ("1000", "1,000", 1),
])
def test_math_checker_reads_thousands_grouped_by_thin_spaces(reply, answer, reward):
    """math-verify alone reads "1\\,000" (and a gold "1 000") as 1 times 000 = 0: grouped digits are
    one number; a group that is not 3 digits is not a grouping."""
    from creditrl.tasks.checkers import check_math
    assert check_math(None, reply, answer) == reward


def test_numeric_checker_refuses_answers_stating_no_single_number(tmp_path):
    rows = [{"prompt": "a", "answer": "1:2"}, {"prompt": "b", "answer": "2 or 3"}, {"prompt": "c", "answer": "3/4"}]
    with pytest.raises(ValueError, match=r"2 answer\(s\) the checker\(s\) \['numeric'\] cannot read "
                                         r"\(row 1: '1:2' states no single number; row 2: '2 or 3'"):
        get_task("jsonl", path=_write_jsonl(tmp_path / "d.jsonl", rows), checker="numeric")
    assert get_task("jsonl", path=_write_jsonl(tmp_path / "d.jsonl", rows), checker="exact")   # text is fine there


@pytest.mark.parametrize("name, options, reply, reward", [
    ("addition", {}, "56.0", 1), ("addition", {}, "\u221256", 0), ("addition", {}, "16 + 40 = 56", 1),
    ("addition", {}, "56.5", 0),
    ("multiplication", {"digits": 2}, "answer: 1665", 1), ("multiplication", {"digits": 2}, "ANSWER: **1,665**", 1),
    ("multiplication", {"digits": 2}, "Answer: 1665 (that is 37 x 45)", 1),
    ("multiplication", {"digits": 2}, "Answer: 1600. Let me check: 37*45 = 1665", 0),
    ("multiplication", {"digits": 2}, "Answer: 37 * 45 = 1665", 1),          # the product restated first
    ("multiplication", {"digits": 2}, "**Answer:** $37 \\times 45 = 1665$", 1),
    ("multiplication", {"digits": 2}, "Answer: 37 times 45 is 1665", 1),
    ("multiplication", {"digits": 2}, "Answer: 37 × 45 = 1600", 0),
    ("multiplication", {"digits": 2}, "\u0130\u0130 answer: 1665", 1),       # 'İ' lengthens when lowercased
    ("multiplication", {"digits": 2}, "37*45 = 1665", 0),     # the scratchpad asks for 'Answer: <number>'
])
def test_natural_checkers_read_what_instruct_models_write(name, options, reply, reward):
    task = get_task(name, format="natural", **options)
    answer = "56" if name == "addition" else "1665"
    meta = {"a": 16, "b": 40} if name == "addition" else {"a": 37, "b": 45}
    assert task.reward(Problem([{"role": "user", "content": "?"}], answer, meta), reply) == reward


@pytest.mark.parametrize("reply, reward", [
    ("<answer>2,001</answer>", 1), ("<answer>2001.0</answer>", 1), ("<answer> 2001 </answer>", 1),
    ("<answer>2,0,0,1</answer>", 0), ("<answer>2001.5</answer>", 0), ("<answer></answer>", 0),
])
def test_calculator_answer_is_read_as_a_number(reply, reward):
    assert get_task("calculator").reward(Problem("47*38+215=", "2001", {"expr": "47*38+215"}), reply) == reward
    negative = Problem("1-334=", "-333", {"expr": "1-334"})
    assert get_task("calculator").reward(negative, "<answer>\u2212333</answer>") == 1


def test_calculator_refuses_options_beyond_its_parser():
    """Every accepted (digits, n_terms) keeps the largest expression (every term 10^d - 1, every
    operator *) within safe_eval's bound, so generate never meets a value it cannot compute; the others
    are refused up front, naming n_terms."""
    from creditrl.tasks.safe_math import MAX_ABS

    for digits in range(1, 5):
        for n_terms in range(2, 7):
            largest = "*".join([str(10 ** digits - 1)] * n_terms)
            if (10 ** digits - 1) ** n_terms <= MAX_ABS:
                task = get_task("calculator", digits=digits, n_terms=n_terms, test_size=20)
                assert safe_eval(largest) is not None and len(task.test_set()) == 20
            else:
                assert safe_eval(largest) is None
                with pytest.raises(ValueError, match=rf"n_terms: with digits={digits} a product of {n_terms} terms"):
                    get_task("calculator", digits=digits, n_terms=n_terms)


@pytest.mark.parametrize("reply", ["\\boxed{3+7} \\times 5", ".5*2", "\\boxed{3+7*5", "(3+7)*5" * 200])
def test_countdown_natural_checker_writes_no_expression_of_its_own(reply):
    """What the stripping reads keeps the reply's grouping (a box is a parenthesis) and its literals;
    a last line too long to be an expression (1,000 characters) is not parsed at all."""
    task = get_task("countdown", format="natural")
    problem = Problem([{"role": "user", "content": "?"}], "38", {"numbers": [3, 5, 7], "target": 38})  # 3+7*5
    problem5 = Problem([{"role": "user", "content": "?"}], "10", {"numbers": [2, 5], "target": 10})   # 5*2
    assert task.reward(problem, reply) == 0.0 and task.reward(problem5, reply) == 0.0


def test_countdown_natural_checker_is_linear_in_the_reply():
    from creditrl.tasks.countdown import natural_expression
    assert natural_expression("\\boxed{" * 100) == "\\boxed{" * 100 and natural_expression("x" * 100_000) == ""
    assert natural_expression("\\boxed{" * 100 + "3+7}") == "\\boxed{" * 99 + "(3+7)"


def test_a_training_stream_mostly_held_out_still_trains():
    """test_size just under the space: the held-out set holds ~95% of the draws' probability, so a
    training prompt takes ~20 draws; sample() keeps drawing (it gave up after 100 and returned a
    held-out prompt, ~1 call in 300) and never returns a held-out prompt."""
    task = get_task("countdown", max_number=3, test_size=170)
    test = {p.prompt for p in task.test_set()}
    rng = random.Random(0)
    assert len(test) == 170 and not any(task.sample(rng).prompt in test for _ in range(3000))


@pytest.mark.parametrize("reply", [
    "(3 + 7) * 5", "$(3 + 7) \\times 5$", "$(3 + 7) \\cdot 5 = 50$", "\\((3 + 7) \\times 5\\)",
    "\\boxed{(3 + 7) * 5}", "(3 + 7) * 5.", "Answer: (3 + 7) * 5", "**Answer:** (3 + 7) * 5", "(3 + 7) \u00b7 5",
    "(3 + 7) x 5", "(3 + 7) \u00d7 5", "Let me think.\n\n`(3+7)*5 = 50`",
])
def test_countdown_natural_checker_reads_latex_and_labels(reply):
    task = get_task("countdown", format="natural")
    problem = Problem([{"role": "user", "content": "?"}], "50", {"numbers": [3, 5, 7], "target": 50})
    assert task.reward(problem, reply) == 1.0
    assert task.reward(problem, reply.replace("5", "7")) == 0.0      # a wrong expression stays wrong


def test_a_small_space_holds_out_half_and_never_trains_on_it():
    task = get_task("countdown", max_number=2)
    with pytest.warns(UserWarning, match=r"only about 38 distinct problems, fewer than test_size=200 .* holding out 19"):
        test = {p.prompt for p in task.test_set()}
    rng = random.Random(0)
    assert len(test) == 19 and not any(task.sample(rng).prompt in test for _ in range(300))
    task.generate = lambda rng: Problem(next(iter(test)), "0")      # nothing left to train on: an error, not a held-out prompt
    with pytest.raises(ValueError, match=r"10000 draws in a row gave only held-out problems.*lower test_size"):
        task.sample(rng)


@pytest.mark.parametrize("name, options, error", [
    ("addition", {"test_size": True}, r"test_size: expected a positive int, got True"),
    ("addition", {"seed": 1.5}, r"seed: expected an int, got float 1.5"),
    ("countdown", {"seed": [1]}, r"seed: expected an int, got list"),
])
def test_task_seed_and_test_size_are_checked(name, options, error):
    with pytest.raises((TypeError, ValueError), match=error):
        get_task(name, **options)


# --- jsonl -------------------------------------------------------------------------------

def _write_jsonl(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(path)


ROWS = [{"prompt": f"q{i}", "answer": str(i), "question": f"Q{i}", "gold": f"\\frac{{{i}}}{{2}}"} for i in range(40)]


def test_jsonl_split_is_deterministic_and_disjoint(tmp_path):
    path = _write_jsonl(tmp_path / "d.jsonl", ROWS)
    task = get_task("jsonl", path=path, test_fraction=0.25)
    test, train = task.test_set(), task.train_set()
    assert len(test) == 10 and len(train) == 30
    assert {p.prompt for p in test} | {p.prompt for p in train} == {r["prompt"] for r in ROWS}
    assert not {p.prompt for p in test} & {p.prompt for p in train}
    assert get_task("jsonl", path=path, test_fraction=0.25).test_set() == test
    assert get_task("jsonl", path=path, test_fraction=0.25, seed=1).test_set() != test
    rng = random.Random(0)
    assert all(task.sample(rng) in train for _ in range(100))
    p = train[0]
    assert task.reward(p, f" {p.answer}\n") == 1.0 and task.reward(p, p.answer + "0") == 0.0
    assert set(task.alphabet()) == set("".join(r["prompt"] + r["answer"] for r in ROWS))
    assert task.fingerprint()["data_sha256"]


def test_jsonl_parquet_and_keys(tmp_path):
    import datasets

    path = tmp_path / "d.parquet"
    datasets.Dataset.from_list(ROWS).to_parquet(str(path))
    task = get_task("jsonl", path=str(path), prompt_key="question", answer_key="gold", checker="math")
    p = task.test_set()[0]
    half = Fraction(int(p.prompt[1:]), 2)
    assert p.prompt.startswith("Q")
    assert task.reward(p, f"The answer is $\\boxed{{{float(half)}}}$") == 1.0
    assert task.reward(p, f"\\boxed{{{float(half) + 1}}}") == 0.0
    for bad in ADVERSARIAL:
        assert task.reward(p, bad) == 0.0


def test_jsonl_numeric_checker(tmp_path):
    path = _write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "answer": "1,000.5"}, {"prompt": "b", "answer": "2"}])
    task = get_task("jsonl", path=path, checker="numeric", tolerance=1e-3)
    p = Problem("a", "1,000.5")
    assert task.reward(p, "so it is 1000.5004") == 1.0
    assert task.reward(p, "1000.6") == 0.0
    exact = get_task("jsonl", path=path, checker="numeric")            # default: exact comparison
    assert exact.reward(p, "1000.5004") == 0.0 and exact.reward(p, "1,000.50") == 1.0
    assert task.reward(p, "inf") == 0.0 and task.reward(p, "1e999") == 0.0
    for bad in ADVERSARIAL:
        assert task.reward(p, bad) == 0.0


def test_jsonl_user_checker(tmp_path, monkeypatch):
    (tmp_path / "my_reward.py").write_text(
        "def score(prompt, response, answer):\n"
        "    if response == 'boom':\n        raise RuntimeError('bad')\n"
        "    if response == 'nan':\n        return float('nan')\n"
        "    return 0.5 if answer in response else 0.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    path = _write_jsonl(tmp_path / "d.jsonl", ROWS)
    task = get_task("jsonl", path=path, checker="my_reward:score")
    p = Problem("q7", "7")
    assert task.reward(p, "it is 7") == 0.5 and task.reward(p, "it is 8") == 0.0
    assert math.isnan(task.reward(p, "nan"))      # the rollout counts NaN as 0 and logs it
    with pytest.warns(UserWarning, match="raised RuntimeError"):
        assert math.isnan(task.reward(p, "boom"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert math.isnan(task.reward(p, "boom"))   # warned once only
    sys.modules.pop("my_reward", None)


def test_jsonl_errors(tmp_path):
    path = _write_jsonl(tmp_path / "d.jsonl", ROWS)
    with pytest.raises(FileNotFoundError, match="no such file"):
        get_task("jsonl", path=str(tmp_path / "missing.jsonl"))
    with pytest.raises(ValueError, match=r"answer_key: column 'label' not in d.jsonl; columns are \["):
        get_task("jsonl", path=path, answer_key="label")
    with pytest.raises(ValueError, match=r"checker: unknown value 'regex'; valid values are \['exact'"):
        get_task("jsonl", path=path, checker="regex")
    with pytest.raises(ValueError, match="checker: cannot import module .no_such_mod. of .no_such_mod:f."):
        get_task("jsonl", path=path, checker="no_such_mod:f")
    with pytest.raises(ValueError, match="test_fraction"):
        get_task("jsonl", path=path, test_fraction=1.0)
    (tmp_path / "d.csv").write_text("prompt,answer\n")
    with pytest.raises(ValueError, match="path: expected a file ending in"):
        get_task("jsonl", path=str(tmp_path / "d.csv"))
    one = _write_jsonl(tmp_path / "one.jsonl", ROWS[:1])
    with pytest.raises(ValueError, match=r"at least 2 distinct prompts to split into train/test, got 1 in 1 row"):
        get_task("jsonl", path=one)


@pytest.mark.parametrize("value", [-5, 0, 2.5, "abc", True])
def test_jsonl_test_size_is_checked(tmp_path, value):
    """Case 6: test_size=-5 held out 95 of 100 rows (order[:-5]); 2.5 and 'abc' raised tracebacks."""
    from creditrl.config import load_config
    from creditrl.recipe.build import build_task

    path = _write_jsonl(tmp_path / "d.jsonl", ROWS)
    with pytest.raises(ValueError, match=rf"^test_size: expected a positive int \(held-out prompts\) or null, "
                                         rf"got {re.escape(repr(value))}$"):
        get_task("jsonl", path=path, test_size=value)
    cfg = load_config(None, ["task.name=jsonl", f"task.options.path={path}", f"task.options.test_size={value}"])
    with pytest.raises(ValueError, match=r"^task.options.test_size: expected a positive int"):
        build_task(cfg)
    assert len(get_task("jsonl", path=path, test_size=3).test_set()) == 3


def test_jsonl_repeated_prompts_stay_on_one_side_of_the_split(tmp_path):
    """Case 7: a file with repeated rows put the same prompts in the training and held-out sets. The
    split is by distinct prompt, with a warning giving the count; a file without repeats splits as before."""
    rows = [{"prompt": f"q{i % 20}", "answer": str(i)} for i in range(60)]        # every prompt 3 times
    path = _write_jsonl(tmp_path / "d.jsonl", rows)
    with pytest.warns(UserWarning, match=r"d.jsonl: 40 of 60 rows repeat the prompt of another row; the "
                                         r"train/held-out split is by distinct prompt \(20\)"):
        task = get_task("jsonl", path=path, test_fraction=0.25)
    test, train = task.test_set(), task.train_set()
    assert not {p.prompt for p in test} & {p.prompt for p in train}
    assert len({p.prompt for p in test}) == 5 and len(test) == 15 and len(train) == 45
    unique = _write_jsonl(tmp_path / "u.jsonl", ROWS)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        split = get_task("jsonl", path=unique, test_fraction=0.25)
    order = list(range(len(ROWS)))
    random.Random(0).shuffle(order)          # the split of the rows as before, without repeats
    assert [p.prompt for p in split.test_set()] == [ROWS[i]["prompt"] for i in order[:10]]


def test_empty_parquet_says_it_has_no_rows(tmp_path):
    """Case 22: a Parquet file with a schema and 0 rows was reported as 'cannot read it as Parquet'."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "empty.parquet"
    pq.write_table(pa.table({"prompt": pa.array([], pa.string()), "answer": pa.array([], pa.string())}), path)
    with pytest.raises(ValueError, match=r"^path: empty.parquet has no rows; expected a Parquet file with prompt"):
        get_task("jsonl", path=str(path))
    (tmp_path / "junk.parquet").write_text("not parquet")
    with pytest.raises(ValueError, match=r"^path: junk.parquet: cannot read it as Parquet"):
        get_task("jsonl", path=str(tmp_path / "junk.parquet"))


# --- a user's task by import path, chat prefills ----------------------------------------

USER_TASKS = '''
from creditrl.tasks.arithmetic import Addition

def make(digits=1, seed=0, test_size=20):
    return Addition(digits=digits, seed=seed, test_size=test_size, format="compact")

class Doubled(Addition):
    name = "doubled"

    def reward(self, problem, response):
        return 2 * super().reward(problem, response)

def anything(**options):
    return make(**options)

def broken(**options):
    return object()

class Moody(Addition):
    name = "moody"

    def reward(self, problem, response):
        if response == "none":
            return None
        if response == "boom":
            raise KeyError(response)
        return super().reward(problem, response)

NOT_CALLABLE = 3
'''


@pytest.fixture
def user_tasks(tmp_path, monkeypatch):
    (tmp_path / "my_tasks.py").write_text(USER_TASKS)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    sys.modules.pop("my_tasks", None)


def test_user_task_by_import_path(user_tasks):
    from creditrl.config import load_config

    task = get_task("my_tasks:make", digits=2)
    assert task.name == "addition" and task.options["digits"] == 2
    assert task_options("my_tasks:make") == {"digits": 1, "seed": 0, "test_size": 20}
    doubled = get_task("my_tasks:Doubled", digits=1, chat_model=True)       # a class: format=auto resolved
    p = doubled.test_set()[0]
    assert doubled.format == "natural" and doubled.reward(p, p.answer) == 2.0
    assert get_task("my_tasks:anything", digits=1).options["digits"] == 1  # **options: passed on as is
    with pytest.raises(ValueError, match=r"task 'my_tasks:make': unknown option\(s\) \['nope'\]"):
        get_task("my_tasks:make", nope=1)
    with pytest.raises(ValueError, match=r"'my_tasks:broken' returned a object without \['name', .*'sample\(\)'"):
        get_task("my_tasks:broken")
    with pytest.raises(ValueError, match=r"task.name: 'my_tasks:NOT_CALLABLE' is a int"):
        get_task("my_tasks:NOT_CALLABLE")
    with pytest.raises(ValueError, match=r"task.name: cannot import module 'no_such_tasks'"):
        get_task("no_such_tasks:make")
    assert load_config(None, ["task.name=my_tasks:make"]).task.name == "my_tasks:make"
    with pytest.raises(ValueError, match=r"unknown task 'my_tasks'; valid tasks are .* or a user's task as 'package"):
        get_task("my_tasks")


def test_a_user_tasks_bad_reward_is_invalid_and_named(user_tasks):
    """None is no reward (NaN, as for a checker); a raise is an invalid reward with a warning naming the
    task, not a crash of the run."""
    from creditrl.tasks.rewards import score_responses

    task = get_task("my_tasks:Moody", digits=1)
    p = task.test_set()[0]
    with pytest.warns(UserWarning, match=r"task 'moody': reward\(\) raised KeyError; counting reward 0"):
        rewards = score_responses(task, [p] * 3, [p.answer, "none", "boom"]).rewards
    assert rewards[0] == 1.0 and math.isnan(rewards[1]) and math.isnan(rewards[2])


def test_user_task_trains(user_tasks, tiny_chat_model_dir, tmp_path):
    from creditrl.config import load_config
    from creditrl.trainer import train

    cfg = load_config(None, [f"model.name={tiny_chat_model_dir}", "task.name=my_tasks:Doubled", "train.steps=1",
                             "rollout.group_size=2", "rollout.prompts_per_step=2", "train.eval_problems=2",
                             "train.eval_samples=1", "logging.report_to=[jsonl]", "logging.plots=false",
                             "logging.progress=false", f"train.output_dir={tmp_path}", "algorithm.estimator=grpo"])
    run = train(cfg)
    assert run.name.startswith("my_tasks-Doubled-grpo-s0-")
    assert (run / "metrics.jsonl").read_text().count("\n") == 1


def test_chat_prefill_is_continued(tiny_chat_model_dir):
    """TRL's convention: a final assistant message is continued, not closed with a new turn opened."""
    from transformers import AutoTokenizer

    from creditrl.tasks.chat import render_prompt

    tok = AutoTokenizer.from_pretrained(tiny_chat_model_dir)
    question = [{"role": "user", "content": "What is 2+2?"}]
    prefill = question + [{"role": "assistant", "content": "Let me think step by step:"}]
    opened = "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(render_prompt(tok, question)) == opened
    assert tok.decode(render_prompt(tok, prefill)) == opened + "Let me think step by step:"
    assert tok.decode(render_prompt(tok, prefill, system_prompt="Be brief.")) == \
        "<|im_start|>system\nBe brief.<|im_end|>\n" + opened + "Let me think step by step:"
    trl = pytest.importorskip("trl")
    assert trl.apply_chat_template({"prompt": prefill}, tok)["prompt"] == opened + "Let me think step by step:"
