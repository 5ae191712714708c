"""Hybrid decode: the compiled full-batch step while every row is in the batch, the eager compacting step
after; and the default that compiles only once eager full-batch steps have paid for it."""

import pytest
import torch

from grpo.records import SamplingParams
from grpo.rollout import native
from grpo.rollout.native import NativeEngine


def _counting(calls: list, fn):
    def wrapped(*args, **kwargs):
        calls.append(args[1].shape[0])  # rows in the batch
        return fn(*args, **kwargs)

    return wrapped


def test_full_batch_step_serves_until_rows_finish_then_the_eager_step(tiny_model, id_tokenizer, monkeypatch):
    """The full-batch step (run uncompiled here: its logic, not inductor's) serves every step until 1/8 of
    the rows have finished; then the rows are compacted and the eager step decodes the rest. Tokens match
    the eager engine's for the same seed, log-probs to float rounding (the full-batch step attends over
    the whole cache, masked)."""
    prompts, params = [[2, 9, 4, 5], [2, 3], [7, 8, 9]], SamplingParams(max_new_tokens=20, temperature=1.0)
    full, eager_rows = [], []
    hybrid = NativeEngine(tiny_model, id_tokenizer, compile_decode=True)
    hybrid._full_step = _counting(full, native._full_batch_step)
    real = hybrid.decoder.decode_step

    def decode_step(tokens, *args, **kwargs):
        if len(args) == 6:  # the eager step (the full-batch step passes its cache position and mask too)
            eager_rows.append(tokens.shape[0])
        return real(tokens, *args, **kwargs)

    monkeypatch.setattr(hybrid.decoder, "decode_step", decode_step)
    with torch.no_grad():
        torch.manual_seed(3)
        got = hybrid.generate(prompts, 4, params)
        torch.manual_seed(3)
        want = NativeEngine(tiny_model, id_tokenizer).generate(prompts, 4, params)
    lengths = want.completion_mask.sum(1)
    assert lengths.min() < 20 and lengths.max() == 20  # some rows ended early, some ran to the limit
    assert full and set(full) == {12}  # the full batch only
    assert eager_rows and max(eager_rows) < 12  # the eager step on the compacted batch, not before
    assert len(full) + len(eager_rows) == 19  # one decode a step after the first (the shared prefill's)
    assert torch.equal(got.completion_ids, want.completion_ids)
    torch.testing.assert_close(got.sampling_logprobs, want.sampling_logprobs, rtol=0, atol=1e-5)
    assert torch.equal(got.truncated, want.truncated)


def test_rows_that_all_run_to_the_limit_stay_on_the_full_batch_step(tiny_model, id_tokenizer):
    tiny_model.generation_config.eos_token_id = None
    engine = NativeEngine(tiny_model, id_tokenizer, compile_decode=True)
    engine.eos_ids = torch.tensor([-1])
    full = []
    engine._full_step = _counting(full, native._full_batch_step)
    with torch.no_grad():
        out = engine.generate([[3, 4, 5], [6, 7]], 3, SamplingParams(max_new_tokens=10))
    assert out.completion_mask.sum() == 6 * 10 and len(full) == 9


