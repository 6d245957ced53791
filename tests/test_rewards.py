"""Verifiers: math answer extraction and comparison, sort rewards. Expectations are hand-written."""

import pytest

from align.errors import UserError
from align.rewards import (
    REWARDS,
    guess_verifier,
    parse_rewards,
    verify,
    extract_answer,
    math_reward,
    parse_int_list,
    parse_number,
    sort_inclusion_ordering_reward,
    sort_reward,
)

# (completion, reference answer, expected math_reward)
MATH_CASES = [
    ("23 + 45 = 68. #### 68", "68", 1.0),
    ("23 + 45 = 68. #### 67", "68", 0.0),
    ("#### 68.", "68", 1.0),
    ("#### $68 dollars", "68", 1.0),
    ("#### 68 apples in total!", "68", 1.0),
    ("####68", "68", 1.0),
    ("#### 68.0", "68", 1.0),
    ("#### 68.5", "68", 0.0),
    ("#### 1,000", "1000", 1.0),
    ("#### 1000", "1,000", 1.0),
    ("#### 1,234,567", "1234567", 1.0),
    ("#### -5", "-5", 1.0),
    ("#### -5", "5", 0.0),
    ("#### 5", "-5", 0.0),
    ("#### \u22125", "-5", 1.0),  # unicode minus
    ("#### +5", "5", 1.0),
    ("#### 3/4", "0.75", 1.0),
    ("#### 0.75", "3/4", 1.0),
    ("#### 1/3", "0.3333333333", 1.0),  # within the default tol
    ("#### 1/3", "0.33", 0.0),  # too far for the default tol
    ("#### 2/4", "1/2", 1.0),
    ("#### .5", "0.5", 1.0),
    ("#### abc", "68", 0.0),  # '####' followed by junk: no answer
    ("#### ", "68", 0.0),
    ("", "68", 0.0),
    ("I do not know.", "68", 0.0),
    ("First 12, then 30, finally 68", "68", 1.0),  # last number wins
    ("68 is wrong, the answer is 12", "68", 0.0),
    ("#### 68 #### 70", "70", 1.0),  # last '####' wins
    ("12 + 3 = 15 and 15 - 2 = 13. #### 13", "13", 1.0),
    ("#### 12 + 3", "12", 1.0),  # first number after '####'
    ("The answer is \\boxed{68}.", "68", 1.0),
    ("\\boxed{12} then \\boxed{68}", "68", 1.0),  # last box wins
    ("\\boxed{\\frac{3}{4}}", "0.75", 1.0),
    ("\\boxed{-\\dfrac{1}{2}}", "-0.5", 1.0),
    ("\\boxed{1{,}000}", "1000", 1.0),
    ("\\boxed{68 \\text{ apples}}", "68", 1.0),
    ("\\boxed{x}", "68", 0.0),  # a box with no number
    ("68-5", "5", 1.0),  # '-' after a digit is an operator, not a sign
    ("x = -5", "-5", 1.0),
    ("The total is 1,234.5 dollars.", "1234.5", 1.0),
    ("23 + 45 = 68", "#### 68", 1.0),  # a GSM8K-style reference is read like a completion
    ("#### 1/0", "1", 0.0),  # division by zero is not a number
    # an answer ending in a list of different numbers names none of them (repeating every candidate of a
    # "pick the largest" prompt would otherwise be right whenever the answer is listed last)
    ("526.007000 526.274", "526.274", 0.0),
    ("526.007000, 526.274", "526.274", 0.0),
    ("It is 3 or 5.", "5", 0.0),
    ("3; 5", "5", 0.0),
    ("3 and\n5", "5", 0.0),
    ("\\boxed{3, 5}", "5", 0.0),
    ("526.274000\n\n526.274", "526.274", 1.0),  # the same value twice is one answer
    ("5.26274e+02 or 526.274", "526.274", 1.0),
    ("1/2 or 0.5", "0.5", 1.0),
    ("Between 3 and 7 the largest is 7", "7", 1.0),  # words between: not a list
    ("3 / 4", "0.75", 0.0),  # a spaced fraction is two numbers (4 is not 0.75), as before
    ("526.007 and 526.274: 526.274", "526.274", 1.0),  # the list, then the pick
]


