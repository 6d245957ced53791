"""The built-in calculator tool: exact arithmetic over a parsed expression, nothing else, within bounds, and an
"error: ..." answer (never an exception) for anything it will not compute."""

import time

import pytest

from align.tools.calculator import MAX_CHARS, MAX_DIGITS, calculate, evaluate, show

PLACES_SLACK = 20  # a decimal's point, sign and places beside its MAX_DIGITS digits


@pytest.mark.parametrize("expression, want", [
    ("10/5*3", "6"), ("(12.5 - 2) * 4", "42"), ("7 / 3", "2.333333333333"), ("2/3", "0.666666666667"),
    ("0.1 + 0.2", "0.3"), ("-3 ** 2", "-9"), ("(-3) ** 2", "9"), ("2 ** -2", "0.25"), ("17 // 5", "3"),
    ("17 % 5", "2"), ("-7 // 2", "-4"), ("1234 * 5678", "7006652"), ("3 × 4 − 2", "10"), ("2^10", "1024"),
    ("1e3 + 1", "1001"), ("  +5 ", "5"), ("1/3 - 1/3", "0"), ("-1/3", "-0.333333333333"),
])
def test_values_by_hand(expression, want):
    assert calculate(expression) == want


@pytest.mark.parametrize("expression, why", [
    ("__import__('os').system('ls')", "only numbers"), ("x + 1", "only numbers"), ("abs(-2)", "only numbers"),
    ("(1).real", "only numbers"), ("[1, 2]", "only numbers"), ("'a' * 3", "only numbers"), ("1 < 2", "only numbers"),
    ("True + 1", "only numbers"), ("1 +", "cannot parse"), ("", "empty"), ("1 / 0", "division by zero"),
    ("5 % 0", "division by zero"), ("0 ** -1", "division by zero"), ("2 ** 0.5", "whole number"),
    ("2 ** 10 ** 10", "whole number"), ("12345678901 ** 1000", "power over"), ("1" * (MAX_CHARS + 1), "characters"),
    ("+".join(["1"] * 40), "parts"), ("1e400", "finite"),
])
def test_what_it_refuses_is_an_error_answer(expression, why):
    answer = calculate(expression)
    assert answer.startswith("error: ") and why in answer, answer


def test_every_bound_answers_fast():
    """The costliest expressions it accepts or refuses answer in milliseconds (no huge power, product or string)."""
    for expression in ("9 ** 1000 * 9 ** 1000", "(10 ** 999) ** 1000", "99999 ** 1000 * 99999 ** 1000 * 99999 ** 1000",
                       "((((((((((((((((((((1))))))))))))))))))))", "7 ** 1000 / 3 ** 1000"):
        start = time.perf_counter()
        answer = calculate(expression)
        assert time.perf_counter() - start < 0.5, expression
        assert answer.startswith("error: ") or len(answer) <= MAX_DIGITS + PLACES_SLACK, expression


def test_values_are_exact_fractions_and_shown_as_integers_or_decimals():
    from fractions import Fraction

    assert evaluate("0.1 * 3") == Fraction(3, 10) and evaluate("1/3 * 3") == 1
    assert show(Fraction(5, 1)) == "5" and show(Fraction(-1, 8)) == "-0.125" and show(Fraction(1, 10**13)) == "0"

