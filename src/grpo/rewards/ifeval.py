"""IFEval: instruction-following checks (through the `if-verifiable` package), accuracies, TorchRL's reward.

Rows follow the google/IFEval schema: `key`, `prompt`, `instruction_id_list` (e.g.
`["punctuation:no_comma", "length_constraints:number_words"]`) and `kwargs` (one dict of checker
arguments per instruction). Each instruction is checked *strictly* (the response as is) and *loosely*
(any of eight variants: first/last line removed, `*` removed; IFEval's definition). The four accuracies:

- prompt-level strict / loose: 1 when every instruction of the prompt is followed;
- instruction-level strict / loose: the fraction of the prompt's instructions followed (averaged per
  prompt in the reward; pooled over all instructions in `grpo eval`, as the IFEval paper reports it).

Offline NLTK: two checkers need NLTK's "punkt" sentence model (`length_constraints:number_sentences`
and `change_case:capital_word_frequency`, through word_tokenize), which NLTK downloads on demand. When
the data is not installed, those calls use an untrained Punkt tokenizer primed with common English
abbreviations (Mr., Dr., e.g., i.e., etc., ...). It splits ordinary prose the same way; it can differ on
rare abbreviations the trained model knows. Install the data (`python -m nltk.downloader punkt_tab
punkt`) to use the trained model: it is picked up automatically.

Language checks (`language:response_language`, `change_case:english_*`) use langdetect, seeded here so
that one response always gets one score. Unknown instruction ids and missing checker arguments are errors
(if-verifiable would silently skip the former and draw random thresholds for the latter).
"""

from __future__ import annotations

import difflib
import functools
import logging
from dataclasses import dataclass
from typing import Any

from grpo.rewards.tags import ANSWER_BLOCK, THINK_BLOCK

log = logging.getLogger("grpo")

_ABBREVIATIONS = (
    "mr",
    "mrs",
    "ms",
    "dr",
    "prof",
    "sr",
    "jr",
    "st",
    "vs",
    "etc",
    "e.g",
    "i.e",
    "inc",
    "ltd",
    "co",
    "corp",
    "fig",
    "no",
    "vol",
    "jan",
    "feb",
    "mar",
    "apr",
    "jun",
    "jul",
    "aug",
    "sep",
    "sept",
    "oct",
    "nov",
    "dec",
    "u.s",
    "u.k",
    "a.m",
    "p.m",
    "approx",
    "dept",
    "est",
    "mt",
)
TORCHRL_FORMAT_WEIGHTS = (0.4, 0.3, 0.2, 0.1)


@dataclass
class IFEvalScore:
    """One response against one prompt's instructions."""

    prompt_strict: bool
    prompt_loose: bool
    instruction_strict: list[bool]  # one per instruction
    instruction_loose: list[bool]

    @property
    def instruction_strict_mean(self) -> float:
        return sum(self.instruction_strict) / len(self.instruction_strict) if self.instruction_strict else 0.0

    @property
    def instruction_loose_mean(self) -> float:
        return sum(self.instruction_loose) / len(self.instruction_loose) if self.instruction_loose else 0.0


@functools.cache
def _checkers():
    try:
        from if_verifiable.common import evaluate_instructions
        from if_verifiable.ifeval import instructions_util
        from if_verifiable.ifeval.instructions_registry import INSTRUCTION_DICT
    except ImportError as error:
        raise ImportError(
            "IFEval scoring needs the if-verifiable package: pip install 'grpo[ifeval]'"
        ) from error
    _use_offline_nltk_if_needed(instructions_util)
    import langdetect

    # langdetect samples at random: unseeded, a short English text can come out as another language on
    # some calls, so the same response would score differently from one step to the next.
    langdetect.DetectorFactory.seed = 0
    return INSTRUCTION_DICT, evaluate_instructions


def _nltk_has(resource: str) -> bool:
    import nltk

    try:
        nltk.data.find(resource)
        return True
    except LookupError:
        return False


def offline_sentence_tokenizer():
    """An untrained Punkt sentence tokenizer that knows common English abbreviations."""
    from nltk.tokenize.punkt import PunktParameters, PunktSentenceTokenizer

    params = PunktParameters()
    params.abbrev_types = set(_ABBREVIATIONS)
    return PunktSentenceTokenizer(params)


def _use_offline_nltk_if_needed(instructions_util) -> None:
    import types

    import nltk

    if _nltk_has("tokenizers/punkt_tab/english/") and _nltk_has("tokenizers/punkt/english.pickle"):
        return
    sentences = offline_sentence_tokenizer()
    words = nltk.tokenize.NLTKWordTokenizer()

    def word_tokenize(text: str, language: str = "english", preserve_line: bool = False) -> list[str]:  # noqa: ARG001 (nltk's signature; the offline tokenizer is English only)
        # nltk.word_tokenize: sentences first, then the Treebank-style word tokenizer on each.
        parts = [text] if preserve_line else sentences.tokenize(text)
        return [token for part in parts for token in words.tokenize(part)]

    # if-verifiable reaches NLTK through these two names only; nltk itself is left untouched.
    proxy = types.ModuleType("nltk_offline")
    proxy.__dict__.update({k: getattr(nltk, k) for k in ("tokenize", "data", "corpus")})
    proxy.word_tokenize = word_tokenize
    instructions_util.nltk = proxy
    instructions_util._get_sentence_tokenizer = lambda: sentences
    log.info(
        "NLTK punkt data not installed: IFEval sentence counting uses an untrained Punkt tokenizer "
        "(see grpo.rewards.ifeval)."
    )