def test_by_default_decode_compiles_once_eager_full_batch_steps_have_paid(
    tiny_model, id_tokenizer, monkeypatch
):
    """compile_decode=None: eager until the full-batch steps' seconds × the share compiling saves reach the
    compile's estimated cost (ski rental); steps after rows were dropped count nothing."""
    compiled = []
    monkeypatch.setenv("GRPO_CPU_KERNELS", "0")  # the rule for a CPU without grpo's decode ops
    monkeypatch.setattr(native, "cpp_compiler", lambda: "g++")
    monkeypatch.setattr(native.torch, "compile", lambda fn, **kw: compiled.append(fn) or fn)
    tiny_model.generation_config.eos_token_id = None
    engine = NativeEngine(tiny_model, id_tokenizer, compile_decode=None)
    engine.eos_ids = torch.tensor([-1])
    assert engine.auto and not engine.compiled and not compiled
    params = SamplingParams(max_new_tokens=6)
    with torch.no_grad():
        engine.generate([[3, 4, 5]], 2, params)
        paid = engine._rent_s
        assert paid > 0 and not engine.compiled  # 5 full-batch steps' rent, far below a compile
        layers = len(engine.decoder.layers)  # the next call's rent passes the cost:
        # just above what is paid: a second call's rent (however much faster than the first, whose steps
        # warmed up) passes it, so the test does not hang on the machine's speed between two calls
        monkeypatch.setattr(native, "_COMPILE_S_PER_LAYER", 1.01 * paid / layers)
        engine.generate([[3, 4, 5]], 2, params)
    assert engine.compiled and not engine.auto and compiled == [native._full_batch_step]
    full = []
    engine._full_step = _counting(full, native._full_batch_step)
    with torch.no_grad():
        engine.generate([[3, 4, 5]], 2, params)
    assert len(full) == 5


@pytest.mark.parametrize("setting", [False, True])
def test_decode_compilation_set_either_way_is_not_automatic(tiny_model, id_tokenizer, setting):
    engine = NativeEngine(tiny_model, id_tokenizer, compile_decode=setting)
    assert not engine.auto and engine.compiled is setting


def test_no_automatic_decode_compilation_without_a_compiler(tiny_model, id_tokenizer, monkeypatch):
    monkeypatch.setattr(native, "cpp_compiler", lambda: None)
    assert not NativeEngine(tiny_model, id_tokenizer, compile_decode=None).auto


def test_no_automatic_decode_compilation_where_grpos_cpu_ops_run_the_eager_step(
    tiny_model, id_tokenizer, monkeypatch
):
    """With grpo's CPU decode ops the eager step is faster than the compiled static one, so auto stays
    eager; asked for explicitly, the compiled step still runs."""
    monkeypatch.setattr(native, "cpp_compiler", lambda: "g++")
    monkeypatch.setattr(native.kernels, "cpu_ops", lambda: object())
    assert not NativeEngine(tiny_model, id_tokenizer, compile_decode=None).auto
    assert NativeEngine(tiny_model, id_tokenizer, compile_decode=True).compiled


def test_the_rent_counts_full_batch_steps_only(tiny_model, id_tokenizer, monkeypatch):
    """Rows that end early leave the full batch within a few steps: those runs pay little rent."""
    monkeypatch.setenv("GRPO_CPU_KERNELS", "0")
    monkeypatch.setattr(native, "cpp_compiler", lambda: "g++")
    engine = NativeEngine(tiny_model, id_tokenizer, compile_decode=None)
    eager_steps = []
    monkeypatch.setattr(native.time, "perf_counter", lambda: eager_steps.append(1) or float(len(eager_steps)))
    tiny_model.generation_config.eos_token_id = None
    engine.eos_ids = torch.tensor([-1])
    with torch.no_grad():
        engine.generate([[3, 4, 5]], 8, SamplingParams(max_new_tokens=4))
    # 3 decode steps, each timed by two clock reads one apart: 3 × 1 s × the share compiling saves
    assert engine._rent_s == pytest.approx(3 * native._COMPILE_SAVES)
    engine._rent_s = 0.0
    engine.eos_ids = torch.tensor(list(range(60)))  # almost every token ends a row
    with torch.no_grad():
        engine.generate([[3, 4, 5]], 8, SamplingParams(max_new_tokens=4))
    assert engine._rent_s < 3 * native._COMPILE_SAVES


