"""Multi-turn KV reuse on the native engine (model/turn_kv.py): a later turn prefills only its new ids, and
samples what a full prefill of the whole conversation samples (ids exactly, log-probs to float rounding)."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import grpo.rollout.multi_turn as multi_turn
from grpo.agents.calculator import calculator
from grpo.model.loading import resolve_path
from grpo.model.turn_kv import TurnCache, common_prefix, takes_kv
from grpo.records import PromptBatch, SamplingParams
from grpo.rollout.native import NativeEngine
from tests.conftest import IdTokenizer
from tests.unit.test_episodes import runner


class CheckAgain:
    """The step form: every answer gets a follow-up question, so every episode runs several turns."""

    def reset(self, row):
        self.turns = 0
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, messages):
        self.turns += 1
        return [{"role": "user", "content": "Are you sure? Check it again."}], 0.0, self.turns >= 3


@pytest.fixture(scope="module")
def tools_lm():
    path = resolve_path("tiny-tools-lm")
    return AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


def _episodes(tools_lm, reuse: bool, form: str, greedy: bool, monkeypatch, held: list):
    model, tok = tools_lm

    class Recording(TurnCache):
        def bind(self, keys):
            keys = list(keys)
            held.append((set(self.rows), set(keys)))
            return super().bind(keys)

    monkeypatch.setattr(multi_turn, "TurnCache", Recording)
    questions = ["What is 123*45?", "What is 17*23+5?", "Add 3 and 4."]
    batch = PromptBatch(prompts=questions, prompt_token_ids=[[] for _ in questions], columns={},
                        indices=list(range(len(questions))))  # fmt: skip
    if form == "tools":  # the tiny_tools demo: the base model calls the calculator on part of them
        run = runner(tok, tools=[calculator], max_turns=4, max_tokens=400, turn_tokens=48)
    else:  # the step form: several turns for every episode
        run = runner(tok, environment=CheckAgain, max_turns=4, max_tokens=400, turn_tokens=48)
    run.reuse_kv = reuse
    torch.manual_seed(3)
    _, out = run.run(NativeEngine(model, tok), batch, 4, SamplingParams(max_new_tokens=48, greedy=greedy))
    return out, run.kv_tokens


@pytest.mark.parametrize("form,greedy", [("environment", True), ("environment", False), ("tools", False)])
def test_a_multi_turn_run_samples_the_same_with_and_without_kv_reuse(tools_lm, form, greedy, monkeypatch):
    held = []
    with_kv, (reused, prefilled) = _episodes(tools_lm, True, form, greedy, monkeypatch, held)
    without, (none_reused, _) = _episodes(tools_lm, False, form, greedy, monkeypatch, [])
    assert reused > 0 and none_reused == 0
    if form == "environment":
        assert min(e.turns for e in with_kv.episodes) >= 2 and reused > prefilled
    assert torch.equal(with_kv.completion_ids, without.completion_ids)
    assert torch.equal(with_kv.loss_mask, without.loss_mask)
    # Float rounding, not bitwise: a sampled token's K/V come from the decode step's kernels (seen: 1.3e-5
    # on a log-prob of −9.3, most under 1e-6).
    assert torch.allclose(with_kv.sampling_logprobs, without.sampling_logprobs, atol=1e-5, rtol=1e-5)
    # Each turn's call holds K/V only for the episodes it continues: an ended episode's are freed.
    assert all(rows <= keys for rows, keys in held[1:]) and len(held) >= 2


def _fresh_kv(engine, ids):
    cache, _ = engine.decoder.prefill([ids], 0)
    return torch.stack([torch.stack([k[0] for k in cache.keys]), torch.stack([v[0] for v in cache.values])])


def test_a_row_keeps_the_kv_a_full_prefill_gives_and_reuses_only_the_ids_it_shares(tiny_model):
    engine = NativeEngine(tiny_model, IdTokenizer())
    torch.manual_seed(0)
    rows = [[5, 6, 7, 8], [9, 3], *([[4, 4, 4]] * 14)]  # 16 rows: eos (id 1) ends some early, compacting
    cache = TurnCache()
    sampling = SamplingParams(max_new_tokens=12)
    first = engine.continue_rows(rows, sampling, kv=cache.bind(range(len(rows))))
    assert not bool(first.truncated.all())  # some rows ended early (and left the decode batch)
    for r, ids in enumerate(rows):
        held = cache.rows[r]
        n = int(first.completion_mask[r].sum())
        assert held.ids == ids + first.completion_ids[r, : n - 1].tolist()
        assert torch.allclose(held.kv, _fresh_kv(engine, held.ids), atol=1e-5)
    # Row 0 continues what it holds; row 1 was rewritten after its prompt (a fork); row 2 is new.
    nxt = [[*cache.rows[0].ids, 11, 12], [9, 30, 31], [7, 7]]
    before, held = cache.reused_tokens, len(cache.rows[0].ids)
    torch.manual_seed(1)
    reused = engine.continue_rows(nxt, sampling, kv=cache.bind([0, 1, "new"]))
    assert cache.reused_tokens - before == held + 1  # all of row 0's, row 1's first id, nothing of row 2
    assert set(cache.rows) == set(range(16)) | {"new"}  # each row of the call replaced its entry
    torch.manual_seed(1)
    fresh = engine.continue_rows(nxt, sampling)
    assert torch.equal(reused.completion_ids, fresh.completion_ids)
    assert torch.allclose(reused.sampling_logprobs, fresh.sampling_logprobs, atol=1e-5, rtol=0)


def test_the_cache_frees_what_it_is_not_told_to_keep_and_compares_ids_not_lengths():
    cache = TurnCache()
    cache.rows = {k: None for k in "abc"}
    cache.retain(["b"])
    assert list(cache.rows) == ["b"]
    assert common_prefix([1, 2, 3, 4], [1, 2, 9, 4, 5], 4) == 2
    assert common_prefix([1, 2, 3], [1, 2, 3, 4], 3) == 3
    assert common_prefix([1, 2, 3], [1, 2, 3], 2) == 2  # the last id runs again: its logits start the turn


def test_only_an_engine_whose_calls_take_kv_is_given_a_cache(tiny_model):
    from grpo.rollout.transformers import TransformersEngine

    assert takes_kv(NativeEngine(tiny_model, IdTokenizer()))
    assert not takes_kv(TransformersEngine(tiny_model, IdTokenizer()))


def test_the_gateways_batcher_keeps_each_sessions_kv_between_its_calls(tiny_model):
    from grpo.gateway.batching import Batcher, Job

    engine = NativeEngine(tiny_model, IdTokenizer())
    greedy = SamplingParams(max_new_tokens=6, greedy=True)
    batcher = Batcher(engine, greedy, lambda: (2, 0), window_s=0.01)

    def call(rows):  # one batch: both sessions' requests
        jobs = [batcher.submit(Job(list(ids), 6, key=key)) for key, ids in zip("ab", rows, strict=True)]
        return [job.events.get(timeout=120)[1] for job in jobs]

    try:
        prompts = [[5, 6, 7], [9, 3]]
        first = call(prompts)
        rows = [p + s + [11, 12] for p, s in zip(prompts, first, strict=True)]  # a tool message's ids
        second = call(rows)
        # Each session's held ids: its prompt and all but the last sampled token (no step fed it).
        assert batcher.kv.reused_tokens == sum(len(r) - 3 for r in rows)
        fresh = engine.continue_rows(rows, greedy)
        for r, ids in enumerate(second):
            assert ids == fresh.completion_ids[r, : len(ids)].tolist()
        batcher.use(engine, greedy)  # the next step: the old weights' K/V are dropped
        assert len(batcher.kv) == 0
    finally:
        batcher.close()


def _gateway_turns(tools_lm, monkeypatch, reuse: bool):
    import openai

    import grpo.gateway.batching as batching
    from grpo.agents import HermesParser
    from grpo.gateway.server import GatewayServer
    from grpo.gateway.service import Gateway, Limits
    from grpo.gateway.sessions import Session

    model, tok = tools_lm
    if not reuse:
        monkeypatch.setattr(batching, "takes_kv", lambda engine: False)
    greedy = SamplingParams(max_new_tokens=48, greedy=True)
    gateway = Gateway(tok, HermesParser(), Limits(400, 48, 400), NativeEngine(model, tok), greedy)
    server = GatewayServer(gateway)
    try:
        session = gateway.sessions.add(Session(0, 0, {}))
        client = openai.OpenAI(base_url=server.base_url, api_key=session.key, max_retries=0)
        messages, replies = [{"role": "user", "content": "What is 17*23+5?"}], []
        for _ in range(3):  # the agent asks again after every answer: each call continues the session's row
            message = (
                client.chat.completions.create(model="m", messages=messages, max_tokens=48).choices[0].message
            )
            replies.append(message.content)
            messages += [message, {"role": "user", "content": "Are you sure? Check it again."}]
        return replies, gateway.batcher.kv.reused_tokens if reuse else 0
    finally:
        server.close()
        gateway.batcher.close()


def test_a_gateway_session_on_the_native_engine_reuses_its_kv_and_answers_the_same(tools_lm, monkeypatch):
    with_kv, reused = _gateway_turns(tools_lm, monkeypatch, True)
    without, _ = _gateway_turns(tools_lm, monkeypatch, False)
    assert with_kv == without and reused > 0