def check_instructions(
    response: str, instruction_id_list: list[str], kwargs: list[dict[str, Any]] | None, prompt: str = ""
) -> IFEvalScore:
    """Strict and loose results of `response` for each instruction. `kwargs`: one dict per instruction."""
    registry, evaluate_instructions = _checkers()
    kwargs = list(kwargs) if kwargs is not None else [{} for _ in instruction_id_list]
    if len(kwargs) != len(instruction_id_list):
        raise ValueError(f"{len(instruction_id_list)} instructions but {len(kwargs)} kwargs dicts")
    for instruction_id, arguments in zip(instruction_id_list, kwargs, strict=True):
        _check_arguments(registry, instruction_id, arguments or {})
    cleaned = [{k: v for k, v in (a or {}).items() if v is not None} for a in kwargs]
    results, _ = evaluate_instructions(
        response=response,
        instruction_id_list=list(instruction_id_list),
        kwargs_list=cleaned,
        prompt=prompt,
        instruction_registry=registry,
    )
    strict = [r.strict_pass for r in results] or [False] * len(instruction_id_list)
    loose = [r.loose_pass for r in results] or [False] * len(instruction_id_list)
    return IFEvalScore(
        prompt_strict=all(strict) and bool(strict),
        prompt_loose=all(loose) and bool(loose),
        instruction_strict=strict,
        instruction_loose=loose,
    )


def _check_arguments(registry, instruction_id: str, arguments: dict[str, Any]) -> None:
    if instruction_id not in registry:
        close = difflib.get_close_matches(instruction_id, registry, n=2)
        hint = f"; did you mean {' or '.join(close)}?" if close else ""
        raise ValueError(f"unknown IFEval instruction {instruction_id!r}{hint}")
    checker = registry[instruction_id](instruction_id)
    missing = [k for k in checker.get_instruction_args_keys() if arguments.get(k) is None and k != "prompt"]
    if missing:
        raise ValueError(
            f"IFEval instruction {instruction_id!r} needs kwargs {missing} (got {arguments}); "
            "without them the checker would draw random thresholds"
        )


def torchrl_ifeval(
    prompts: list[str],
    completions: list[str],
    instruction_id_list: list,
    kwargs: list | None = None,
    completion_truncated: list[bool] | None = None,
    **_: list,
) -> list[float | None]:
    """TorchRL's IFEval reward (IfEvalScorer's default aggregator), up to 2.2:

        0.4·prompt_strict + 0.3·instruction_strict + 0.2·prompt_loose + 0.1·instruction_loose
        + 0.5 if exactly one <think>…</think>  + 0.5 if exactly one <answer>…</answer>
        + 0.2 if the completion ended by itself (not cut at max_new_tokens)

    The instructions are checked on the first <answer> block (the empty string without one). None on
    rows without instructions.
    """
    kwargs = kwargs if kwargs is not None else [None] * len(completions)
    truncated = completion_truncated if completion_truncated is not None else [None] * len(completions)
    rewards: list[float | None] = []
    for prompt, completion, ids, arguments, cut in zip(
        prompts, completions, instruction_id_list, kwargs, truncated, strict=True
    ):
        if not ids:
            rewards.append(None)
            continue
        thinks, answers = THINK_BLOCK.findall(completion), ANSWER_BLOCK.findall(completion)
        score = check_instructions(answers[0] if answers else "", ids, arguments, prompt)
        accuracies = (
            float(score.prompt_strict),
            score.instruction_strict_mean,
            float(score.prompt_loose),
            score.instruction_loose_mean,
        )
        format_score = sum(w * x for w, x in zip(TORCHRL_FORMAT_WEIGHTS, accuracies, strict=True))
        structure = 0.5 * (len(thinks) == 1) + 0.5 * (len(answers) == 1)
        completion_bonus = 0.0 if cut is None else 0.2 * (not cut)
        rewards.append(format_score + structure + completion_bonus)
    return rewards


def ifeval_strict(
    prompts: list[str],
    completions: list[str],
    instruction_id_list: list,
    kwargs: list | None = None,
    **_: list,
) -> list[float | None]:
    """1.0 when the whole completion follows every instruction strictly (prompt-level strict accuracy)."""
    kwargs = kwargs if kwargs is not None else [None] * len(completions)
    return [
        None if not ids else float(check_instructions(c, ids, a, p).prompt_strict)
        for p, c, ids, a in zip(prompts, completions, instruction_id_list, kwargs, strict=True)
    ]
