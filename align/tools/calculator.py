"""The built-in calculator tool: arithmetic over a parsed expression, never `eval`.

    calculate("10/5*3")        -> "6"
    calculate("(12.5 - 2) * 4") -> "42"
    calculate("7 / 3")          -> "2.333333333333"
    calculate("2 ** 10 ** 10")  -> "error: a power's exponent must be a whole number of at most 1000"
    calculate("__import__('os')") -> "error: only numbers and + - * / // % ** ( ) are allowed"

The expression is parsed with Python's `ast` and only these nodes are walked: numbers (int, float), + - * / // %
** and unary ± over them, parentheses. Every value is an exact Fraction (0.1 + 0.2 is 0.3), so the result does
not depend on float rounding; the answer is an integer where the value is one, else a decimal of at most 12
places with trailing zeros removed. Bounds, so that a policy's expression costs microseconds, never the run:
at most MAX_CHARS characters and MAX_NODES syntax nodes, a power's exponent an integer of at most
MAX_EXPONENT, and no value over MAX_DIGITS digits (checked before a power or product is formed). Every failure is
an "error: ..." string: what the tool answers the policy, not an exception in the trainer.
"""

from __future__ import annotations

import ast
import math
import operator
from dataclasses import dataclass
from fractions import Fraction

from align.rollout.env import Step
from align.tools.tagged import TaggedTool

MAX_CHARS = 200
MAX_NODES = 64
MAX_EXPONENT = 1000
MAX_DIGITS = 10_000
PLACES = 12

BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
          ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: None}
UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalcError(ValueError):
    pass


def digits(x: Fraction) -> int:
    """Decimal digits of the larger of x's numerator and denominator (an upper bound on what printing costs)."""
    return max(abs(x.numerator), x.denominator).bit_length() * 30103 // 100000 + 1


def _power(base: Fraction, exponent: Fraction) -> Fraction:
    if exponent.denominator != 1 or abs(exponent) > MAX_EXPONENT:
        raise CalcError(f"a power's exponent must be a whole number of at most {MAX_EXPONENT}")
    if base == 0 and exponent < 0:
        raise CalcError("division by zero")
    if digits(base) * abs(int(exponent)) > MAX_DIGITS:
        raise CalcError(f"a power over {MAX_DIGITS} digits")
    return base ** int(exponent)


def _binary(op: type, a: Fraction, b: Fraction) -> Fraction:
    if op is ast.Pow:
        return _power(a, b)
    if op in (ast.Div, ast.FloorDiv, ast.Mod) and b == 0:
        raise CalcError("division by zero")
    if op is ast.Mult and digits(a) + digits(b) > MAX_DIGITS:
        raise CalcError(f"a product over {MAX_DIGITS} digits")
    return Fraction(BINARY[op](a, b))


def _value(node: ast.AST) -> Fraction:
    """The exact value of an expression node; CalcError for anything but numbers and arithmetic."""
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        if isinstance(node.value, float) and not math.isfinite(node.value):
            raise CalcError("numbers must be finite")
        return Fraction(node.value) if isinstance(node.value, int) else Fraction(repr(node.value))
    if isinstance(node, ast.BinOp) and type(node.op) in BINARY:
        result = _binary(type(node.op), _value(node.left), _value(node.right))
    elif isinstance(node, ast.UnaryOp) and type(node.op) in UNARY:
        result = UNARY[type(node.op)](_value(node.operand))
    else:
        raise CalcError("only numbers and + - * / // % ** ( ) are allowed")
    if digits(result) > MAX_DIGITS:
        raise CalcError(f"a value over {MAX_DIGITS} digits")
    return result


def evaluate(expression: str) -> Fraction:
    """The exact value of an arithmetic expression (CalcError: why it has none)."""
    text = expression.strip().replace("×", "*").replace("÷", "/").replace("−", "-").replace("^", "**")
    if not text:
        raise CalcError("empty expression")
    if len(text) > MAX_CHARS:
        raise CalcError(f"expression over {MAX_CHARS} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError):
        raise CalcError(f"cannot parse {text!r}") from None
    if sum(1 for _ in ast.walk(tree)) > MAX_NODES:
        raise CalcError(f"expression over {MAX_NODES} parts")
    return _value(tree.body)


def show(x: Fraction) -> str:
    """An integer as it is; else a decimal rounded to PLACES places, trailing zeros removed."""
    if x.denominator == 1:
        return str(x.numerator)
    sign, x = ("-" if x < 0 else ""), abs(x)
    scaled = round(x * 10**PLACES)
    whole, frac = divmod(scaled, 10**PLACES)
    text = f"{whole}.{frac:0{PLACES}d}".rstrip("0").rstrip(".")
    return sign + text if text != "0" else "0"


def calculate(expression: str) -> str:
    """The calculator tool: the value of an arithmetic expression as text, or "error: ..." (never raises)."""
    try:
        return show(evaluate(expression))
    except CalcError as e:
        return f"error: {e}"
    except (ArithmeticError, RecursionError, MemoryError) as e:  # a deep nesting within MAX_NODES cannot recurse this
        return f"error: {type(e).__name__}"


@dataclass
class CalculatorEnv(TaggedTool):
    """The built-in calculator as an environment: a turn that ends with `<calc>EXPR</calc>` is answered with
    `<out>VALUE</out>` (exact, bounded, never `eval`; an error is answered too: the policy's mistake); any other
    turn is the final answer. The tags are plain text, so any tokenizer writes them."""

    open: str = "<calc>"
    close: str = "</calc>"

    def answer_call(self, body: str) -> Step:
        value = calculate(body)
        return Step(observation=self.answer.format(value), tool_call=True, tool_error=value.startswith("error:"))
