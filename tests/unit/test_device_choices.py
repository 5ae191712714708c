"""What the code chooses per device, checked on a CPU: the LM head's chunk, the training attention's
route, vLLM's dtype, FSDP2 in one process, and no `datasets` import at start-up. The CUDA branches run
for real only on a GPU (tests/gpu, ../shared/gpu/first-contact.sh); here their choice and, where a CPU
can run it, their arithmetic are checked."""

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from grpo.distributed.runtime import Runtime
from grpo.model import shared_prompt
from grpo.model.decoder import NativeDecoder
from grpo.model.packed import chunk_rows, shared_prompt_logprobs
from grpo.rollout.vllm import engine_dtype, hf_state
from tests.conftest import tiny_llama
from tests.unit.test_native import random_model, shared_prompt_batch

SRC = Path(__file__).resolve().parents[2] / "src"
QWEN_VOCAB = 151_936


def test_lm_head_chunks_are_cache_sized_on_a_cpu_and_large_on_cuda():
    assert chunk_rows(QWEN_VOCAB, torch.device("cpu")) == 27  # 2^22 float32 logits: the CPU's caches
    assert chunk_rows(QWEN_VOCAB, torch.device("cuda")) >= 1024  # a few launches per pass, not ~320
    assert chunk_rows(2**30, torch.device("cuda")) == 1


def test_completion_attention_route_per_device():
    # CPU: the packed pieces on the CPU flash kernel (model/packed_attention.py), no grids, no mask.
    assert shared_prompt.attention_route(torch.device("cpu")) == "packed"
    assert shared_prompt.attention_route(torch.device("mps")) == "gqa"  # the grid route elsewhere
    # CUDA: no fused kernel takes a mask with a GQA broadcast; expanded K/V reach memory-efficient SDPA.
    assert shared_prompt.attention_route(torch.device("cuda")) == "expand_kv"


def test_the_expanded_kv_route_gives_the_gqa_routes_logprobs_and_gradients(monkeypatch):
    model = random_model("qwen2").train()
    batch = shared_prompt_batch()

    def run():
        model.zero_grad()
        logp, _ = shared_prompt_logprobs(NativeDecoder(model), batch, 1.0)
        (logp * batch.advantages).sum().backward()
        return logp.detach(), [p.grad.clone() for p in model.parameters()]

    monkeypatch.setattr(shared_prompt, "attention_route", lambda device: "gqa")
    gqa = run()
    monkeypatch.setattr(shared_prompt, "attention_route", lambda device: "expand_kv")
    expanded = run()
    assert torch.allclose(gqa[0], expanded[0], atol=1e-5)
    for a, b in zip(gqa[1], expanded[1], strict=True):
        assert torch.allclose(a, b, atol=1e-5)


def test_vllm_runs_in_the_compute_dtype_not_the_masters():
    model = tiny_llama()  # float32 masters
    assert engine_dtype(model, torch.bfloat16) == torch.bfloat16
    assert engine_dtype(model, None) == torch.float32  # no compute dtype: the weights' own
    state = hf_state(model, dtype=torch.bfloat16)  # what a weight sync writes: half the bytes
    assert {v.dtype for v in state.values() if v.is_floating_point()} == {torch.bfloat16}
    assert torch.equal(state["lm_head.weight"], model.lm_head.weight.detach().to(torch.bfloat16))


def test_vllm_captures_cuda_graphs_on_cuda_unless_asked_not_to():
    from grpo.config import GRPOConfig
    from grpo.rollout.vllm import enforce_eager

    assert GRPOConfig().generation.vllm_enforce_eager is None  # the default: decided per device
    assert enforce_eager(None, cuda=True) is False and enforce_eager(None, cuda=False) is True
    assert enforce_eager(True, cuda=True) is True and enforce_eager(False, cuda=False) is False


