"""The seed projects' GSM8K reward schemes, case by case against hand-worked tables (adversarial outputs
included: several answers, no tags, huge numbers, unicode digits, empty completions)."""

import pytest

from grpo.rewards import (
    REWARD_FUNCTIONS,
    expand_schemes,
    gsm8k_correctness,
    math_correctness,
    resolve_rewards,
)
from grpo.rewards.schemes import (
    torchrl_gsm8k,
    tunix_check_answer,
    tunix_check_numbers,
    tunix_match_format_approximately,
    tunix_match_format_exactly,
)

GSM8K_72 = "Natalia sold 48/2 = 24 clips in May.\nShe sold 48+24 = 72 clips.\n#### 72"

# TorchRL GSM8KRewardParser: 1.0 correct, 0.1 a non-empty <answer> that is wrong, 0.0 no answer.
TORCHRL_CASES = [
    ("<think>48+24=72</think><answer>72</answer>", 1.0),
    ("<answer> 72 </answer>", 1.0),  # stripped
    ("<answer>$72.00</answer>", 1.0),  # $ dropped, trailing decimal zeros dropped
    ("<answer>72%</answer>", 1.0),
    ("<answer>72.</answer>", 1.0),  # trailing '.' dropped
    ("<answer>72</answer><|im_end|>", 1.0),
    ("<answer>71</answer>", 0.1),  # well-formed but wrong
    ("<answer>seventy-two</answer>", 0.1),
    ("<answer>71</answer><answer>72</answer>", 0.1),  # several answers: the first counts
    ("<answer>72</answer><answer>71</answer>", 1.0),
    ("<answer>７２</answer>", 0.1),  # unicode digits are not folded
    ("<answer>" + "9" * 400 + "</answer>", 0.1),  # huge number
    ("<answer></answer>", 0.0),  # empty answer = no answer
    ("<answer>   </answer>", 0.0),
    ("<answer>72", 0.0),  # never closed
    ("The answer is 72.", 0.0),  # no tags
    ("#### 72", 0.0),
    ("", 0.0),  # empty completion
]


@pytest.mark.parametrize(("completion", "expected"), TORCHRL_CASES)
def test_torchrl_gsm8k_table(completion, expected):
    assert torchrl_gsm8k(["q"], [completion], answer=[GSM8K_72]) == [expected]


def test_torchrl_gsm8k_normalises_the_reference_too_and_skips_missing_references():
    assert torchrl_gsm8k(
        ["q"] * 2, ["<answer>1000</answer>", "<answer>1,000</answer>"], answer=["#### 1,000", "1000"]
    ) == [1.0, 1.0]
    assert torchrl_gsm8k(["q"], ["<answer>1</answer>"], answer=[None]) == [None]


R = "<reasoning>48+24=72</reasoning>"
# MaxText/Tunix: (completion, exact format, approximate format, check_answer, check_numbers).
TUNIX_CASES = [
    (f"{R}<answer>72</answer>", 3.0, 2.0, 3.0, 1.5),
    (f"{R}<answer> 72 </answer>", 3.0, 2.0, 1.5, 1.5),  # equal after strip
    (f"{R}<answer>75</answer>", 3.0, 2.0, 0.5, 0.0),  # 75/72 = 1.042: within 10%
    (f"{R}<answer>60</answer>", 3.0, 2.0, 0.25, 0.0),  # 60/72 = 0.833: within 20%
    (f"{R}<answer>100</answer>", 3.0, 2.0, -1.0, 0.0),  # wrong
    (f"{R}<answer>seventy-two</answer>", 3.0, 2.0, -0.5, 0.0),  # unparseable
    (f"{R}<answer>72.0</answer>", 3.0, 2.0, 0.5, 1.5),  # not equal as text, ratio 1.0
    (f"{R}<answer>71</answer><answer>72</answer>", 3.0, 0.0, -0.5, 0.0),  # several answers
    (f"{R}<answer>７２</answer>", 3.0, 2.0, 0.5, 1.5),  # unicode digits: float() and \d accept them
    (f"{R}<answer>{'9' * 400}</answer>", 3.0, 2.0, -1.0, 0.0),  # float overflows to inf
    ("Hi!\n" + R + "\n<answer>72</answer>\nBye", 3.0, 2.0, 3.0, 1.5),  # multiline ^/$: extra lines pass
    ("<answer>72</answer>" + R, 0.0, 2.0, 0.0, 1.5),  # answer before reasoning
    (f"{R}<answer>72", 0.0, 1.0, 0.0, 1.5),  # unclosed answer
    ("72", 0.0, -2.0, 0.0, 0.0),  # no tags
    ("", 0.0, -2.0, 0.0, 0.0),  # empty completion
]


