"""GSM8K extraction and rewards, the reward registry, and the weighted combination, on worked cases."""

import math

import pytest
import torch

from grpo.rewards import (
    REWARD_FUNCTIONS,
    RewardError,
    extract_answer,
    gsm8k_correctness,
    gsm8k_format,
    normalize_number,
    reference_answer,
    resolve_reward,
    reward_name,
    score_completions,
)


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("so the total is\n#### 42", "42"),
        ("#### 1,234", "1234"),
        ("She pays $5 in the end.", "5"),
        ("The answer is 42.0", "42"),
        ("<answer> 7 </answer>", "7"),
        ("#### 3\nwait, no\n#### 5", "5"),
        ("First 3 apples, then 4 more, so 7 apples.", "7"),
        ("", None),
        ("There are no numbers here.", None),
        ("答案是４２", "42"),
        ("٤٢", "42"),
        ("#### 123456789012345678901234567890123", "123456789012345678901234567890123"),
        ("The temperature fell to -5 degrees", "-5"),
        ("the change is \u22127", "-7"),
        ("#### $1,234.50.", "1234.5"),
        ("#### 3 + 4 = 7", "7"),
        ("<answer>12</answer> but the last number is 99", "12"),
        ("\\boxed{18} and later 20", "18"),
        ("\\boxed{1{,}234}", "1234"),
        ("#### 6\n<answer>5</answer>", "6"),
        ("####\nnothing after the marker, so the last number: 9", "9"),
        ("H2O has 3 atoms", "3"),
        ("counting 1,2345", "2345"),
    ],
)
def test_extract_answer(completion, expected):
    assert extract_answer(completion) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("42", "42"),
        (" 42 ", "42"),
        ("+42", "42"),
        ("-42", "-42"),
        ("$5", "5"),
        ("\\$5", "5"),
        ("-$3", "-3"),
        ("1,234", "1234"),
        ("1,234,567.25", "1234567.25"),
        ("42.", "42"),
        ("42.0", "42"),
        ("42.00", "42"),
        ("0.50", "0.5"),
        (".5", "0.5"),
        ("007", "7"),
        ("-0.0", "0"),
        ("１２３", "123"),
        ("99999999999999999999999999999999.10", "99999999999999999999999999999999.1"),
        ("1,23", None),
        ("1e3", None),
        ("12 apples", None),
        ("", None),
        ("forty", None),
    ],
)
def test_normalize_number(text, expected):
    assert normalize_number(text) == expected


@pytest.mark.parametrize(
    ("answer", "expected"),
    [
        ("Natalia sold 48/2 = 24 clips in May.\nSo 48+24 = 72 clips.\n#### 72", "72"),
        ("#### 1,000", "1000"),
        ("72", "72"),
        (72, "72"),
        (2.5, "2.5"),
        ("#### seventy-two", None),
        ("no reference here", None),
        (None, None),
    ],
)
def test_reference_answer(answer, expected):
    assert reference_answer(answer) == expected


def test_gsm8k_correctness_compares_numbers_and_skips_unparseable_references():
    completions = ["#### 72", "so $72.00", "#### 71", "#### 5", "#### 5"]
    answer = ["... #### 72", "#### 72", "#### 72", "not a number", 5]
    rewards = gsm8k_correctness(["p"] * 5, completions, answer=answer, unused_column=[0] * 5)
    assert rewards == [1.0, 1.0, 0.0, None, 1.0]


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("reasoning\n#### 42", 1.0),
        ("reasoning\n#### 1,234  \n\n", 1.0),
        ("#### -3.5", 1.0),
        ("reasoning <answer>42</answer>", 1.0),
        ("<answer> $42 </answer>\n", 1.0),
        ("the answer is #### 42", 0.5),
        ("#### 42\nand some words after", 0.5),
        ("#### forty-two", 0.5),
        ("<answer>42 apples</answer>", 0.5),
        ("<answer>42", 0.5),
        ("\\boxed{42}", 0.0),
        ("the answer is 42", 0.0),
        ("", 0.0),
    ],
)
def test_gsm8k_format(completion, expected):
    assert gsm8k_format(["p"], [completion], answer=["#### 42"]) == [expected]


