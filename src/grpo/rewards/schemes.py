"""The seed projects' GSM8K reward schemes, rule for rule (worked cases in tests/unit/test_schemes.py).

TorchRL (`torchrl_gsm8k`, torchrl.envs.llm GSM8KRewardParser): the first `<answer>...</answer>` is the
answer; 1.0 when it equals the reference after normalisation (strip; drop `,`, `$`, `%`; drop a trailing
`.`; drop trailing decimal zeros), 0.1 when it is non-empty but wrong, 0.0 without one.

MaxText/Tunix (`tunix_gsm8k`, the GRPO demo's four reward functions, summed):

* `tunix_match_format_exactly`: 3.0 if `^\\s*<reasoning>.+?</reasoning>.*?<answer>(.+?)</answer>\\s*$`
  matches (multiline).
* `tunix_match_format_approximately`: +0.5 for each of the four tags present exactly once, −0.5 otherwise.
* `tunix_check_answer`: on that regex's answer: 3.0 equal; 1.5 equal after strip; else ratio guess/true in
  [0.9, 1.1] 0.5, in [0.8, 1.2] 0.25, else −1.0; not a number (or true = 0) −0.5; no match 0.
* `tunix_check_numbers`: first `[\\d.]+` after `<answer>`: 1.5 if float-equal to the reference, else 0.

Deviations, all where the originals would crash: a reference without `####` is used whole (TorchRL
raises, MaxText passes None on); a reference that does not parse is scored None (not applicable).
"""

from __future__ import annotations

import re

from grpo.rewards.tags import ANSWER_BLOCK


# -- TorchRL --------------------------------------------------------------------------------------
def _torchrl_normalize(answer: str) -> str:
    answer = answer.strip().replace(",", "").replace("$", "").replace("%", "").rstrip(".")
    if "." in answer:
        answer = answer.rstrip("0").rstrip(".")
    return answer


def _torchrl_reference(reference) -> str | None:
    if reference is None:
        return None
    text = str(reference)
    return text.split("#### ", 1)[1] if "#### " in text else text


def torchrl_gsm8k(prompts: list[str], completions: list[str], answer: list, **_: list) -> list[float | None]:
    """TorchRL's GSM8K reward: 1.0 correct, 0.1 a non-empty `<answer>` that is wrong, 0.0 no answer."""
    rewards: list[float | None] = []
    for completion, reference in zip(completions, answer, strict=True):
        truth = _torchrl_reference(reference)
        if truth is None:
            rewards.append(None)
            continue
        found = ANSWER_BLOCK.search(completion.removesuffix("<|im_end|>"))
        guess = found.group(1).strip() if found else ""
        if guess and _torchrl_normalize(guess) == _torchrl_normalize(truth):
            rewards.append(1.0)
        else:
            rewards.append(0.1 if guess else 0.0)
    return rewards


# -- MaxText / Tunix --------------------------------------------------------------------------------
REASONING_START, REASONING_END = "<reasoning>", "</reasoning>"
SOLUTION_START, SOLUTION_END = "<answer>", "</answer>"
_MATCH_FORMAT = re.compile(
    rf"^[\s]{{0,}}{REASONING_START}.+?{REASONING_END}.*?{SOLUTION_START}(.+?){SOLUTION_END}[\s]{{0,}}$",
    flags=re.MULTILINE | re.DOTALL,
)
_MATCH_NUMBERS = re.compile(rf"{SOLUTION_START}.*?([\d\.]{{1,}})", flags=re.MULTILINE | re.DOTALL)


def _hash_answer(reference) -> str | None:
    """MaxText's extract_hash_answer (the text after `####`, stripped); the whole value without `####`."""
    if reference is None:
        return None
    text = str(reference)
    return text.split("####")[1].strip() if "####" in text else text.strip()


def tunix_match_format_exactly(prompts: list[str], completions: list[str], **_: list) -> list[float]:
    """3.0 when the completion is `<reasoning>…</reasoning>…<answer>…</answer>` (MaxText/Tunix)."""
    return [0.0 if _MATCH_FORMAT.search(c) is None else 3.0 for c in completions]


def tunix_match_format_approximately(prompts: list[str], completions: list[str], **_: list) -> list[float]:
    """+0.5 per tag that appears exactly once, −0.5 per tag that does not (MaxText/Tunix)."""
    tags = (REASONING_START, REASONING_END, SOLUTION_START, SOLUTION_END)
    return [sum(0.5 if c.count(tag) == 1 else -0.5 for tag in tags) for c in completions]


def tunix_check_answer(
    prompts: list[str], completions: list[str], answer: list, **_: list
) -> list[float | None]:
    """3.0 exact, 1.5 equal up to whitespace, 0.5 / 0.25 within 10% / 20%, −1.0 wrong, −0.5 unparseable."""
    rewards: list[float | None] = []
    for completion, reference in zip(completions, answer, strict=True):
        truth = _hash_answer(reference)
        if truth is None:
            rewards.append(None)
            continue
        found = _MATCH_FORMAT.search(completion)
        if found is None:
            rewards.append(0.0)
            continue
        guess = found.group(1)
        if guess == truth:
            rewards.append(3.0)
        elif guess.strip() == truth.strip():
            rewards.append(1.5)
        else:
            try:
                ratio = float(guess) / float(truth)
            except (ValueError, ZeroDivisionError, OverflowError):
                rewards.append(-0.5)
                continue
            if 0.9 <= ratio <= 1.1:
                rewards.append(0.5)
            elif 0.8 <= ratio <= 1.2:
                rewards.append(0.25)
            else:
                rewards.append(-1.0)
    return rewards


def tunix_check_numbers(
    prompts: list[str], completions: list[str], answer: list, **_: list
) -> list[float | None]:
    """1.5 when the first number after `<answer>` equals the reference as a float, else 0 (MaxText/Tunix)."""
    rewards: list[float | None] = []
    for completion, reference in zip(completions, answer, strict=True):
        truth = _hash_answer(reference)
        if truth is None:
            rewards.append(None)
            continue
        found = _MATCH_NUMBERS.search(completion)
        if found is None:
            rewards.append(0.0)
            continue
        try:
            rewards.append(1.5 if float(found.group(1).strip()) == float(truth.strip()) else 0.0)
        except ValueError:
            rewards.append(0.0)
    return rewards


SCHEME_FUNCTIONS = {
    "torchrl_gsm8k": torchrl_gsm8k,
    "tunix_match_format_exactly": tunix_match_format_exactly,
    "tunix_match_format_approximately": tunix_match_format_approximately,
    "tunix_check_answer": tunix_check_answer,
    "tunix_check_numbers": tunix_check_numbers,
}

_TUNIX = [
    "tunix_match_format_exactly",
    "tunix_match_format_approximately",
    "tunix_check_answer",
    "tunix_check_numbers",
]
# A scheme name in reward_funcs expands to these functions (summed with weight 1.0 each unless
# algorithm.reward_weights gives one weight per expanded function).
REWARD_SCHEMES: dict[str, list[str]] = {"tunix_gsm8k": _TUNIX, "maxtext_gsm8k": _TUNIX}
