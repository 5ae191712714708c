"""Learned scorers as reward functions: a sequence classifier's score, or a causal LM's likelihood.

`prompts` are the dataset's prompt texts before any chat template; the template, when the tokenizer has
one, is applied here so the scorer sees text laid out the way it was trained on.

Rows are right-padded: under a causal attention mask, padding after the last real token cannot change
the real tokens' outputs, and positions stay 0..L-1 as without padding, so scores do not depend on the
batch a sample lands in.

The prompt and the completion are text, never control tokens: a completion that writes "<|im_end|>" must not
close the assistant turn the scorer reads (and end the span it scores early). They are masked before the chat
template renders (data/literal_text.py), or tokenized with special-token strings split, without a template.
"""

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from grpo.data.literal_text import LiteralText
from grpo.model.packed import ChunkedTokenLogprobs, plain_lm_head


class SequenceClassifierReward:
    """Scores (prompt, completion) pairs with a `*ForSequenceClassification` reward model.

    Text is the chat template over [user: prompt, assistant: completion] when the tokenizer has one,
    else `prompt + completion`. The reward is the head's logit for the last real token: label 0 when
    `num_labels == 1`; with more labels the last label's logit, because binary preference heads put the
    "chosen" / "good" class last by convention. With `max_length`, the *start* of a long text is cut,
    since the head reads the final token.
    """

    def __init__(self, model, tokenizer, batch_size: int = 16, max_length: int | None = None):
        self.model, self.tokenizer = model, tokenizer
        self.batch_size, self.max_length = batch_size, max_length
        text_config = model.config.get_text_config()
        if text_config.pad_token_id is None:
            # The head finds each row's last real token by its pad ids; without one it refuses batches.
            text_config.pad_token_id = _padding_id(tokenizer)
        # Pad with the id the head looks for, which can differ from the tokenizer's.
        self.pad_id = text_config.pad_token_id
        self.literal = LiteralText(tokenizer)
        self.__name__ = "reward_model"

    def __call__(self, prompts: list[str], completions: list[str], **_: list) -> list[float]:
        rows = [
            self._token_ids(prompt, completion)
            for prompt, completion in zip(prompts, completions, strict=True)
        ]
        scores: list[float] = []
        with _scoring(self.model):
            for start in range(0, len(rows), self.batch_size):
                input_ids, attention_mask = _right_padded(
                    rows[start : start + self.batch_size], self.pad_id, self.model.device
                )
                logits = self.model(
                    input_ids=input_ids, attention_mask=attention_mask
                ).logits  # [B, num_labels]
                scores.extend(logits[:, -1].float().tolist())
        return scores

    def _token_ids(self, prompt: str, completion: str) -> list[int]:
        if _has_chat_template(self.tokenizer):
            dialogue = [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
            text = self.tokenizer.apply_chat_template(self.literal.mask(dialogue), tokenize=False)
            # The template writes its own BOS; encode adds none.
            token_ids = self.literal.encode(text)
        else:
            token_ids = _text_ids(self.literal, prompt + completion, add_special_tokens=True)
        return token_ids[-self.max_length :] if self.max_length else token_ids


class CausalLMLikelihoodReward:
    """The reward a causal LM gives when passed as `reward_model`: how likely it finds the completion.

    Mean per-token log-likelihood of the completion tokens given the prompt (the chat-templated user turn
    with the generation prompt when the tokenizer has a template), so it is ≤ 0 and not biased by length.
    An empty completion is scored as the log-likelihood of EOS alone: the model's belief that the answer
    should end right there. A prompt that tokenizes to nothing is replaced by BOS (or EOS) as context.
    """

    def __init__(self, model, tokenizer, batch_size: int = 16):
        if tokenizer.eos_token_id is None:
            raise ValueError(
                "CausalLMLikelihoodReward needs a tokenizer with an EOS token (it scores empty completions)"
            )
        self.model, self.tokenizer, self.batch_size = model, tokenizer, batch_size
        self.pad_id = _padding_id(tokenizer)
        self.literal = LiteralText(tokenizer)
        self.__name__ = "reward_model_likelihood"

    def __call__(self, prompts: list[str], completions: list[str], **_: list) -> list[float]:
        rows = [
            self._token_ids(prompt, completion)
            for prompt, completion in zip(prompts, completions, strict=True)
        ]
        scores: list[float] = []
        with _scoring(self.model):
            for start in range(0, len(rows), self.batch_size):
                batch = rows[start : start + self.batch_size]
                sequences = [prompt_ids + completion_ids for prompt_ids, completion_ids in batch]
                input_ids, attention_mask = _right_padded(sequences, self.pad_id, self.model.device)
                head = plain_lm_head(self.model)
                if head is not None:  # decoder, then the head in row chunks: no [B, T, V] logits
                    hidden = self.model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask)
                    hidden = hidden.last_hidden_state  # [B, T, d]
                else:
                    logits = self.model(
                        input_ids=input_ids, attention_mask=attention_mask
                    ).logits  # [B, T, V]
                for row, (prompt_ids, completion_ids) in enumerate(batch):
                    first, end = len(prompt_ids), len(prompt_ids) + len(completion_ids)
                    targets = input_ids[row, first:end, None]  # [C, 1]
                    # Position t predicts token t+1.
                    if head is not None:
                        log_probs, _ = ChunkedTokenLogprobs.apply(
                            hidden[row, first - 1 : end - 1], head.weight, targets[:, 0], 1.0, False
                        )  # [C]
                        scores.append(log_probs.mean().item())
                        continue
                    # Upcast only this row's slice to bound fp32 memory.
                    log_probs = torch.log_softmax(logits[row, first - 1 : end - 1].float(), dim=-1)  # [C, V]
                    scores.append(log_probs.gather(-1, targets).mean().item())
        return scores

    def _token_ids(self, prompt: str, completion: str) -> tuple[list[int], list[int]]:
        tokenizer = self.tokenizer
        if _has_chat_template(tokenizer):
            text = tokenizer.apply_chat_template(
                self.literal.mask([{"role": "user", "content": prompt}]),
                tokenize=False,
                add_generation_prompt=True,
            )
            prompt_ids = self.literal.encode(text)
        else:
            prompt_ids = _text_ids(self.literal, prompt, add_special_tokens=True)
        context_id = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
        completion_ids = _text_ids(self.literal, completion, add_special_tokens=False)
        return prompt_ids or [context_id], completion_ids or [tokenizer.eos_token_id]


