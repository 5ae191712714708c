"""IFEval: checkers on a fixture file in the google/IFEval schema, strict/loose accuracies, TorchRL's reward,
the offline NLTK fallback, and `evaluate` on IFEval rows."""

import json
import types
from pathlib import Path

import pytest

from grpo.config import DataConfig, load_config
from grpo.data import PromptFormatter, load_rows
from grpo.evaluation import evaluate
from grpo.rewards import REWARD_FUNCTIONS
from grpo.rewards.ifeval import _use_offline_nltk_if_needed, check_instructions, torchrl_ifeval
from tests.helpers import CannedEngine, CannedTokenizer

FIXTURE = Path(__file__).parent.parent / "fixtures" / "ifeval_sample.jsonl"
ROWS = {r["key"]: r for r in map(json.loads, FIXTURE.read_text().splitlines())}


def check(key, response):
    row = ROWS[key]
    return check_instructions(response, row["instruction_id_list"], row["kwargs"], row["prompt"])


# (key, response, prompt strict, prompt loose, instruction strict, instruction loose)
CASES = [
    (1000, "Rivers flow to the sea", True, True, [True], [True]),
    (1000, "Rivers, lakes and seas.", False, False, [False], [False]),
    (1000, "Sure, here it is:\nRivers flow to the sea", False, True, [False], [True]),  # loose drops line 1
    (
        1001,
        "the cat is a small animal that purrs. it sleeps all day long.",
        True,
        True,
        [True, True],
        [True, True],
    ),
    (
        1001,
        "The cat is a small animal that purrs. It sleeps all day long.",
        False,
        False,
        [True, False],
        [True, False],
    ),
    (1001, "a cat. it purrs. it sleeps. it eats.", False, False, [False, True], [False, True]),
    (1002, "* red\n* green\n* blue\nAny other questions?", True, True, [True, True], [True, True]),
    (1002, "* red\n* green\nAny other questions?", False, False, [False, True], [False, True]),
    (1003, "The SUN is VERY hot and bright.", True, True, [True, True], [True, True]),
    (1003, "The sun is hot and bright.", False, False, [False, True], [False, True]),
    (1003, "", False, False, [False, False], [False, False]),  # empty response
]


@pytest.mark.parametrize(("key", "response", "p_strict", "p_loose", "i_strict", "i_loose"), CASES)
def test_checkers_on_the_fixture(key, response, p_strict, p_loose, i_strict, i_loose):
    score = check(key, response)
    assert (score.prompt_strict, score.prompt_loose) == (p_strict, p_loose)
    assert (score.instruction_strict, score.instruction_loose) == (i_strict, i_loose)


def test_unknown_instruction_and_missing_arguments_are_errors_not_silent_skips():
    with pytest.raises(ValueError, match=r"unknown IFEval instruction 'punctuation:no_comas'.*no_comma"):
        check_instructions("x", ["punctuation:no_comas"], [{}])
    with pytest.raises(ValueError, match="needs kwargs \\['num_sentences', 'relation'\\]"):
        check_instructions("x", ["length_constraints:number_sentences"], [{}])


def test_sentence_counting_works_offline_and_knows_abbreviations():
    # No NLTK data is installed here, so this runs the offline Punkt fallback (or the real model if present).
    assert check_instructions(
        "Mr. Smith met Dr. Jones. They talked.",
        ["length_constraints:number_sentences"],
        [{"num_sentences": 3, "relation": "less than"}],
    ).prompt_strict


def test_offline_fallback_replaces_only_the_two_nltk_entry_points(monkeypatch):
    from grpo.rewards import ifeval

    monkeypatch.setattr(ifeval, "_nltk_has", lambda resource: False)
    util = types.SimpleNamespace(nltk=None, _get_sentence_tokenizer=None)
    _use_offline_nltk_if_needed(util)
    assert util._get_sentence_tokenizer().tokenize("Mr. Smith left. He slept, e.g. at home.") == [
        "Mr. Smith left.",
        "He slept, e.g. at home.",
    ]
    assert util.nltk.word_tokenize("HELLO world. It's MY day.") == [
        "HELLO",
        "world",
        ".",
        "It",
        "'s",
        "MY",
        "day",
        ".",
    ]
    assert util.nltk.tokenize.RegexpTokenizer  # the rest of nltk is passed through


