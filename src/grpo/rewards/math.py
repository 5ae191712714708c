"""GSM8K-style math rewards: pull the final answer out of a completion and compare it to the reference.

Numbers are compared as canonical decimal strings (see `normalize_number`), so `1,234`, `$1234.00` and
`１２３４` all match a reference of `1234`, and 30-digit answers compare exactly (no float rounding).
A final answer that is not a plain number (`#### 7/2`, `\\boxed{\\frac{7}{2}}`) is compared by
`math-verify` (symbolic equivalence through SymPy), so `7/2` matches a reference of `3.5`.
"""

import functools
import logging
import re
import unicodedata
from decimal import Decimal, InvalidOperation

from grpo.rewards.tags import ANSWER_BLOCK

# A number as written in prose: optional sign and dollar, digits with correct thousands grouping or none,
# optional decimals. It must not start inside a Latin word or another number ("H2O", "v1.2"); other
# scripts write numbers flush against words ("答案是42").
_NUMBER_IN_TEXT = re.compile(r"(?<![A-Za-z_\d.])-?\$?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?")
_WHOLE_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|-?\.\d+")
_BOXED = "\\boxed{"

# The two final-answer formats the format reward teaches, anchored at the end of the completion.
_FINAL_HASHES_LINE = re.compile(r"(?:\A|\n)[ \t]*####[ \t]*([^\n]*)\Z")
_FINAL_ANSWER_TAG = re.compile(r"<answer>([^<]*)</answer>\Z")
_ANY_ANSWER_MARKER = re.compile(r"####|</?answer>")


def _canonical_text(text: str) -> str:
    # NFKC folds fullwidth digits and signs to ASCII; it leaves U+2212 MINUS SIGN alone, which models emit.
    return unicodedata.normalize("NFKC", text).replace("\u2212", "-")


def normalize_number(s: str) -> str | None:
    """`s` as a canonical decimal string (`"$1,234.50"` -> `"1234.5"`, `"-0.0"` -> `"0"`), or None.

    Accepted: surrounding whitespace, `$` (also LaTeX `\\$`), a leading `+` or `-`, commas only as
    correct thousands separators, a trailing `.`, any Unicode decimal digits. Anything else (units,
    words, `1,23`, scientific notation) is not a number.
    """
    text = _canonical_text(s).replace("\\$", "").replace("$", "").strip().removeprefix("+")
    text = text.removesuffix(".")
    if not _WHOLE_NUMBER.fullmatch(text):
        return None
    try:
        value = Decimal(text.replace(",", ""))
    except InvalidOperation:
        return None
    if value.is_zero():
        return "0"
    # format(..., "f") prints every digit without consulting the context precision, so huge values stay exact.
    digits = format(value, "f")
    return digits.rstrip("0").rstrip(".") if "." in digits else digits


def _last_number(text: str) -> str | None:
    matches = _NUMBER_IN_TEXT.findall(text)
    return normalize_number(matches[-1]) if matches else None


def _number_in(span: str) -> str | None:
    return normalize_number(span) or _last_number(span)


def _after_last_hashes(text: str) -> str | None:
    _, hashes, tail = text.rpartition("####")
    return tail.strip().split("\n", 1)[0] if hashes else None


def _last_answer_tag(text: str) -> str | None:
    contents = ANSWER_BLOCK.findall(text)
    return contents[-1] if contents else None


def _last_boxed(text: str) -> str | None:
    start = text.rfind(_BOXED)
    if start < 0:
        return None
    depth, content_start = 1, start + len(_BOXED)
    for index in range(content_start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[index], 0)
        if depth == 0:
            # LaTeX writes thousands as 1{,}234.
            return text[content_start:index].replace("{,}", ",")
    return None


def final_answer_span(text: str) -> str | None:
    """The text inside the final-answer marker that `extract_answer` reads first, or None without one."""
    text = _canonical_text(text)
    for find_span in (_after_last_hashes, _last_answer_tag, _last_boxed):
        span = find_span(text)
        if span is not None and span.strip():
            return span.strip()
    return None


def extract_answer(text: str) -> str | None:
    """The final answer of a completion as a canonical number string, or None.

    Looked for in this order, the first that holds a number winning: the text after the last `####`
    (to the end of its line), the last `<answer>...</answer>`, the last `\\boxed{...}`, and finally
    the last number anywhere. Inside a marker the whole content must be a number, else its last number
    is taken (`#### 3 + 4 = 7` -> `7`). A marker with no number in it falls through to the next rule.
    """
    text = _canonical_text(text)
    for find_span in (_after_last_hashes, _last_answer_tag, _last_boxed):
        span = find_span(text)
        number = _number_in(span) if span is not None else None
        if number is not None:
            return number
    return _last_number(text)