def test_a_recorded_rollout_pays_rent_and_once_compiled_records_through_the_full_batch_step(
    tiny_model, id_tokenizer, monkeypatch
):
    """Replay's recording (train.replay_rollout_forward, on by default on a CPU) used to keep a run eager:
    the compiled step recorded nothing, so recorded steps paid no rent. Now they pay, and once compiled
    the full-batch step serves the recorded rollout and its products reach the recording."""
    from grpo.model.replay import ReplayTape

    monkeypatch.setenv("GRPO_CPU_KERNELS", "0")
    monkeypatch.setattr(native, "cpp_compiler", lambda: "g++")
    monkeypatch.setattr(native.torch, "compile", lambda fn, **kw: fn)
    tiny_model.generation_config.eos_token_id = None
    engine = NativeEngine(tiny_model, id_tokenizer, compile_decode=None)
    engine.eos_ids = torch.tensor([-1])
    engine.tape = ReplayTape()
    params = SamplingParams(max_new_tokens=6)
    with torch.no_grad():
        engine.tape.arm()
        engine.generate([[3, 4, 5]], 2, params)
        assert engine.tape.take() is not None and engine._rent_s > 0
        monkeypatch.setattr(native, "_COMPILE_S_PER_LAYER", 0.0)  # the next call's rent pays for it
        engine.tape.arm()
        engine.generate([[3, 4, 5]], 2, params)
        engine.tape.take()
        assert engine.compiled
        full = []
        engine._full_step = _counting(full, native._full_batch_step)
        engine.tape.arm()
        out = engine.generate([[3, 4, 5]], 2, params)
        recording = engine.tape.take()
    assert len(full) == 5 and recording is not None
    # the five decoded inputs are the first five sampled tokens (the sixth is sampled, never decoded)
    assert torch.equal(recording.ids[recording.slot_of[0, :5]], out.completion_ids[0, :5])


def test_explicit_decode_compile_without_a_compiler_is_a_config_error(monkeypatch):
    import shutil

    from grpo.config import ConfigError, GRPOConfig

    assert GRPOConfig().generation.compile_decode is None  # the default decides at run time
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(shutil, "which", lambda name: None)
    cfg = GRPOConfig(batch_size=2, num_generations=4)
    cfg.update({"generation.compile_decode": True, "model.device": "cpu"})
    with pytest.raises(ConfigError, match="compile_decode=true needs a C\\+\\+ compiler"):
        cfg.validate()


@pytest.mark.slow  # compiles the full-batch graph (~1 min on a 2-core CPU)
@pytest.mark.parametrize("top_k,top_p,record", [(0, 1.0, False), (5, 0.9, True)])
def test_the_compiled_graph_samples_what_the_eager_step_samples(
    tiny_model, id_tokenizer, top_k, top_p, record
):
    """The sampler runs inside the compiled graph on aten's RNG (fallback_random): for one seed it draws the
    eager engine's tokens and leaves the generator where the eager engine leaves it (a seeded run, and its
    resume, sample the same whichever step serves them). With replay's recording on (the second case: the
    graph that returns each layer's products), the recording is the eager step's to float rounding."""
    from grpo.model.replay import ReplayTape

    tiny_model.generation_config.eos_token_id = None  # every row runs to the limit: the graph serves all
    params = SamplingParams(max_new_tokens=8, temperature=0.9, top_k=top_k, top_p=top_p)
    runs = []
    for compiled in (False, True):
        engine = NativeEngine(tiny_model, id_tokenizer, compile_decode=compiled)
        engine.eos_ids = torch.tensor([-1])
        if record:
            engine.tape = ReplayTape()
            engine.tape.arm()
        torch.manual_seed(5)
        with torch.no_grad():
            out = engine.generate([[2, 9, 4], [2, 3]], 3, params)
        runs.append((out, torch.rand(4), engine.tape and engine.tape.take()))
    (eager, after_eager, eager_rec), (compiled, after_compiled, rec) = runs
    assert torch.equal(compiled.completion_ids, eager.completion_ids)
    torch.testing.assert_close(compiled.sampling_logprobs, eager.sampling_logprobs, rtol=0, atol=1e-5)
    assert torch.equal(after_compiled, after_eager)
    if record:
        assert rec is not None and torch.equal(rec.ids, eager_rec.ids) and rec.cursor == eager_rec.cursor
        for got, want in zip(rec.buffers, eager_rec.buffers, strict=True):
            for kind, buffer in want.items():
                written = slice(0, rec.cursor)
                torch.testing.assert_close(got[kind][written], buffer[written], rtol=0, atol=1e-5)
