"""Replay (model/replay.py): the update reuses the rollout's forward when μ = 1.

The replayed forward must give the recomputed forward's log-probs (and so the sampling log-probs) and every
weight gradient to float32 rounding; recording must not change what the rollout samples; a micro-batch that
is not what was recorded runs the normal forward; and the auto rule turns replay off where it cannot hold.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from grpo.config import GRPOConfig
from grpo.config.errors import ConfigError
from grpo.learner import Learner
from grpo.model.forward import PolicyForward
from grpo.model.replay import Replay, ReplayTape, recording_bytes
from grpo.records import PromptBatch, SamplingParams
from grpo.rollout.native import NativeEngine
from grpo.stages import build_train_batch
from tests.conftest import IdTokenizer
from tests.unit.test_native import random_model

PROMPTS = [[3, 4, 5, 6, 7], [8, 9], [10, 11, 12]]


def _model(arch: str):
    model = random_model(arch)
    with torch.no_grad():  # smaller weights than random_model's: completions of varied lengths
        for p in model.parameters():
            p.mul_(0.5)
    return model


def _rollout(model, tape: ReplayTape | None, seed: int = 0, n: int = 4, t: int = 12):
    engine = NativeEngine(model, IdTokenizer())
    engine.tape = tape
    if tape is not None:
        tape.arm()
    torch.manual_seed(seed)
    rollouts = engine.generate(PROMPTS, n, SamplingParams(max_new_tokens=t, temperature=1.0))
    return rollouts, (None if tape is None else tape.take())


def _batch(rollouts):
    prompts = PromptBatch(prompts=[""] * len(PROMPTS), prompt_token_ids=PROMPTS)
    adv = torch.randn(len(rollouts.group_ids), generator=torch.Generator().manual_seed(1))
    return build_train_batch(prompts, rollouts, adv, 0, old_logprobs=rollouts.sampling_logprobs)


def _forward_and_grads(model, batch, slices, recording=None):
    """Log-probs [N, T] and every weight gradient of Σ logp·w over the micro-batches `slices`."""
    fwd = PolicyForward(model, native=True)
    model.zero_grad()
    t = batch.completion_mask.shape[1]
    out = torch.zeros(len(batch), t)
    weight = torch.rand(len(batch), t, generator=torch.Generator().manual_seed(2))
    for rows in slices:
        mb = batch.rows(rows).trim()
        replay = None if recording is None else Replay(recording, rows.start)
        logp, _ = fwd(mb, 1.0, replay=replay)
        (logp * weight[rows, : logp.shape[1]]).sum().backward()
        out[rows, : logp.shape[1]] = logp.detach()
    return out, {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama"])  # q/k/v bias; q/k norms; neither
def test_the_replayed_update_gives_the_recomputed_forward_s_logprobs_and_gradients(arch):
    model = _model(arch)
    rollouts, recording = _rollout(model, ReplayTape())
    lengths = rollouts.completion_mask.sum(1)
    assert lengths.min() < lengths.max()  # ragged rows: eos-ended and truncated
    batch = _batch(rollouts)
    slices = [slice(0, 5), slice(5, 12)]  # the first micro-batch ends inside a group
    want, want_grads = _forward_and_grads(model, batch, slices)
    got, got_grads = _forward_and_grads(model, batch, slices, recording)
    assert (recording.replayed, recording.missed) == (2, 0)
    mask = batch.completion_mask
    torch.testing.assert_close(got * mask, want * mask, rtol=0, atol=5e-6)
    torch.testing.assert_close(got * mask, rollouts.sampling_logprobs, rtol=0, atol=5e-6)  # ≈ π_old
    for name, g in want_grads.items():
        assert (got_grads[name] - g).norm() <= 1e-5 * g.norm() + 1e-9, name


def test_recording_leaves_the_rollout_as_it_was():
    """Same tokens for one seed, log-probs to float rounding (bit-equal where the decode's GEMM library is
    MKL; oneDNN's fused SiLU·up is unfused while recording)."""
    model = _model("qwen2")
    plain, _ = _rollout(model, None, seed=5)
    recorded, recording = _rollout(model, ReplayTape(), seed=5)
    assert recording is not None
    assert torch.equal(plain.completion_ids, recorded.completion_ids)
    torch.testing.assert_close(plain.sampling_logprobs, recorded.sampling_logprobs, rtol=0, atol=1e-6)


def test_a_micro_batch_that_is_not_the_recorded_rollout_runs_the_normal_forward():
    model = _model("qwen2")
    rollouts, recording = _rollout(model, ReplayTape())
    batch = _batch(rollouts)
    batch.input_ids[3, batch.prompt_width] = (batch.input_ids[3, batch.prompt_width] + 1) % 60 + 2
    want, _ = _forward_and_grads(model, batch, [slice(0, 12)])
    got, _ = _forward_and_grads(model, batch, [slice(0, 12)], recording)
    assert (recording.replayed, recording.missed) == (0, 1)
    assert torch.equal(got, want)  # the normal forward, not the recording


def test_the_tape_gives_a_recording_only_for_one_armed_generate_call_within_budget():
    model = _model("llama")
    engine = NativeEngine(model, IdTokenizer())
    engine.tape = tape = ReplayTape()
    sampling = SamplingParams(max_new_tokens=4)
    engine.generate(PROMPTS, 2, sampling)
    assert tape.take() is None  # not armed: evaluation's generate calls record nothing
    tape.arm()
    engine.generate(PROMPTS, 2, sampling)
    engine.generate(PROMPTS, 2, sampling)
    assert tape.take() is None  # two calls in one step (chunked rollouts, DAPO rounds)
    tape.arm()
    engine.generate(PROMPTS, 2, sampling, chunk_prompts=2)
    assert tape.take() is None
    tape.arm()
    engine.generate(PROMPTS, 2, sampling)
    recording = tape.take()
    assert recording is not None and tape.take() is None  # taken once
    need = recording_bytes(model.config, 3 * 5, 3 * 2 * 4)
    assert sum(b.numel() * 4 for layer in recording.buffers for b in layer.values()) == need
    engine.tape = small = ReplayTape(budget_bytes=need - 1)
    small.arm()
    engine.generate(PROMPTS, 2, sampling)
    assert small.take() is None  # over the memory budget: the update recomputes
    engine.tape = capped = ReplayTape(cap_bytes=need - 1)  # a quarter of MemAvailable would hold it
    capped.arm()
    engine.generate(PROMPTS, 2, sampling)
    assert capped.take() is None


def test_the_recording_gets_the_activation_budget_512_mib_on_a_cpu():
    model = _model("llama")
    learner, source = _learner(model), _source(model)
    assert learner.attach_replay(source) and learner.replay_tape.cap_bytes == 512 << 20
    learner, source = _learner(model, activation_memory_gb=0.25), _source(model)
    assert learner.attach_replay(source) and learner.replay_tape.cap_bytes == 256 << 20
    # what that means at real sizes: Qwen2.5-0.5B's shapes, benchmarks/real_size.py's step (4 prompts of
    # ~60 tokens, 4 × 64 new tokens each) records ~1.5 GB, over it; the eos-off matrix cell 0.48 GiB
    qwen = SimpleNamespace(
        hidden_size=896, num_attention_heads=14, num_key_value_heads=2, head_dim=64,
        intermediate_size=4864, num_hidden_layers=24,
    )  # fmt: skip
    assert recording_bytes(qwen, 4 * 60, 16 * 64) > 512 << 20


def _learner(model, **overrides):
    cfg = GRPOConfig(batch_size=3, num_generations=2, max_new_tokens=4, **overrides).validate()
    return Learner(model, None, cfg, 10)


def _source(model, **kw):
    return SimpleNamespace(
        engine=NativeEngine(model, IdTokenizer()), multi_turn=False, chunk_prompts=None, **kw
    )


def test_replay_is_on_by_default_where_its_conditions_hold_and_off_when_false():
    model = _model("llama")
    for asked in (None, True):  # null (auto, the default) and true
        learner, source = _learner(model, replay_rollout_forward=asked), _source(model)
        assert learner.attach_replay(source)
        assert source.engine.tape is learner.replay_tape is not None
    assert GRPOConfig().replay_rollout_forward is None
    learner, source = _learner(model, replay_rollout_forward=False), _source(model)
    assert not learner.attach_replay(source) and source.engine.tape is None


def test_auto_replay_stays_off_off_a_cpu(monkeypatch):
    model = _model("llama")
    learner, source = _learner(model), _source(model)
    meta = torch.nn.Parameter(torch.empty(1, device="meta"))
    monkeypatch.setattr(model, "parameters", lambda *a, **k: iter([meta]))
    assert not learner.attach_replay(source) and learner.replay_tape is None


@pytest.mark.parametrize(
    ("overrides", "source_kw", "reason"),
    [
        ({"num_iterations": 2}, {}, "num_iterations is 2"),
        ({"dtype": "bfloat16"}, {}, "float32"),
        ({"entropy_coef": 0.01}, {}, "entropy_coef"),
        ({"gradient_checkpointing": True}, {}, "gradient_checkpointing"),
        ({"dynamic_sampling": True}, {}, "dynamic_sampling"),
        ({}, {"multi_turn": True}, "multi-turn"),
        ({}, {"chunk_prompts": 1}, "batch_size"),
        ({}, {"engine": SimpleNamespace(model=None)}, "native engine"),
    ],
    ids=lambda x: str(x)[:30],
)
def test_replay_is_off_where_a_condition_fails_and_true_says_which(overrides, source_kw, reason):
    model = _model("llama")
    learner = _learner(model, **overrides)
    source = _source(model)
    source.__dict__.update(source_kw)
    assert reason in learner.replay_refusal(source)
    assert not learner.attach_replay(source) and learner.replay_tape is None
    learner = _learner(model, replay_rollout_forward=True, **overrides)
    with pytest.raises(ConfigError, match=f"replay_rollout_forward=true, but .*{reason}"):
        learner.attach_replay(source)


def test_lora_turns_replay_off_and_compiled_decode_does_not():
    from tests.unit.test_native import lora_model

    model = lora_model("qwen2", ["q_proj"])
    assert "LoRA" in _learner(model).replay_refusal(_source(model))
    plain = _model("llama")
    source = _source(plain)
    source.engine.compiled = True  # the compiled full-batch step returns its products for the recording
    assert _learner(plain).replay_refusal(source) is None


def test_recording_on_onednn_decode_layers_replays_as_exactly(monkeypatch):
    """Wide models (and AVX-512 hosts) decode on oneDNN with SiLU and the product fused into the GEMMs;
    recording unfuses them, and the replayed update still matches the recomputed one."""
    from grpo.model import linear

    if not linear.ONEDNN_AVAILABLE:
        pytest.skip("no oneDNN in this PyTorch build")
    monkeypatch.setattr(linear, "decode_onednn", lambda width, rows=None: True)
    model = _model("qwen2")
    plain, _ = _rollout(model, None, seed=4)
    rollouts, recording = _rollout(model, ReplayTape(), seed=4)
    assert torch.equal(plain.completion_ids, rollouts.completion_ids)
    batch = _batch(rollouts)
    want, want_grads = _forward_and_grads(model, batch, [slice(0, 12)])
    got, got_grads = _forward_and_grads(model, batch, [slice(0, 12)], recording)
    assert recording.replayed == 1
    torch.testing.assert_close(got, want, rtol=0, atol=5e-6)
    for name, g in want_grads.items():
        assert (got_grads[name] - g).norm() <= 1e-5 * g.norm() + 1e-9, name


def test_the_tape_reuses_the_storage_and_a_rollout_writes_a_prefix_of_it():
    """The next rollout writes into the same pages (no page faults), and however ragged, a rollout writes
    one contiguous prefix as long as the tokens it decoded: what stays resident is the longest's."""
    model = _model("llama")
    engine = NativeEngine(model, IdTokenizer())
    engine.tape = tape = ReplayTape()
    sampling = SamplingParams(max_new_tokens=12, temperature=1.0)

    def record(eos: torch.Tensor):
        engine.eos_ids = eos
        tape.arm()
        torch.manual_seed(0)
        out = engine.generate(PROMPTS, 4, sampling)
        return out, tape.take()

    _, first = record(torch.tensor([-1]))  # no eos: every row runs to the limit
    out, second = record(torch.tensor([7, 9, 11, 13]))  # ragged
    assert second.buffers[0]["qkv"].data_ptr() == first.buffers[0]["qkv"].data_ptr()
    lengths = out.completion_mask.sum(1)
    assert lengths.min() < lengths.max()
    written = second.slot_of[second.slot_of >= 0]
    assert written.numel() >= int((lengths - 1).sum())  # every input token (and rows not yet dropped)
    assert torch.equal(written.sort().values, torch.arange(second.base, second.base + written.numel()))


def test_a_wider_prompt_next_step_reuses_the_recording_s_storage():
    # Fresh pages cost the rollout ~×1.2 of its CPU time (eos-off, 1 thread); a step's prompts set the
    # recording's size, so the storage is allocated with headroom and the next steps' fit in it.
    model = _model("llama")
    engine, tape = NativeEngine(model, IdTokenizer()), ReplayTape()
    engine.tape = tape
    sampling = SamplingParams(max_new_tokens=4, temperature=1.0)
    storages = []
    for prompts in (PROMPTS, [[3, 4, 5, 6, 7, 8, 9], [8, 9], [10, 11, 12]]):
        tape.arm()
        engine.generate(prompts, 2, sampling)
        storages.append(tape.take().storage)
    assert all(
        storages[1][i][k] is storages[0][i][k] for i in range(len(storages[0])) for k in storages[0][i]
    )


def test_gathers_reuse_one_buffer_per_layer_and_kind():
    # a fresh [tokens, width] tensor per micro-batch and layer cost the eos-off update 0.52 s of page faults
    # and copies against 0.19 s into reused buffers (1 thread)
    model = _model("llama")
    _, recording = _rollout(model, ReplayTape())
    first = recording.gather(0, torch.arange(6))
    values = {k: v.clone() for k, v in first.items()}
    again = recording.gather(0, torch.arange(4) + 2)
    for k, v in again.items():
        assert v.data_ptr() == first[k].data_ptr()
        assert torch.equal(v, values[k][2:6])
        assert torch.equal(v, recording.buffers[0][k][2:6])


def test_the_full_batch_step_records_what_the_update_replays(monkeypatch):
    """The hybrid decode's full-batch step (run uncompiled here: its logic, not inductor's) returns each
    layer's products and the engine copies them into the recording; after rows finish, the eager step
    records the compacted batch. The replayed update then gives the recomputed forward's log-probs and
    gradients, and the recording is slot for slot the eager engine's."""
    from grpo.rollout import native

    model = _model("qwen2")
    full = []

    def counting(dec, tokens, *args):
        full.append(tokens.shape[0])
        return native._full_batch_step(dec, tokens, *args)

    def rollout(compiled: bool):
        engine = NativeEngine(model, IdTokenizer(), compile_decode=compiled)
        if compiled:
            engine._full_step = counting
        engine.tape = ReplayTape()
        engine.tape.arm()
        torch.manual_seed(0)
        rollouts = engine.generate(PROMPTS, 4, SamplingParams(max_new_tokens=12, temperature=1.0))
        return rollouts, engine.tape.take()

    eager, eager_rec = rollout(False)
    rollouts, recording = rollout(True)
    lengths = rollouts.completion_mask.sum(1)
    assert full and set(full) == {12} and lengths.min() < len(full) + 1 < lengths.max()  # then compacted
    assert torch.equal(rollouts.completion_ids, eager.completion_ids)
    assert torch.equal(recording.slot_of, eager_rec.slot_of) and torch.equal(recording.ids, eager_rec.ids)
    written = recording.cursor
    for got, want in zip(recording.buffers, eager_rec.buffers, strict=True):
        for kind in want:
            torch.testing.assert_close(got[kind][:written], want[kind][:written], rtol=0, atol=1e-5)

    batch = _batch(rollouts)
    slices = [slice(0, 5), slice(5, 12)]
    want, want_grads = _forward_and_grads(model, batch, slices)
    got, got_grads = _forward_and_grads(model, batch, slices, recording)
    assert (recording.replayed, recording.missed) == (2, 0)
    mask = batch.completion_mask
    torch.testing.assert_close(got * mask, want * mask, rtol=0, atol=5e-6)
    for name, g in want_grads.items():
        assert (got_grads[name] - g).norm() <= 1e-5 * g.norm() + 1e-9, name
