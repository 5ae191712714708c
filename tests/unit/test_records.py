"""records.py: building the TrainBatch and joining rollouts, on worked numbers."""

import torch

from grpo.records import PromptBatch, Rollouts, SamplingParams, concat_rollouts
from grpo.rollout.engine import generate_in_chunks
from grpo.stages import build_train_batch

PAD = 0


def _rollouts(groups: int, n: int, lengths: list[int], width: int, start: int = 10) -> Rollouts:
    ids = torch.arange(start, start + len(lengths) * width).reshape(len(lengths), width)
    mask = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).float()
    return Rollouts(
        group_ids=torch.arange(groups).repeat_interleave(n),
        completion_ids=ids.masked_fill(mask == 0, PAD),
        completion_mask=mask,
        sampling_logprobs=-mask,
        truncated=torch.tensor([length == width for length in lengths]),
    )


def test_build_train_batch_left_pads_prompts_and_spreads_advantages():
    prompts = PromptBatch(prompts=["a", "b"], prompt_token_ids=[[5], [6, 7, 8]])
    rollouts = _rollouts(groups=2, n=2, lengths=[2, 1, 2, 2], width=2)
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5])
    batch = build_train_batch(prompts, rollouts, advantages, PAD, gamma=0.5)
    assert batch.prompt_width == 3
    assert batch.input_ids.tolist() == [
        [PAD, PAD, 5, 10, 11],
        [PAD, PAD, 5, 12, PAD],
        [6, 7, 8, 14, 15],
        [6, 7, 8, 16, 17],
    ]
    assert batch.attention_mask.tolist() == [
        [0, 0, 1, 1, 1],
        [0, 0, 1, 1, 0],
        [1, 1, 1, 1, 1],
        [1, 1, 1, 1, 1],
    ]
    assert batch.position_ids[0].tolist() == [0, 0, 0, 1, 2]  # real tokens only, as generate counted them
    # γ = 0.5: the token before the last gets half the terminal advantage; padding gets nothing.
    assert batch.advantages.tolist() == [[0.5, 1.0], [-1.0, 0.0], [0.25, 0.5], [-0.25, -0.5]]
    assert batch.group_ids.tolist() == [0, 0, 1, 1]
    assert batch.ref_logprobs is None and batch.old_logprobs is None and batch.behaviour_logprobs is None


def test_build_train_batch_masks_truncated_completions_and_places_sampler_logprobs():
    prompts = PromptBatch(prompts=["a"], prompt_token_ids=[[5]])
    rollouts = _rollouts(groups=1, n=2, lengths=[2, 1], width=2)  # row 0 hit the limit
    kept = build_train_batch(prompts, rollouts, torch.ones(2), PAD)
    masked = build_train_batch(
        prompts,
        rollouts,
        torch.ones(2),
        PAD,
        mask_truncated=True,
        behaviour_logprobs=rollouts.sampling_logprobs,
    )
    assert kept.completion_mask.tolist() == [[1.0, 1.0], [1.0, 0.0]]
    assert masked.completion_mask.tolist() == [[0.0, 0.0], [1.0, 0.0]]
    assert masked.advantages.tolist() == [[0.0, 0.0], [1.0, 0.0]]
    assert masked.attention_mask[0].tolist() == [1, 1, 1]  # the tokens are still there to be attended
    assert masked.behaviour_logprobs is rollouts.sampling_logprobs and masked.old_logprobs is None


def test_concat_rollouts_offsets_groups_and_pads_to_the_longest():
    a = _rollouts(groups=2, n=1, lengths=[1, 2], width=2)
    b = _rollouts(groups=1, n=2, lengths=[3, 1], width=3, start=50)
    joined = concat_rollouts([a, b], [2, 1], pad_id=PAD)
    assert joined.group_ids.tolist() == [0, 1, 2, 2]
    assert joined.completion_ids.tolist() == [[10, PAD, PAD], [12, 13, PAD], [50, 51, 52], [53, PAD, PAD]]
    assert joined.completion_mask.sum(-1).tolist() == [1.0, 2.0, 3.0, 1.0]
    assert joined.sampling_logprobs[1].tolist() == [-1.0, -1.0, 0.0]
    assert joined.truncated.tolist() == [False, True, True, False]


def test_generate_in_chunks_matches_one_call():
    def generate(prompts, n, sampling):  # completion j of prompt p: tokens p[0], j + 1 (length 1 + p[0] % 2)
        rows = [[p[0], j + 1] for p in prompts for j in range(n)]
        lengths = [1 + p[0] % 2 for p in prompts for _ in range(n)]
        ids = torch.tensor(rows)
        mask = (torch.arange(2)[None, :] < torch.tensor(lengths)[:, None]).float()
        width = max(lengths)  # as an engine does: as wide as the longest completion of this call
        return Rollouts(
            group_ids=torch.arange(len(prompts)).repeat_interleave(n),
            completion_ids=ids.masked_fill(mask == 0, PAD)[:, :width],
            completion_mask=mask[:, :width],
            sampling_logprobs=-mask[:, :width],
            truncated=torch.zeros(len(rows), dtype=torch.bool),
        )

    prompts = [[2], [3], [4], [6], [7]]
    sampling = SamplingParams(max_new_tokens=2)
    whole = generate_in_chunks(generate, prompts, 2, sampling, None, PAD)
    chunked = generate_in_chunks(generate, prompts, 2, sampling, 2, PAD)  # [2] [3] | [4] [6] | [7]
    for name in ("group_ids", "completion_ids", "completion_mask", "sampling_logprobs", "truncated"):
        assert torch.equal(getattr(whole, name), getattr(chunked, name)), name


def test_prompt_batches_and_scores_are_cut_and_joined_by_their_declared_fields():
    from dataclasses import dataclass

    from grpo.records import RewardScores, join_rows, per_row, take_rows

    @dataclass
    class Tagged(PromptBatch):  # a new per-row field is one declaration, carried by cut and join
        difficulty: list = per_row(default_factory=list)  # noqa: RUF009 - a field declaration, as in records.py

    batch = Tagged(["a", "b", "c"], [[1], [2], [3]], {"answer": ["1", "2", "3"]}, [], ["easy", "hard", "mid"])
    kept = take_rows(batch, torch.tensor([2, 0]))
    assert (kept.prompts, kept.prompt_token_ids, kept.columns) == (
        ["c", "a"],
        [[3], [1]],
        {"answer": ["3", "1"]},
    )
    assert kept.indices == [] and kept.difficulty == ["mid", "easy"]  # untracked indices stay empty
    joined = join_rows([kept, take_rows(batch, slice(1, 2))])
    assert joined.prompts == ["c", "a", "b"] and joined.columns == {"answer": ["3", "1", "2"]}
    assert joined.difficulty == ["mid", "easy", "hard"] and len(joined) == 3

    scores = RewardScores(torch.arange(6.0).reshape(3, 2), ["f", "g"], torch.tensor([1.0, 5.0, 9.0]), 0)
    rows = take_rows(scores, torch.tensor([2]))
    assert rows.names == ["f", "g"] and torch.equal(rows.per_function, torch.tensor([[4.0, 5.0]]))
    assert torch.equal(join_rows([rows, scores]).total, torch.tensor([9.0, 1.0, 5.0, 9.0]))
