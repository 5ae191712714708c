"""An evaluated agent episode that forked (several rows of one Episode) is scored once, against its own row
of the dataset (issue 31: the rows after it were scored against the wrong prompts)."""

import torch
from transformers import AutoTokenizer

from grpo.config import GRPOConfig
from grpo.data import PromptFormatter
from grpo.evaluation import evaluate
from grpo.model.loading import bundled_model_path
from grpo.records import Episode, Rollouts


class ForkingSampler:
    """k = 1: the first prompt's episode forked into 3 rows; the second prompt's episode is one row."""

    def sample(self, prompts, n, sampling):
        del sampling
        assert n == 1 and len(prompts) == 2
        first, second = (
            Episode(messages=[{"role": "assistant", "content": f"So #### {a}"}]) for a in (27, 5)
        )
        rows = 4
        rollouts = Rollouts(
            group_ids=torch.tensor([0, 0, 0, 1]),
            completion_ids=torch.ones(rows, 2, dtype=torch.long),
            completion_mask=torch.ones(rows, 2),
            sampling_logprobs=torch.zeros(rows, 2),
            truncated=torch.zeros(rows, dtype=torch.bool),
            episodes=[first, first, first, second],
        )
        return prompts, rollouts


def test_a_forked_episode_is_scored_once_against_its_own_row():
    tokenizer = AutoTokenizer.from_pretrained(bundled_model_path())
    formatter = PromptFormatter(tokenizer, GRPOConfig().data)
    rows = [
        {"prompt": "What is 3 * 9?", "answer": "#### 27"},
        {"prompt": "What is 2 + 3?", "answer": "#### 5"},
    ]
    result = evaluate(ForkingSampler(), formatter, rows, max_new_tokens=4)
    assert result.accuracy == 1.0 and result.n == 2
    assert [r["completions"] for r in result.records] == [["So #### 27"], ["So #### 5"]]