@pytest.mark.parametrize(("completion", "exact", "approx", "answer", "numbers"), TUNIX_CASES)
def test_tunix_gsm8k_table(completion, exact, approx, answer, numbers):
    args = (["q"], [completion])
    assert tunix_match_format_exactly(*args) == [exact]
    assert tunix_match_format_approximately(*args) == [approx]
    assert tunix_check_answer(*args, answer=[GSM8K_72]) == [answer]
    assert tunix_check_numbers(*args, answer=[GSM8K_72]) == [numbers]


def test_tunix_zero_reference_is_unparseable_and_missing_reference_is_not_applicable():
    completion = f"{R}<answer>1</answer>"
    assert tunix_check_answer(["q"], [completion], answer=["#### 0"]) == [-0.5]  # ZeroDivisionError
    assert tunix_check_answer(["q"], [completion], answer=[None]) == [None]
    assert tunix_check_numbers(["q"], [completion], answer=["1"]) == [1.5]  # reference without ####


def test_scheme_names_expand_to_their_functions():
    assert expand_schemes(["tunix_gsm8k", "gsm8k_format"]) == [
        "tunix_match_format_exactly",
        "tunix_match_format_approximately",
        "tunix_check_answer",
        "tunix_check_numbers",
        "gsm8k_format",
    ]
    funcs = resolve_rewards(["maxtext_gsm8k"])
    assert [f.__name__ for f in funcs] == expand_schemes(["tunix_gsm8k"])
    assert REWARD_FUNCTIONS["torchrl_gsm8k"] is torchrl_gsm8k


# Our GSM8K rule with math-verify for answers that are not plain numbers.
GSM8K_CASES = [
    ("#### 72", 1.0),
    ("#### 72.00", 1.0),
    ("#### $72", 1.0),
    ("#### 144/2", 1.0),  # math-verify: a fraction equal to the reference
    ("The answer is \\boxed{\\frac{144}{2}}", 1.0),
    ("<answer>72</answer>", 1.0),
    ("#### 3\nwait\n#### 72", 1.0),  # several answers: the last marker counts
    ("#### 72\nwait\n#### 3", 0.0),
    ("#### 71", 0.0),
    ("#### 143/2", 0.0),
    ("#### ７２", 1.0),  # unicode digits fold to ASCII
    ("#### " + "9" * 40, 0.0),  # huge, exact, wrong
    ("she has 72 clips", 1.0),  # no marker: the last number
    ("no numbers at all", 0.0),
    ("", 0.0),
]


@pytest.mark.parametrize(("completion", "expected"), GSM8K_CASES)
def test_gsm8k_correctness_table(completion, expected):
    assert gsm8k_correctness(["q"], [completion], answer=[GSM8K_72]) == [expected]


def test_math_correctness_uses_math_verify_on_latex_references():
    completions = ["\\boxed{\\frac{1}{2}}", "#### 0.5", "#### 1/3", "", "\\boxed{2}"]
    answers = ["\\frac{1}{2}", "#### 1/2", "0.5", "0.5", "\\sqrt{4}"]
    assert math_correctness(["q"] * 5, completions, answer=answers) == [1.0, 1.0, 0.0, 0.0, 1.0]
    assert math_correctness(["q"], ["1"], answer=[""]) == [None]
