"""The vLLM engine on CUDA: colocated sleep/wake around weight sync, per-request seeds, a training run.
Skipped without CUDA or without vLLM (pip install 'grpo[vllm]'). Not yet run: no GPU was lent when written."""

from __future__ import annotations

import copy

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'grpo[vllm]')")

from grpo.config import GenerationConfig
from grpo.records import SamplingParams
from grpo.rollout import build_engine, resolve_auto
from tests.integration.test_vllm import QUESTIONS, _greedy, _learner_logprobs, _same_rollouts


@pytest.fixture(scope="module")
def parts():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo.run.assemble import resolve_path

    path = resolve_path("tiny-math-lm")
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to("cuda").eval()
    gen = GenerationConfig(vllm_gpu_memory_utilization=0.2, vllm_sleep=True)
    engine = build_engine("vllm", model, tokenizer, generation=gen)
    prompts = [
        list(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True, return_dict=False
            )
        )
        for q in QUESTIONS
    ]
    yield model, tokenizer, engine, prompts
    engine.close()


def test_auto_picks_vllm_on_cuda():
    assert resolve_auto(torch.device("cuda")) == "vllm"


def test_sleeps_after_generate_frees_memory_and_wakes_for_sync(parts):
    model, tokenizer, engine, prompts = parts
    free_awake = torch.cuda.mem_get_info()[0]
    before = _greedy(engine, prompts)
    assert engine.asleep  # slept after generating: the learner's update gets the KV cache's memory
    assert torch.cuda.mem_get_info()[0] > free_awake
    changed = copy.deepcopy(model)
    with torch.no_grad():
        for p in changed.parameters():
            p.mul_(1.1)
    engine.sync_weights(changed)
    after = _greedy(engine, prompts)
    assert not torch.equal(before.completion_ids, after.completion_ids)
    _same_rollouts(after, _greedy(build_engine("native", changed, tokenizer), prompts))
    engine.sync_weights(model)


def test_per_request_seeds_follow_torch(parts):
    model, tokenizer, engine, prompts = parts
    sampling = SamplingParams(max_new_tokens=24, temperature=1.0, top_k=0, top_p=1.0)
    torch.manual_seed(3)
    a = engine.generate(prompts, 4, sampling)
    torch.manual_seed(3)
    b = engine.generate(prompts, 4, sampling)
    assert torch.equal(a.completion_ids, b.completion_ids)
    learner = _learner_logprobs(model, tokenizer, prompts, a, 1.0)
    assert (
        learner.cpu() - a.sampling_logprobs
    ).abs().max() < 1e-2  # float32 weights; TF32 kernels may differ