@pytest.mark.parametrize("completion,answer,expected", MATH_CASES)
def test_math_reward_table(completion, answer, expected):
    assert math_reward(completion, answer) == expected


EXTRACT_CASES = [
    ("23 + 45 = 68. #### 68", "68"),
    ("#### 1,234", "1234"),
    ("#### $68 dollars", "68"),
    ("\\boxed{\\frac{3}{4}}", "3/4"),
    ("no numbers here", None),
    ("", None),
    ("#### junk", None),
    ("answer: 68.0", "68.0"),
    ("I have 1,234, ok", "1234"),
    ("526.007000 5.26274e+02", None),
    ("answer: 68.0 or 68", "68"),
    ("\\boxed{12, 68}", None),
    ("12, 68 #### 68", "68"),  # after '####' the first number, as before
]


@pytest.mark.parametrize("text,expected", EXTRACT_CASES)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_parse_number():
    assert parse_number("1,234") == 1234.0
    assert parse_number("-3/4") == -0.75
    assert parse_number("$68") == 68.0
    assert parse_number("68.") == 68.0
    assert parse_number("50%") == 50.0
    assert parse_number("abc") is None
    assert parse_number("") is None
    assert parse_number(None) is None
    assert parse_number("1/0") is None
    assert parse_number("1 3 7 9") is None  # a sort answer is not a number


def test_math_reward_tolerance_and_bad_reference():
    assert math_reward("#### 0.3333333", "1/3") == 1.0  # within 1e-6
    assert math_reward("#### 0.33", "1/3", tol=0.01) == 1.0
    assert math_reward("#### 0.33", "1/3") == 0.0
    # the relative tolerance never exceeds half a unit of the reference's last digit: large numbers stay exact
    assert math_reward("#### 521219525", "521219524") == 0.0  # 1e-6 relative would be +-521
    assert math_reward("#### 521,219,525.263", "521219524.221") == 0.0
    assert math_reward("#### 521,219,524.221", "521219524.221") == 1.0
    assert math_reward("#### 521219524.2210001", "521219524.221") == 1.0
    assert math_reward("#### 793546073", "#### 793546072") == 0.0
    assert math_reward("#### 68.00001", "68") == 1.0  # float formatting of a small number still passes
    assert math_reward("#### 3.1415926", "3.14159") == 1.0
    assert math_reward("#### 2.4", "2.5", tol=0.1) == 0.0  # 0.1 * 2.5 > 0.1, but 2.4 is not 2.5 written to 1 place
    with pytest.raises(UserError, match="answer"):
        math_reward("#### 1", "n/a")


def test_math_reward_reads_scientific_notation():
    """'4.955770000000000e+02' is 495.577 (reasoning-gym's number_format writes its candidates so; a model that
    copies the right one is right), not the '02' after its 'e'."""
    assert extract_answer("The largest is 4.955770000000000e+02.") == "4.955770000000000e+02"
    assert math_reward("The largest is 4.955770000000000e+02.", "495.577") == 1.0
    assert math_reward("The largest is 4.955770000000000e+02", "495.578") == 0.0
    assert math_reward("5.68050999999999e+02", "568.051") == 1.0  # float formatting, within the tolerance
    assert math_reward("so 2e-3", "0.002") == 1.0 and math_reward("1.5E3 units", "1500") == 1.0
    assert math_reward("#### 495.577", "4.95577e+02") == 1.0 and math_reward("#### 495.58", "4.95577e+02") == 0.0
    assert parse_number("7e5") == 700000.0 and parse_number("e5") is None
    assert extract_answer("it is 3e") == "3" and extract_answer("7e5.3") == "5.3"  # no digits after e; not 7e5


def test_math_reward_compares_numbers_no_float_can_hold():
    """A sampled '1e400' (seen on number_format) is a wrong answer, not an OverflowError that kills the evaluation;
    the comparison is exact, so numbers past a float's range still compare by value."""
    assert math_reward("The largest is 1e400", "526.007") == 0.0
    assert math_reward("so 1e400", "1e400") == 1.0 and math_reward("so 1e400", "1.000001e400") == 0.0
    assert math_reward("-1e999", "5") == 0.0 and math_reward("5", "1e999") == 0.0