def test_torchrl_ifeval_reward_worked_cases():
    row = ROWS[1000]
    cases = [  # (completion, truncated, reward)
        (
            "<think>ok</think><answer>Rivers flow to the sea.</answer>",
            False,
            0.4 + 0.3 + 0.2 + 0.1 + 0.5 + 0.5 + 0.2,
        ),
        ("<think>ok</think><answer>Rivers flow to the sea.</answer>", True, 2.0),  # cut off: no 0.2 bonus
        ("<answer>Rivers, lakes.</answer>", False, 0.5 + 0.2),  # no think block, instruction failed
        ("Rivers flow.", False, 0.2),  # no <answer>: the empty string is checked
        ("<think>a</think><think>b</think><answer>x</answer><answer>y, z</answer>", False, 1.0 + 0.2),
        ("", False, 0.2),
        ("<think>ok</think><answer>Rivers flow.</answer>", None, 2.0),  # unknown completion state: no bonus
    ]
    completions = [c for c, _, _ in cases]
    rewards = torchrl_ifeval(
        [row["prompt"]] * len(cases),
        completions,
        [row["instruction_id_list"]] * len(cases),
        kwargs=[row["kwargs"]] * len(cases),
        completion_truncated=[t for _, t, _ in cases],
    )
    assert rewards == pytest.approx([r for _, _, r in cases])
    two = ROWS[1001]  # instruction strict 0.5, loose 0.5 → 0.3·0.5 + 0.1·0.5 = 0.2
    assert torchrl_ifeval(
        [two["prompt"]],
        ["<think>t</think><answer>A cat purrs. It sleeps.</answer>"],
        [two["instruction_id_list"]],
        kwargs=[two["kwargs"]],
        completion_truncated=[False],
    ) == pytest.approx([0.2 + 1.0 + 0.2])
    assert REWARD_FUNCTIONS["torchrl_ifeval"] is torchrl_ifeval


def test_evaluate_reports_the_four_ifeval_accuracies_pooled_per_instruction():
    rows = load_rows(str(FIXTURE), DataConfig())
    responses = [
        "Sure, here it is:\nRivers flow to the sea",
        "the cat is a small animal that purrs. it sleeps all day long.",
        "* red\n* green\nAny other questions?",
        "The SUN is VERY hot and bright.",
    ]
    tokenizer = CannedTokenizer([r["prompt"] for r in rows], responses)
    result = evaluate(CannedEngine(), PromptFormatter(tokenizer, DataConfig()), rows, max_new_tokens=8)
    assert result.accuracy == 0.5  # prompt-level strict: rows 1001 and 1003
    assert result.extra["prompt_level_strict_acc"] == 0.5
    assert result.extra["prompt_level_loose_acc"] == 0.75
    assert result.extra["inst_level_strict_acc"] == pytest.approx(5 / 7)  # 7 instructions in all
    assert result.extra["inst_level_loose_acc"] == pytest.approx(6 / 7)
    assert result.records[0]["strict"] == [[False]] and result.records[0]["loose"] == [[True]]


def test_ifeval_preset_loads_under_both_names():
    for name in ("ifeval", "grpo_ifeval"):
        cfg = load_config(name, {"data.dataset": str(FIXTURE)})
        # a local file in place of google/IFEval is evaluated on a held-out slice of itself, not the hub set
        assert cfg.algorithm.reward_funcs == ["torchrl_ifeval"] and cfg.data.eval_dataset == "holdout"
        assert load_config(name).data.eval_dataset == "ifeval"
