"""Safe arithmetic for model output: a hand-written recursive-descent parser, no ``eval``.

Grammar (whitespace between tokens is ignored)::

    expr   := term (("+" | "-" | "−") term)*
    term   := unary (("*" | "×" | "/" | "÷") unary)*
    unary  := "-" unary | "−" unary | atom
    atom   := NUMBER | "(" expr ")"
    NUMBER := ASCII digits, optionally "." and more ASCII digits (no exponent, no sign)

Everything else (names, calls, ``**``, exponents, unicode digits, NUL bytes) is rejected.
Values are exact ``Fraction``s; every intermediate numerator and denominator is bounded by
``max_abs`` so no input can blow up time or memory. ``safe_eval`` never raises: any rejected
or undefined input (division by zero, too long, too deep, too large) gives ``None``.
"""
from __future__ import annotations

from fractions import Fraction

MAX_LEN = 256          # characters
MAX_DEPTH = 32         # nested parentheses + unary minus chain
MAX_DIGITS = 15        # per number literal
MAX_ABS = 10 ** 15     # bound on |numerator| and denominator of every intermediate value

_ADD = {"+": "+", "-": "-", "−": "-"}
_MUL = {"*": "*", "×": "*", "/": "/", "÷": "/"}
_SPACE = " \t\n"
_DIGITS = "0123456789"


class _Reject(Exception):
    """Internal: the input is not a bounded arithmetic expression."""


def tokenize(expr: str, max_len: int = MAX_LEN, max_digits: int = MAX_DIGITS) -> list[str | Fraction] | None:
    """Split ``expr`` into number literals (as ``Fraction``) and canonical operator/paren
    characters (``+ - * / ( )``); ``None`` if any character is outside the grammar."""
    if not isinstance(expr, str) or len(expr) > max_len:
        return None
    tokens: list[str | Fraction] = []
    i, n = 0, len(expr)
    while i < n:
        c = expr[i]
        if c in _SPACE:
            i += 1
        elif c in _DIGITS:
            j = i
            while j < n and expr[j] in _DIGITS:
                j += 1
            if j < n and expr[j] == ".":
                j += 1
                if j >= n or expr[j] not in _DIGITS:
                    return None  # "3." is not a number
                while j < n and expr[j] in _DIGITS:
                    j += 1
            literal = expr[i:j]
            if sum(ch in _DIGITS for ch in literal) > max_digits:
                return None
            tokens.append(Fraction(literal))
            i = j
        elif c in _ADD:
            tokens.append(_ADD[c])
            i += 1
        elif c in _MUL:
            tokens.append(_MUL[c])
            i += 1
        elif c in "()":
            tokens.append(c)
            i += 1
        else:
            return None
    return tokens


class _Parser:
    def __init__(self, tokens: list[str | Fraction], max_depth: int, max_abs: int):
        self.tokens, self.pos, self.depth = tokens, 0, 0
        self.max_depth, self.max_abs = max_depth, max_abs

    def peek(self) -> str | Fraction | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def take(self) -> str | Fraction | None:
        tok = self.peek()
        self.pos += 1
        return tok

    def bounded(self, x: Fraction) -> Fraction:
        if abs(x.numerator) > self.max_abs or x.denominator > self.max_abs:
            raise _Reject
        return x

    def expr(self) -> Fraction:
        value = self.term()
        while self.peek() in ("+", "-"):
            op = self.take()
            rhs = self.term()
            value = self.bounded(value + rhs if op == "+" else value - rhs)
        return value

    def term(self) -> Fraction:
        value = self.unary()
        while self.peek() in ("*", "/"):
            op = self.take()
            rhs = self.unary()
            if op == "/" and rhs == 0:
                raise _Reject
            value = self.bounded(value * rhs if op == "*" else value / rhs)
        return value

    def nested(self, parse) -> Fraction:
        self.depth += 1
        if self.depth > self.max_depth:
            raise _Reject
        value = parse()
        self.depth -= 1
        return value

    def unary(self) -> Fraction:
        if self.peek() == "-":
            self.take()
            return -self.nested(self.unary)
        return self.atom()

    def atom(self) -> Fraction:
        tok = self.take()
        if isinstance(tok, Fraction):
            return self.bounded(tok)
        if tok == "(":
            value = self.nested(self.expr)
            if self.take() != ")":
                raise _Reject
            return value
        raise _Reject


def safe_eval(expr: str, *, max_len: int = MAX_LEN, max_depth: int = MAX_DEPTH,
              max_digits: int = MAX_DIGITS, max_abs: int = MAX_ABS) -> Fraction | None:
    """Exact value of an arithmetic expression, or ``None`` if it is rejected.

    Accepts numbers, ``+ - * /`` (also ``− × ÷``), parentheses and unary minus. Rejects
    inputs longer than ``max_len`` characters, nesting deeper than ``max_depth``, literals
    with more than ``max_digits`` digits, and any intermediate value whose numerator or
    denominator exceeds ``max_abs`` in magnitude. Division by zero gives ``None``.
    Never raises, whatever ``expr`` is.
    """
    tokens = tokenize(expr, max_len=max_len, max_digits=max_digits)
    if not tokens:
        return None
    parser = _Parser(tokens, max_depth=max_depth, max_abs=max_abs)
    try:
        value = parser.expr()
    except (_Reject, RecursionError, ZeroDivisionError):
        return None
    return value if parser.pos == len(tokens) else None


def literals(expr: str, *, max_len: int = MAX_LEN, max_digits: int = MAX_DIGITS) -> list[Fraction] | None:
    """The number literals of ``expr`` in order (``None`` if it does not tokenize)."""
    tokens = tokenize(expr, max_len=max_len, max_digits=max_digits)
    return None if tokens is None else [t for t in tokens if isinstance(t, Fraction)]


def format_number(x: Fraction) -> str:
    """Canonical text of a value: ``"42"``, ``"-7"`` or ``"7/3"`` (which ``safe_eval`` reads back)."""
    return str(x.numerator) if x.denominator == 1 else f"{x.numerator}/{x.denominator}"