def reference_answer(answer: str | float) -> str | None:
    """Ground truth from a GSM8K `answer` column (worked solution ending `#### 42`) or a plain number.

    Stricter than `extract_answer`: the text after the last `####`, or the whole value, must be a number.
    """
    if isinstance(answer, int | float) and not isinstance(answer, bool):
        answer = format(Decimal(str(answer)), "f")
    if not isinstance(answer, str):
        return None
    _, hashes, tail = answer.rpartition("####")
    return normalize_number(tail.strip().split("\n", 1)[0] if hashes else answer)


def gsm8k_correctness(
    prompts: list[str], completions: list[str], answer: list[str], **_: list
) -> list[float | None]:
    """1.0 when the completion's final number equals the reference, else 0.0.

    None where the row's reference cannot be parsed, so that row is left out rather than scored 0.
    """
    rewards: list[float | None] = []
    for completion, reference in zip(completions, answer, strict=True):
        expected = reference_answer(reference)
        rewards.append(None if expected is None else float(is_correct(completion, expected)))
    return rewards


def is_correct(completion: str, expected: str) -> bool:
    """Does the completion's final answer equal `expected` (a canonical number from `reference_answer`)?

    Exact canonical-number match first; when the final-answer marker holds something other than a plain
    number (a fraction, LaTeX), math-verify decides. A plain but different number is simply wrong.
    """
    if extract_answer(completion) == expected:
        return True
    span = final_answer_span(completion)
    return span is not None and normalize_number(span) is None and math_equivalent(span, expected)


@functools.cache
def _math_verify():
    # Imported on first use: math-verify pulls in SymPy and an ANTLR LaTeX parser (~0.6 s).
    import math_verify

    logging.getLogger("math_verify").setLevel(logging.ERROR)  # it warns once that we time out ourselves
    config = (math_verify.LatexExtractionConfig(), math_verify.ExprExtractionConfig())
    return math_verify, config


def math_equivalent(prediction: str, reference: str) -> bool:
    """Whether two answers are mathematically equal according to math-verify (`1/2` == `0.5` ==
    `\\frac{1}{2}`). Either side may be plain text, an expression or LaTeX (with or without `$` or
    `\\boxed{}`). math-verify's own signal-based time limit only works on the main thread, so it is
    switched off here: reward calls are time-limited by the trainer (algorithm.reward_timeout).
    """
    if not prediction.strip() or not reference.strip():
        return False
    mv, config = _math_verify()

    def parsed(text: str):
        found = mv.parse(text, extraction_config=config, parsing_timeout=None)
        if not found and "\\" in text and "$" not in text:
            found = mv.parse(f"${text}$", extraction_config=config, parsing_timeout=None)
        return found

    gold, guess = parsed(reference), parsed(prediction)
    return bool(gold and guess and mv.verify(gold, guess, timeout_seconds=None))


def math_correctness(
    prompts: list[str], completions: list[str], answer: list[str], **_: list
) -> list[float | None]:
    """1.0 when math-verify finds the completion's final answer equal to the reference, else 0.0.

    For math beyond GSM8K's integers (MATH-style LaTeX answers). The reference is the text after the
    last `####` when there is one, else the whole `answer` value; the prediction is the final-answer
    marker's content (`####`, `<answer>`, `\\boxed{}`) or, without one, the whole completion.
    None where the reference is empty.
    """
    rewards: list[float | None] = []
    for completion, reference in zip(completions, answer, strict=True):
        gold = str(reference).rpartition("####")[2].strip() if reference is not None else ""
        if not gold:
            rewards.append(None)
            continue
        prediction = final_answer_span(completion) or completion
        rewards.append(float(math_equivalent(prediction, gold)))
    return rewards


def gsm8k_format(prompts: list[str], completions: list[str], **_: list) -> list[float]:
    """1.0 when the completion ends with a final-answer line `#### <number>` or `<answer><number></answer>`.

    0.5 when an answer marker (`####`, `<answer>`) is present but not at the end or not around a plain
    number; 0.0 when there is none. `\\boxed{}` earns nothing here: it is not one of the taught formats.
    """
    return [_format_score(_canonical_text(completion).rstrip()) for completion in completions]


def _format_score(text: str) -> float:
    final = _FINAL_HASHES_LINE.search(text) or _FINAL_ANSWER_TAG.search(text)
    if final is not None and normalize_number(final.group(1)) is not None:
        return 1.0
    return 0.5 if _ANY_ANSWER_MARKER.search(text) else 0.0