def test_resolve_reward_by_registered_name_and_callable():
    assert resolve_reward("gsm8k_correctness") is gsm8k_correctness
    assert REWARD_FUNCTIONS["gsm8k_format"] is gsm8k_format

    def mine(prompts, completions, **_):
        return [1.0] * len(completions)

    assert resolve_reward(mine) is mine


def test_resolve_reward_by_import_path(tmp_path, monkeypatch):
    (tmp_path / "my_rewards_for_test.py").write_text(
        "class Scorers:\n"
        "    @staticmethod\n"
        "    def length(prompts, completions, **_):\n"
        "        return [float(len(c)) for c in completions]\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    length = resolve_reward("my_rewards_for_test:Scorers.length")
    assert length(["p"], ["abc"]) == [3.0]
    assert resolve_reward("math:sqrt") is math.sqrt
    assert resolve_reward("grpo.rewards.math:gsm8k_format") is gsm8k_format


def test_resolve_reward_typo_suggests_the_nearest_name_and_the_import_syntax():
    with pytest.raises(ValueError, match="gsm8k_corectness") as raised:
        resolve_reward("gsm8k_corectness")
    assert "did you mean 'gsm8k_correctness'" in str(raised.value)
    assert "package.module:function" in str(raised.value)


def test_resolve_reward_import_errors_name_the_module_and_the_cause():
    with pytest.raises(ImportError, match="no_such_module_xyz") as raised:
        resolve_reward("no_such_module_xyz:fn")
    assert isinstance(raised.value.__cause__, ModuleNotFoundError)
    with pytest.raises(ValueError, match="has no attribute 'nope'"):
        resolve_reward("math:nope")
    with pytest.raises(TypeError, match="not callable"):
        resolve_reward("math:pi")


def test_reward_name():
    class LengthReward:
        def __call__(self, prompts, completions, **_):
            return [0.0] * len(completions)

    assert reward_name(gsm8k_format) == "gsm8k_format"
    assert reward_name(LengthReward()) == "LengthReward"


def _constant(value_per_sample):
    def constant(prompts, completions, **_):
        return list(value_per_sample)

    return constant


def test_score_completions_weights_and_skips_none():
    # 3 samples, 2 functions with weights 2 and 0.5:
    #   sample 0: 2·1 + 0.5·4 = 4;  sample 1: r0 is None → 0.5·2 = 1;
    #   sample 2: both None → NaN, "not scored" (the advantages leave it out of the group baseline).
    first, second = _constant([1.0, None, None]), _constant([4, 2, None])
    second.__name__ = "second"
    scores = score_completions(
        [first, second], [2.0, 0.5], ["a", "b", "c"], ["x", "y", "z"], {"answer": [1, 2, 3]}
    )
    assert scores.names == ["constant", "second"]
    assert scores.per_function.dtype == torch.float32 and scores.per_function.shape == (3, 2)
    assert torch.equal(
        scores.per_function.isnan(), torch.tensor([[False, False], [True, False], [True, True]])
    )
    torch.testing.assert_close(scores.total, torch.tensor([4.0, 1.0, math.nan]), equal_nan=True)
    assert scores.none_applicable == 1


def test_score_completions_passes_columns_and_defaults_weights_to_one():
    seen = {}

    def correctness(prompts, completions, answer, **rest):
        seen.update(
            prompts=prompts,
            completions=completions,
            answer=answer,
            rest={k: v for k, v in rest.items() if k not in ("log_metric", "log_extra")},
        )
        return [True, False]

    scores = score_completions(
        [correctness, gsm8k_format],
        None,
        ["p0", "p1"],
        ["#### 1", "2"],
        {"answer": ["1", "1"], "level": [1, 2]},
    )
    assert seen == {
        "prompts": ["p0", "p1"],
        "completions": ["#### 1", "2"],
        "answer": ["1", "1"],
        "rest": {"level": [1, 2]},
    }
    assert torch.equal(scores.total, torch.tensor([2.0, 0.0]))


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_score_completions_rejects_non_finite_rewards_naming_function_sample_and_prompt(bad):
    long_prompt = "Q" * 500
    with pytest.raises(ValueError, match=r"'constant' returned .* for sample 1") as raised:
        score_completions([_constant([0.0, bad])], None, ["p", long_prompt], ["x", "y"], {})
    assert "Q" * 200 in str(raised.value) and "Q" * 201 not in str(raised.value)


def test_score_completions_rejects_wrong_length_and_wrong_types():
    with pytest.raises(RewardError, match=r"'constant' returned 1 rewards for 2 completions"):
        score_completions([_constant([1.0])], None, ["a", "b"], ["x", "y"], {})
    with pytest.raises(RewardError, match="'constant' returned 'high'"):
        score_completions([_constant(["high", 1.0])], None, ["a", "b"], ["x", "y"], {})
    with pytest.raises(ValueError, match="2 reward weights for 1 reward functions"):
        score_completions([_constant([1.0])], [1.0, 2.0], ["a"], ["x"], {})
    with pytest.raises(ValueError, match="column 'answer' has 1 values for 2 samples"):
        score_completions([_constant([1.0, 1.0])], None, ["a", "b"], ["x", "y"], {"answer": [1]})


def test_score_completions_wraps_exceptions_in_reward_error():
    def broken(prompts, completions, **_):
        raise KeyError("answer")

    with pytest.raises(RewardError, match="'broken' raised KeyError") as raised:
        score_completions([broken], None, ["a"], ["x"], {})
    assert isinstance(raised.value, RuntimeError) and isinstance(raised.value.__cause__, KeyError)


def test_each_reward_function_gets_its_own_copies_of_its_inputs():
    # The first function edits everything it was given in place; the second must still see the originals,
    # and so must the caller (samples.jsonl shows what the model wrote).
    def vandal(prompts, completions, answer, **_):
        completions[0] = "EDITED"
        completions.append("extra")
        prompts[0]["content"] = "EDITED"
        answer[1] = "EDITED"
        return [0.0, 0.0]

    seen = {}

    def observer(prompts, completions, answer, **_):
        seen.update(prompts=prompts, completions=completions, answer=answer)
        return [1.0, 1.0]

    prompts = [{"role": "user", "content": "p0"}, {"role": "user", "content": "p1"}]
    completions, answer = ["c0", "c1"], ["a0", "a1"]
    score_completions([vandal, observer], None, prompts, completions, {"answer": answer})
    assert seen == {
        "prompts": [{"role": "user", "content": "p0"}, {"role": "user", "content": "p1"}],
        "completions": ["c0", "c1"],
        "answer": ["a0", "a1"],
    }
    assert completions == ["c0", "c1"] and answer == ["a0", "a1"] and prompts[0]["content"] == "p0"


def test_reward_functions_with_the_same_name_get_distinct_metric_names():
    # Lambdas on purpose: they all share the name `<lambda>`.
    first = lambda prompts, completions, **_: [1.0, 1.0]  # noqa: E731
    second = lambda prompts, completions, **_: [0.0, 2.0]  # noqa: E731
    scores = score_completions([first, second, first], None, ["a", "b"], ["x", "y"], {})
    assert scores.names == ["<lambda>", "<lambda>_2", "<lambda>_3"]
    assert torch.equal(scores.per_function[:, 1], torch.tensor([0.0, 2.0]))


def test_batch_wide_extras_are_passed_whole_and_log_metric_is_collected():
    state = object()
    got = {}

    def fn(prompts, completions, trainer_state, log_metric, completion_ids, **_):
        got.update(state=trainer_state, ids=completion_ids)
        log_metric("my/metric", 2.0)
        log_metric("my/metric", 4.0)
        return [1.0, None]

    def fails_per_batch(prompts, completions, trainer_state, **_):
        assert trainer_state is state  # also when re-scored one sample at a time
        if len(prompts) > 1:
            raise RuntimeError("batch only")
        return [0.5]

    scores = score_completions(
        [fn, fails_per_batch],
        None,
        ["a", "b"],
        ["x", "y"],
        {"completion_ids": [[1, 2], [3]]},
        extras={"trainer_state": state},
        on_error="skip",
    )
    assert got == {"state": state, "ids": [[1, 2], [3]]}
    assert scores.logged == {"my/metric": 3.0}
    assert torch.equal(scores.total, torch.tensor([1.5, 0.5]))
