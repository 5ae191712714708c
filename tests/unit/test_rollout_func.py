"""TRL 1.16's rollout_func as an episode runner (rollout/rollout_func.py): its output becomes Rollouts token
for token, env_mask becomes the loss mask, extra keys reach reward functions, and contract breaks are one
line."""

from __future__ import annotations

import pytest
import torch

from grpo.records import PromptBatch, SamplingParams
from grpo.rollout.rollout_func import RolloutFunc, RolloutFuncError
from grpo.trl_compat import reward_inputs

EOS, PAD = 2, 0
SAMPLING = SamplingParams(max_new_tokens=8)


def batch(n_prompts: int) -> PromptBatch:
    return PromptBatch(
        prompts=[[{"role": "user", "content": f"q{i}"}] for i in range(n_prompts)],
        prompt_token_ids=[[] for _ in range(n_prompts)],
        indices=list(range(n_prompts)),
    )


def trl_style(prompts, trainer):
    """Two completions per prompt; the second ends with tokens an environment added (env_mask 0)."""
    out = {"prompt_ids": [], "completion_ids": [], "logprobs": [], "env_mask": [], "judge": []}
    for i, _ in enumerate(prompts):
        for k in range(2):
            out["prompt_ids"].append([10 + i, 11])
            ids = [5, 6, EOS] if k == 0 else [5, 7, 8, 9]  # the second has no eos: truncated
            out["completion_ids"].append(ids)
            out["logprobs"].append([-0.5] * len(ids))
            out["env_mask"].append([1, 1, 1] if k == 0 else [1, 0, 0, 1])
            out["judge"].append(f"p{i}c{k}")
    return out


def runner(fn=trl_style) -> RolloutFunc:
    return RolloutFunc(fn, num_generations=2, pad_id=PAD, eos_ids={EOS})


def test_trl_rollout_func_output_becomes_rollouts_token_for_token():
    prompts, r = runner().run(None, batch(2), 2, SAMPLING)
    assert prompts.prompt_token_ids == [[10, 11], [11, 11]]
    assert r.group_ids.tolist() == [0, 0, 1, 1]
    assert r.completion_ids[1].tolist() == [5, 7, 8, 9] and r.completion_ids[0].tolist() == [5, 6, EOS, PAD]
    assert r.loss_mask[1].tolist() == [1, 0, 0, 1] and r.completion_mask[1].tolist() == [1, 1, 1, 1]
    assert r.sampling_logprobs[1].tolist() == [-0.5, 0.0, 0.0, -0.5]  # env tokens: no sampler log-prob
    assert r.truncated.tolist() == [False, True, False, True]
    _, _, columns = reward_inputs(prompts, r, ["t"] * 4)
    assert columns["judge"] == ["p0c0", "p0c1", "p1c0", "p1c1"]


def test_the_trainer_reaches_the_function_with_the_engine_to_sample_from():
    seen = {}

    class Trainer:
        pass

    def fn(prompts, trainer):
        seen.update(engine=trainer.rollout_engine, n=trainer.num_generations, prompts=prompts)
        return trl_style(prompts, trainer)

    run = runner(fn)
    run.trainer = Trainer()
    run.run("the engine", batch(1), 2, SAMPLING)
    assert seen == {"engine": "the engine", "n": 2, "prompts": [[{"role": "user", "content": "q0"}]]}


def _broken(**changes):
    def fn(prompts, trainer):
        out = trl_style(prompts, trainer)
        for key, value in changes.items():
            if value is None:
                del out[key]
            else:
                out[key] = value(out[key])
        return out

    return fn


@pytest.mark.parametrize(
    ("fn", "says"),
    [
        (_broken(logprobs=None), r"must return a dict with prompt_ids, completion_ids, logprobs"),
        (_broken(completion_ids=lambda v: v[:3]), r"'completion_ids' has 3 entries for 4 completions"),
        (_broken(logprobs=lambda v: [x[:1] for x in v]), r"completion 0 has 3 token ids but 1 logprobs"),
        (
            _broken(prompt_ids=lambda v: [[i] for i in range(4)]),
            r"completions of prompt 0 came from different",
        ),
        (_broken(judge=lambda v: v[:1]), r"'judge' has 1 values for 4 completions"),
        (_broken(logprobs=lambda v: [[float("nan")] * len(x) for x in v]), r"non-finite log-prob"),
    ],
)
def test_a_broken_contract_is_one_line(fn, says):
    with pytest.raises(RolloutFuncError, match=says) as e:
        runner(fn).run(None, batch(2), 2, SAMPLING)
    assert "\n" not in str(e.value)


def test_grpo_trainer_accepts_rollout_func_and_trains_with_it(tmp_path):
    from grpo import GRPOConfig, GRPOTrainer
    from tests.integration.test_agents_e2e import SETTINGS, dataset, model_and_tokenizer

    model, tokenizer = model_and_tokenizer()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    calls = []

    def sample(prompts, trainer):
        """Render each prompt, sample from the run's engine, hand back TRL's dict."""
        tok = trainer.processing_class
        ids = [
            tok.apply_chat_template(p, add_generation_prompt=True, tokenize=True, return_dict=False)
            for p in prompts
        ]
        out = trainer.rollout_engine.generate(ids, trainer.num_generations, trainer.rollout_sampling)
        n = out.completion_mask.sum(-1).long().tolist()
        calls.append(len(prompts))
        return {
            "prompt_ids": [ids[g] for g in out.group_ids.tolist()],
            "completion_ids": [row[:k] for row, k in zip(out.completion_ids.tolist(), n, strict=True)],
            "logprobs": [row[:k] for row, k in zip(out.sampling_logprobs.tolist(), n, strict=True)],
            "tag": [f"c{i}" for i in range(len(n))],
        }

    def tagged(completions, tag, **_):
        return [float(t.endswith(("0", "2"))) for t in tag]

    cfg = GRPOConfig(**SETTINGS, output_dir=str(tmp_path / "run"))
    trainer = GRPOTrainer(
        model=model, tokenizer=tokenizer, config=cfg, train_dataset=dataset(), reward_funcs=[tagged],
        rollout_func=sample,
    )  # fmt: skip
    summary = trainer.train()
    assert calls == [2, 2] and summary["reward/tagged"] == 0.5
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())
