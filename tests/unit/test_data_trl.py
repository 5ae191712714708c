"""Datasets as TRL users have them: DatasetDict, conversational prompts, a `solution` column, chat templates
applied once and with chat_template_kwargs."""

import pytest
from datasets import Dataset, DatasetDict
from transformers import AutoTokenizer

from grpo.config import ConfigError, DataConfig
from grpo.data import PromptFormatter, make_prompt_batch, rows_from_dataset
from grpo.model.loading import bundled_model_path

CHAT = [{"role": "user", "content": "What is 2 + 3?"}]


def test_dataset_dict_conversational_prompt_and_solution_column_kept():
    train = Dataset.from_list([{"prompt": CHAT, "solution": "5", "level": 1}])
    other = Dataset.from_list([{"prompt": "x", "solution": "0", "level": 9}])
    rows = rows_from_dataset(DatasetDict(train=train, test=other))
    # the prompt as the dataset gave it; `solution` under its own name, copied to `answer` for our rewards
    assert rows == [{"prompt": CHAT, "solution": "5", "answer": "5", "level": 1}]
    assert rows_from_dataset(DatasetDict(test=other), split="test")[0]["level"] == 9
    assert rows_from_dataset(DatasetDict(only=train))[0]["level"] == 1  # the only split
    with pytest.raises(ConfigError, match="none is named 'train'"):
        rows_from_dataset(DatasetDict(a=train, b=other))


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(bundled_model_path())


def test_reward_prompts_are_the_datasets_and_text_is_templated_once(tokenizer):
    formatter = PromptFormatter(tokenizer, DataConfig())
    rows = [{"prompt": CHAT, "solution": "5"}, {"prompt": "What is 1 + 1?", "solution": "2"}]
    batch = make_prompt_batch([0, 1], rows, formatter)
    assert batch.prompts == [CHAT, "What is 1 + 1?"]
    assert batch.columns == {"solution": ["5", "2"]}
    templated = formatter.text("What is 1 + 1?")
    assert templated != "What is 1 + 1?" and formatter.text(CHAT) == formatter.text("What is 2 + 3?")
    assert formatter.text(templated) == templated  # a dataset templated beforehand is not templated again
    trl_like = PromptFormatter(tokenizer, DataConfig(chat_template_for_text=False))
    assert trl_like.text("What is 1 + 1?") == "What is 1 + 1?" and trl_like.text(CHAT) == templated.replace(
        "1 + 1", "2 + 3"
    )


def test_chat_template_kwargs_reach_the_template(tokenizer):
    tok = AutoTokenizer.from_pretrained(bundled_model_path())
    tok.chat_template = "{% if greeting %}HELLO {% endif %}{{ messages[-1]['content'] }}"
    plain = PromptFormatter(tok, DataConfig())
    greeted = PromptFormatter(tok, DataConfig(chat_template_kwargs={"greeting": True}))
    assert plain.text(CHAT) == "What is 2 + 3?" and greeted.text(CHAT) == "HELLO What is 2 + 3?"