def reward_from_model(model, tokenizer, **kwargs) -> SequenceClassifierReward | CausalLMLikelihoodReward:
    """The reward function a model stands for: a classifier's score, or a causal LM's likelihood.

    Classifier: class name ending in `ForSequenceClassification`, or a `score` head with
    `config.num_labels`. Causal LM: class name ending in `ForCausalLM` or `LMHeadModel` (GPT-2 style).
    `kwargs` go to the reward class (`batch_size`, and `max_length` for classifiers).
    """
    class_name = type(model).__name__
    config = getattr(model, "config", None)
    if class_name.endswith("ForSequenceClassification") or (
        hasattr(model, "score") and hasattr(config, "num_labels")
    ):
        return SequenceClassifierReward(model, tokenizer, **kwargs)
    if class_name.endswith(("ForCausalLM", "LMHeadModel")):
        return CausalLMLikelihoodReward(model, tokenizer, **kwargs)
    raise TypeError(
        f"cannot use a {class_name} as a reward model: pass a *ForSequenceClassification model "
        "(its score is the reward) or a *ForCausalLM model "
        "(the completion's mean log-likelihood is the reward)"
    )


def _padding_id(tokenizer) -> int:
    # Right padding is never attended to, so EOS is a safe stand-in when the tokenizer has no pad token.
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad_id is None:
        raise ValueError(
            "the reward model's tokenizer has neither a pad nor an EOS token to pad batches with"
        )
    return pad_id


def _text_ids(literal: LiteralText, text: str, add_special_tokens: bool) -> list[int]:
    """`text` tokenized as text: a special token's string in it is split like any other text (the plain
    call where it holds none, so such rows tokenize as they always did)."""
    split = {"split_special_tokens": True} if literal.holds_special(text) else {}
    return list(literal.tokenizer(text, add_special_tokens=add_special_tokens, **split).input_ids)


def _has_chat_template(tokenizer) -> bool:
    return getattr(tokenizer, "chat_template", None) is not None


def _right_padded(
    rows: list[list[int]], pad_id: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(row) for row in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)  # [B, T]
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)  # [B, T]
    for index, row in enumerate(rows):
        input_ids[index, : len(row)] = torch.tensor(row, dtype=torch.long)
        attention_mask[index, : len(row)] = 1
    return input_ids.to(device), attention_mask.to(device)


@contextmanager
def _scoring(model) -> Iterator[None]:
    # The model may be the policy being trained: switch dropout off for scoring, then restore its mode.
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was_training)
