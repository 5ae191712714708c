"""What every engine that samples from logits itself shares: the stop tokens, and exact sampling.

`filter_logits` applies temperature, top-k and top-p in float32 (transformers' order); `sample_tokens`
draws by inverse CDF (one uniform per row), which picks token i with probability p_i up to float32
rounding of the cumulative sum, and returns the chosen token's log-prob under that same distribution,
which is what the learner's importance ratios and π_old need.
"""

from __future__ import annotations

import torch

from grpo.records import SamplingParams


def filter_logits(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Temperature, then top-k, then nucleus filtering (the order transformers uses); −inf = removed."""
    logits = logits / temperature if temperature != 1.0 else logits  # [N, V] (÷1 would only copy)
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # [N, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)  # [N, V]
        probs = sorted_logits.softmax(-1)
        # Drop a token when the mass strictly before it already reaches top_p; the top token always stays.
        drop_sorted = probs.cumsum(-1) - probs >= top_p  # [N, V]
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_tokens(logits: torch.Tensor, sampling: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row from logits [n, V] and its log-prob under the sampling distribution: ([n], [n])."""
    logits = logits.float()
    if sampling.greedy:
        tokens = logits.argmax(-1)  # [n]
        return tokens, logits.log_softmax(-1).gather(-1, tokens[:, None]).squeeze(-1)
    logp = filter_logits(logits, sampling.temperature, sampling.top_k, sampling.top_p).log_softmax(
        -1
    )  # [n, V]
    # Inverse CDF: token i owns [cdf_{i-1}, cdf_i); a filtered token's interval is empty and never drawn.
    cdf = logp.exp().cumsum(-1)  # [n, V]
    total = cdf[:, -1:]  # [n, 1]
    # u can round up to the total (p ≈ 1e-7), where no interval holds it: keep it one float below, in
    # the interval of the last token with mass. Done on [n, 1], not as a search over the [n, V] logits
    # on every step for a draw that almost never needs it.
    u = torch.minimum(
        torch.rand(cdf.shape[0], 1, device=cdf.device) * total, total.nextafter(total.new_zeros(()))
    )
    tokens = torch.searchsorted(cdf, u, right=True).squeeze(-1)  # [n]
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)


def pad_and_eos(model, tokenizer) -> tuple[int, list[int]]:
    """The pad id completions are padded with, and the token ids that end one (the model's generation
    config first, else the tokenizer's eos; empty: no eos, completions run to the length limit)."""
    if tokenizer.pad_token_id is None:
        raise ValueError("The tokenizer has no pad token; set tokenizer.pad_token (e.g. to its eos token).")
    config = getattr(model, "generation_config", None)  # a bare nn.Module has none
    eos = config.eos_token_id if config is not None else None
    eos = eos if eos is not None else tokenizer.eos_token_id
    return tokenizer.pad_token_id, sorted(
        {e for e in (eos if isinstance(eos, list) else [eos]) if e is not None}
    )
