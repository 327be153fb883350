"""safe_eval: exact values on valid input, None (never an exception) on anything else."""
import operator
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from creditrl.tasks.safe_math import MAX_ABS, format_number, literals, safe_eval


@pytest.mark.parametrize("expr, value", [
    ("1+2*3", 7), ("(1+2)*3", 9), ("10-4-3", 3), ("8/4/2", 1), ("7/2", Fraction(7, 2)),
    ("-3+5", 2), ("--3", 3), ("-(2+3)*2", -10), ("2*-3", -6), (" 12 × 3 ÷ 4 − 1 ", 8),
    ("1.5*2", 3), ("0.1+0.2", Fraction(3, 10)), ("007", 7), ("((((4))))", 4),
])
def test_values(expr, value):
    assert safe_eval(expr) == value


ADVERSARIAL = [
    "__import__('os').system('ls')", "1e999999", "9**9**9", "2**10", "2^3", "1e5", "0x10", "1_000",
    "(" * 1000 + "1" + ")" * 1000, "-" * 100 + "1", "1+" * 10000 + "1", "9" * 16,
    "99999999*99999999*99999999", "1/3/7/11/13/17/19/23/29/31/37/41/43/47/53",
    "１２+３", "١٢٣", "²", "1\x002", "\x00", "", "   ", "1/0", "1/(2-2)", "0/0", "1 2", "()", "(1", "1)",
    "3.", ".5", "1..2", "+1", "1+", "*2", "lambda: 1", "True", "inf", "nan", "[1]", "1;2", "'1'", "1,2",
    "\ud800", "1\n+\t2", "1" * 300,
]


@pytest.mark.parametrize("expr", ADVERSARIAL)
def test_adversarial_rejected_or_bounded(expr):
    value = safe_eval(expr)
    if expr == "1\n+\t2":
        assert value == 3
    else:
        assert value is None


@pytest.mark.parametrize("bad", [None, 12, b"1+2", ["1"]])
def test_non_string_rejected(bad):
    assert safe_eval(bad) is None


def test_bounds_are_options():
    assert safe_eval("1+1", max_len=2) is None
    assert safe_eval("((1))", max_depth=1) is None and safe_eval("((1))", max_depth=2) == 1
    assert safe_eval("1000*1000", max_abs=10 ** 5) is None
    assert safe_eval("9" * 15) == 10 ** 15 - 1 and safe_eval("9" * 16) is None
    assert safe_eval("1000000*1000000000") == MAX_ABS and safe_eval("1000000*1000000000*10") is None


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=60))
def test_arbitrary_text_never_raises(text):
    value = safe_eval(text)
    assert value is None or isinstance(value, Fraction)


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet="0123456789+-*/()×÷−. ", max_size=40))
def test_near_valid_text_never_raises(text):
    value = safe_eval(text)
    assert value is None or (abs(value.numerator) <= MAX_ABS and value.denominator <= MAX_ABS)


OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv}


def _trees(depth=4):
    leaf = st.integers(0, 999).map(lambda n: (str(n), Fraction(n)))

    def combine(children):
        return st.tuples(children, st.sampled_from("+-*/"), children, st.sampled_from(["", " "])).map(_apply)

    return st.recursive(leaf, combine, max_leaves=8)


def _apply(args):
    (ltext, lval), op, (rtext, rval), space = args
    if lval is None or rval is None or (op == "/" and rval == 0):
        value = None
    else:
        value = OPS[op](lval, rval)
        if abs(value.numerator) > MAX_ABS or value.denominator > MAX_ABS:
            value = None  # the documented bound on every intermediate value
    return f"({ltext}{space}{op}{space}{rtext})", value


@settings(max_examples=300, deadline=None)
@given(_trees())
def test_matches_fraction_reference(tree):
    text, reference = tree
    assert safe_eval(text) == reference


@settings(max_examples=200, deadline=None)
@given(st.fractions(max_denominator=10 ** 6).filter(lambda x: abs(x.numerator) < 10 ** 12))
def test_format_number_round_trip(x):
    assert safe_eval(format_number(x)) == x


def test_literals():
    assert literals("(3+14)*2.5") == [3, 14, Fraction(5, 2)]
    assert literals("3+a") is None