def test_math_reward_refuses_numbers_too_large_to_compare():
    """A sampled '9.78e+99999999' (seen on number_format: the exact value has 10^8 digits and stalled the reward past
    its 30 s limit) or a 5,000-digit run (int() refuses it) is no answer: 0, at once; the reference itself must be a
    comparable number."""
    from align.rewards import _fraction
    assert _fraction("9.78e+99999999") is None and _fraction("1" * 5000) is None and _fraction("2e-5000") is None
    assert math_reward("The largest is 9.78e+99999999", "978739397.626") == 0.0
    assert math_reward("978739397.626000\n" + "9" * 5000, "978739397.626") == 0.0
    assert math_reward("so 1e1000", "1e1000") == 1.0 and _fraction("1" * 1000) == int("1" * 1000)
    with pytest.raises(UserError, match="more than 1000"):
        math_reward("5", "1e1001")


def test_parse_int_list():
    assert parse_int_list("1 3 7 9") == [1, 3, 7, 9]
    assert parse_int_list("1, 3, -2, 7.") == [1, 3, -2, 7]
    assert parse_int_list("3-1") == [3, 1]
    assert parse_int_list("") == []
    assert parse_int_list(None) == []


# Design notes examples, prompt [3, 1, 0, 2] (sorted: [0, 1, 2, 3]).
@pytest.mark.parametrize(
    "response,distance,inclusion_ordering",
    [
        ([0, 1, 2, 3], 4, 7),  # all positions; 4 included + 3 ordered pairs
        ([7, 2, 2, 5], 1, 3),  # position 2 matches; only 2 included + (2<=2, 2<=5)
        ([0, 3, 1, 2], 1, 6),  # position 0 matches; 4 included + (0<=3, 1<=2)
        ([], 0, 0),
        ([0, 1], 2, 3),  # shorter: 2 positions; 2 included + 1 pair
        ([0, 1, 2, 3, 4, 5], 4, 9),  # longer: 4 positions; 4 included + 5 pairs
        ([3], 0, 1),  # 3 included, no pairs
    ],
)
def test_sort_rewards(response, distance, inclusion_ordering):
    assert sort_inclusion_ordering_reward([3, 1, 0, 2], response) == inclusion_ordering
    # `distance`: positions that hold the sorted list's number; sort_reward scores it over the longer list
    assert sort_reward(" ".join(map(str, response)), "0 1 2 3") == distance / max(len(response), 4)


def test_sort_reward_text():
    assert sort_reward("1 3 7 9", "1 3 7 9") == 1.0
    assert sort_reward("The sorted list is 1 3 7 9", "1 3 7 9") == 1.0
    assert sort_reward("1 3 9 7", "1 3 7 9") == 0.5
    assert sort_reward("1 3 9", "1 3 7 9") == 0.5  # 2 right over 4
    assert sort_reward("1 3 7 9 9", "1 3 7 9") == 0.8  # 4 right over 5
    assert sort_reward("", "1 3") == 0.0
    assert sort_reward("2 3 #### 1 3", "1 3") == 1.0
    with pytest.raises(UserError):
        sort_reward("1", "")


def test_one_registry_serves_grpo_ppo_and_eval():
    """--reward NAME, ppo's --gold-reward and eval's --verifier all read REWARDS; a verifier means reward == 1."""
    assert REWARDS["math"]("q", "#### 68", answer="68") == 1.0 and verify(REWARDS["math"], {"answer": 68}, "#### 68")
    assert verify(REWARDS["sort"], {"answer": "1 3 7"}, "1 3 7") and not verify(REWARDS["sort"], {"answer": "1 3 7"}, "1 7 3")
    assert verify(REWARDS["exact"], {"answer": "yes"}, " yes ") and not verify(REWARDS["exact"], {"answer": "no"}, "yes")
    assert guess_verifier([{"answer": "1,234"}]) == "math" and guess_verifier([{"answer": "abc"}]) == "exact"
    assert [r.name for r in parse_rewards(["exact", "answer_format:0.5"])] == ["exact", "answer_format"]
