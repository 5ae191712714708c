"""The compiled training block (model/compiled.py) computes what the eager block computes."""

import torch

from grpo.model.compiled import compile_report
from grpo.model.decoder import NativeDecoder
from grpo.model.packed import shared_prompt_logprobs
from tests.unit.test_native import random_model, shared_prompt_batch


def test_compiled_block_matches_eager_log_probs_and_gradients():
    """Forward log-probs and every parameter's gradient, eager against compiled, on two micro-batches of
    different packed sizes (the dynamic token dimension: no new graph for the second) and a no-grad
    reference pass. About a minute of compilation on a 2-core CPU."""
    model = random_model("qwen3").train()  # q/k norms: every op of the compiled pieces

    def run(compiled: bool, batch, grad: bool = True):
        model.zero_grad()
        dec = NativeDecoder(model)
        dec.compile_blocks = compiled
        with torch.set_grad_enabled(grad):
            logp, _ = shared_prompt_logprobs(dec, batch, 0.9)
        if not grad:
            return logp, {}
        (logp * batch.advantages).sum().backward()
        return logp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    graphs = None
    for seed in (0, 3):  # 3: other completion lengths, so another packed token count
        batch = shared_prompt_batch(seed=seed)
        mask = batch.completion_mask
        (eager, eager_grads), (compiled, compiled_grads) = run(False, batch), run(True, batch)
        assert torch.allclose(compiled * mask, eager * mask, atol=1e-5)
        for name, g in eager_grads.items():
            assert (compiled_grads[name] - g).abs().max() <= 1e-5 * g.abs().max(), name
        if graphs is None:
            graphs = compile_report()["graphs"]
    assert compile_report()["graphs"] == graphs  # the second size reused the compiled graphs
    no_grad_eager, _ = run(False, batch, grad=False)
    no_grad_compiled, _ = run(True, batch, grad=False)
    assert torch.allclose(no_grad_compiled * mask, no_grad_eager * mask, atol=1e-5)


def test_compile_default_follows_device_steps_and_compiler(monkeypatch):
    from grpo.model import compiled

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.setattr(compiled, "cpp_compiler", lambda: "g++")
    assert compiled.compile_by_default(cpu, compiled.AMORTISE_STEPS)
    assert not compiled.compile_by_default(cpu, compiled.AMORTISE_STEPS - 1)  # not repaid: tests, demos
    assert not compiled.compile_by_default(cuda, 10_000)  # not measured on a GPU yet
    monkeypatch.setattr(compiled, "cpp_compiler", lambda: None)
    assert not compiled.compile_by_default(cpu, 10_000)


def test_explicit_compile_without_a_compiler_is_a_config_error(monkeypatch):
    import shutil

    import pytest

    from grpo.config import ConfigError, GRPOConfig

    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(shutil, "which", lambda name: None)
    cfg = GRPOConfig(batch_size=2, num_generations=4)
    cfg.update({"model.compile_training": True, "model.device": "cpu"})
    with pytest.raises(ConfigError, match="needs a C\\+\\+ compiler"):
        cfg.validate()