def test_a_weight_sync_hands_vllm_the_live_tensors_in_process(monkeypatch):
    """One worker with the engine core in this process: the weights go to `reload_weights` as tensors (no
    file in /dev/shm, no CPU copy: on CUDA they stay on the GPU), with hf_state's names and values. Several
    workers, or the core in another process, keep the file."""
    from grpo.rollout.vllm import live_state, weights_in_process

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    assert weights_in_process(1) and not weights_in_process(2)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    assert not weights_in_process(1)
    model = tiny_llama()
    for dtype in (None, torch.bfloat16):
        streamed = dict(live_state(model, dtype))
        written = hf_state(model, dtype=dtype)
        assert streamed.keys() == written.keys()
        assert all(
            torch.equal(streamed[k], written[k]) and streamed[k].dtype == written[k].dtype for k in written
        )
    weight = model.model.layers[0].mlp.up_proj.weight
    assert dict(live_state(model))["model.layers.0.mlp.up_proj.weight"].data_ptr() == weight.data_ptr()


def test_fsdp2_in_one_process_says_nothing_is_sharded(caplog):
    logger = logging.getLogger("grpo")
    logger.addHandler(caplog.handler)
    caplog.set_level(logging.INFO, logger="grpo")
    try:
        model = tiny_llama()
        assert Runtime(strategy="fsdp2").wrap(model) is model
    finally:
        logger.removeHandler(caplog.handler)
    assert "nothing is sharded" in caplog.text


def test_start_up_imports_no_datasets():
    """`datasets` is not needed to start a run on bundled data (the GPU image lacks it): setup_logging
    and the training modules load with it blocked."""
    code = (
        "import sys; sys.modules['datasets'] = None\n"
        "import grpo.train, grpo.cli\n"
        "from grpo.run.rundir import setup_logging\n"
        "setup_logging()\n"
        "import os; print(os.environ['HF_DATASETS_DISABLE_PROGRESS_BARS'])"
    )
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    env.pop("HF_DATASETS_DISABLE_PROGRESS_BARS", None)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "1"


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_fsdp2_on_a_one_device_mesh_wraps_clips_and_gathers(device, tmp_path, monkeypatch):
    """fully_shard over one process (gloo on a CPU, NCCL on a GPU): the wrapping, the DTensor gradient
    clipping and the full state dicts run as they do over several, and give the unsharded numbers."""
    import torch.distributed as dist

    dist.init_process_group(
        "nccl" if device == "cuda" else "gloo",
        init_method=f"file://{tmp_path / 'store'}",
        rank=0,
        world_size=1,
    )
    try:
        monkeypatch.setattr(Runtime, "active", property(lambda self: True))  # shard though world_size is 1
        rt = Runtime(strategy="fsdp2")
        plain, sharded = tiny_llama().to(device).train(), tiny_llama().to(device).train()
        ids = torch.randint(3, 48, (2, 8), device=device)
        plain(input_ids=ids).logits.square().mean().backward()
        expected = torch.nn.utils.clip_grad_norm_(plain.parameters(), 1.0).item()
        wrapped = rt.wrap(sharded)
        assert rt.sharded and type(wrapped).__name__.startswith("FSDP")
        wrapped(input_ids=ids).logits.square().mean().backward()
        norm = rt.clip_grad_norm([p for p in wrapped.parameters() if p.grad is not None], 1.0)
        assert abs(norm - expected) <= 1e-5 * expected
        optimizer = torch.optim.AdamW(wrapped.parameters(), lr=1e-3)
        optimizer.step()
        full = rt.full_state_dict(wrapped)
        # every weight once (the tied head is the embedding), gathered whole on the host
        assert set(plain.state_dict()) - set(full) <= {"lm_head.weight"}
        assert all(v.device.type == "cpu" and v.shape == plain.state_dict()[k].shape for k, v in full.items())
        state = rt.optimizer_state(wrapped, optimizer)
        rt.load_optimizer_state(wrapped, optimizer, state)
        rt.load_full_state_dict(wrapped, plain.state_dict())
        assert all(
            torch.equal(v, plain.state_dict()[k].cpu()) for k, v in rt.full_state_dict(wrapped).items()
        )
    finally:
        dist.destroy_process_group()
