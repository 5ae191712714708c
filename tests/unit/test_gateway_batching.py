"""The batcher's rule for the calls of a next turn (gateway/batching.py): replies that call a tool go out
first, final replies wait for the next batch to start (never past `window_s`, nor when no call is coming),
and a session whose last reply was final is not waited for once the run's agents are seen to end after one.
Also: a group's identical first requests render once (service._Renderer)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from grpo.agents import ChatRenderer, HermesParser
from grpo.gateway.batching import Batcher, Job
from grpo.gateway.service import Gateway, Limits
from grpo.gateway.sessions import Row, Session, SessionTable
from grpo.records import Rollouts, SamplingParams
from tests import gateway_agents as agents
from tests.chat_templates import family_tokenizer

SAMPLING = SamplingParams(max_new_tokens=4)
CALL, ANSWER = 7, 9  # the fake policy's turns: a tool call, a final answer


class Fake:
    """Answers each row with one token: CALL where the row's last id is odd, ANSWER where it is even."""

    def __init__(self):
        self.calls: list[int] = []

    def continue_rows(self, rows, sampling):
        del sampling
        self.calls.append(len(rows))
        ids = torch.tensor([[CALL if r[-1] % 2 else ANSWER] for r in rows])
        ones = torch.ones(len(rows), 1)
        done = torch.zeros(len(rows), dtype=torch.bool)
        return Rollouts(group_ids=torch.arange(len(rows)), completion_ids=ids, completion_mask=ones,
                        sampling_logprobs=-ones, truncated=done)  # fmt: skip

    def generate(self, prompts, n, sampling):
        return self.continue_rows([p for p in prompts for _ in range(n)], sampling)


def final(ids: list[int]) -> bool:
    return ids[0] == ANSWER


class Live:
    """The live callback: `n` sessions, none fresh; `set` changes it and wakes the batcher."""

    def __init__(self, n: int):
        self.n, self.batcher = n, None

    def __call__(self):
        return self.n, 0

    def set(self, n: int):
        self.n = n
        self.batcher.wake()


def batcher(live: Live, window_s: float) -> tuple[Batcher, Fake]:
    engine = Fake()
    b = Batcher(engine, SAMPLING, live, window_s=window_s, max_wait_s=30.0)
    live.batcher = b
    return b, engine


def arrival(job: Job, timeout: float = 10.0) -> tuple[str, float]:
    event = job.events.get(timeout=timeout)
    return event[0], time.monotonic()


def test_a_final_reply_waits_for_the_next_batch_while_a_tool_call_goes_out_at_once():
    live = Live(2)
    b, engine = batcher(live, window_s=5.0)
    try:
        answer = b.submit(Job([2], 4, final=final))  # even: the policy answers
        call = b.submit(Job([1], 4, final=final))  # odd: the policy calls a tool
        assert arrival(call)[0] == "done"
        time.sleep(0.2)
        assert answer.events.empty()  # held: the tool call's next request comes first
        started = time.monotonic()
        again = b.submit(Job([1, 2], 4, final=final))  # the tool result is in: the next turn's call
        kind, at = arrival(answer)
        assert kind == "done" and at - started < 2.0  # out as the next batch starts, not after the 5 s window
        assert arrival(again)[0] == "done"
    finally:
        b.close()
    assert engine.calls == [2, 1]  # the next turn did not wait for the answered session


def test_held_replies_go_out_when_no_call_is_expected_or_after_the_window():
    live = Live(2)
    b, _ = batcher(live, window_s=5.0)
    try:
        answer = b.submit(Job([2], 4, final=final))
        call = b.submit(Job([1], 4, final=final))
        arrival(call)
        started = time.monotonic()
        live.set(1)  # the tool-calling episode ended instead of calling: nothing to wait for
        kind, at = arrival(answer)
        assert kind == "done" and at - started < 2.0
    finally:
        b.close()
    live = Live(2)
    b, _ = batcher(live, window_s=0.3)
    try:
        answer = b.submit(Job([2], 4, final=final))
        call = b.submit(Job([1], 4, final=final))
        arrival(call)
        started = time.monotonic()
        kind, at = arrival(answer)  # the tool-calling agent is slow: the answer does not wait past window_s
        assert kind == "done" and 0.1 < at - started < 3.0
    finally:
        b.close()


def test_when_every_reply_is_final_none_is_held_and_jobs_without_the_predicate_never_are():
    live = Live(2)
    b, _ = batcher(live, window_s=5.0)
    try:
        jobs = [b.submit(Job([2], 4, final=final)), b.submit(Job([4], 4, final=final))]
        assert [arrival(j, timeout=2.0)[0] for j in jobs] == ["done", "done"]
        jobs = [b.submit(Job([2], 4)), b.submit(Job([1], 4))]  # e.g. streamed requests: no predicate
        assert [arrival(j, timeout=2.0)[0] for j in jobs] == ["done", "done"]
    finally:
        b.close()


def test_closing_sends_the_held_replies():
    live = Live(2)
    b, _ = batcher(live, window_s=30.0)
    answer = b.submit(Job([2], 4, final=final))
    arrival(b.submit(Job([1], 4, final=final)))
    b.close()
    assert answer.events.get(timeout=1)[0] == "done"


def ended_session(k: int, answered: bool, recalls: int = 0) -> Session:
    s = Session(k, 0, {}, calls=1, answered=answered, recalls=recalls)
    s.end("answer")
    return s


def test_answered_sessions_are_not_waited_for_once_agents_are_seen_to_end_after_an_answer():
    table = SessionTable()
    now = [table.add(Session(k, 0, {}, calls=1)) for k in range(3)]
    now[0].answered = True
    assert table.expected() == (3, 0)  # no evidence yet: every live session is waited for
    before = [table.add(ended_session(10 + k, answered=True)) for k in range(8)]
    table.remove(before)
    assert table.settling() and table.expected() == (2, 0)  # the answered one will end: not waited for
    now[0].rows.append(Row(1, [1], [0.0], [0.0], [], "", 1, busy=True))
    assert table.expected() == (3, 0)  # ... unless it is calling again
    now[0].rows[0].busy = False
    now[1].recalls = 2  # this step's agents call after an answer: wait for every session again
    assert not table.settling() and table.expected() == (3, 0)


def test_agents_that_call_after_an_answer_keep_every_session_waited_for():
    table = SessionTable()
    table.remove([table.add(ended_session(k, answered=True)) for k in range(200)])
    assert table.settling()  # a long run of agents that ended after their answer ...
    table.remove([table.add(ended_session(k, answered=True, recalls=1)) for k in range(16)])
    table.add(Session(0, 0, {}, calls=1, answered=True))
    assert not table.settling() and table.expected() == (1, 0)  # ... then a step whose agents go on


@pytest.fixture(scope="module")
def qwen():
    return family_tokenizer("qwen2.5")


def test_a_groups_identical_first_requests_render_once(qwen, monkeypatch):
    gateway = Gateway(qwen, HermesParser(), Limits(2000, 200, 4096), Fake(), SAMPLING)
    try:
        renders = []
        original = type(qwen).apply_chat_template

        def counted(self, *args, **kwargs):
            renders.append(threading.get_ident())
            return original(self, *args, **kwargs)

        _, renderer = gateway.renderer(agents.TOOLS)
        monkeypatch.setattr(type(qwen), "apply_chat_template", counted)
        first = [{"role": "user", "content": "What is 12 * 34?"}]
        ids = [renderer.prompt_ids([dict(m) for m in first]) for _ in range(8)]
        assert len(renders) == 1 and all(i == ids[0] for i in ids)
        ids[0].append(0)  # a caller's list is its own
        other = [{"role": "user", "content": "What is 12 * 35?"}]
        assert renderer.prompt_ids(other) != renderer.prompt_ids(first) and len(renders) == 2
        monkeypatch.undo()
        assert renderer.prompt_ids(first) == ChatRenderer(qwen, agents.TOOLS).prompt_ids(first)
    finally:
        gateway.batcher.close()


def test_a_reply_that_cannot_be_read_for_calls_is_sent_at_once():
    def broken(ids):
        raise ValueError("undecodable")

    live = Live(2)
    b, _ = batcher(live, window_s=30.0)
    try:
        jobs = [b.submit(Job([2], 4, final=broken)), b.submit(Job([1], 4, final=final))]
        assert [arrival(j, timeout=2.0)[0] for j in jobs] == ["done", "done"]
    finally:
        b.close()


class Slow(Fake):
    def continue_rows(self, rows, sampling):
        time.sleep(0.5)
        return super().continue_rows(rows, sampling)


def test_final_replies_wait_as_long_as_an_engine_call_for_the_next_calls():
    engine = Slow()
    b = Batcher(engine, SAMPLING, lambda: (2, 0), window_s=0.05, max_wait_s=30.0)
    try:
        answer = b.submit(Job([2], 4, final=final))
        _, started = arrival(b.submit(Job([1], 4, final=final)))
        kind, at = arrival(answer)  # the tool-calling agent may take a while: not only window_s
        assert kind == "done" and 0.3 < at - started < 3.0
    finally:
        b.close()


def test_a_batchs_rows_go_to_the_engine_in_episode_order_not_arrival_order():
    # Each row draws its random numbers by its place in the batch: in arrival order, the agents' timing would
    # decide what each episode samples, and the same seed would run different episodes from run to run.
    live = Live(4)
    b, _ = batcher(live, window_s=5.0)
    seen: list[list[int]] = []
    original = b.engine.continue_rows

    def recording(rows, sampling):
        seen.append([r[0] for r in rows])
        return original(rows, sampling)

    b.engine.continue_rows = recording
    try:
        jobs = [b.submit(Job([10 + k], 4, order=k)) for k in (2, 0, 3, 1)]  # they arrive out of order
        for job in jobs:
            assert arrival(job)[0] == "done"
        stray = b.submit(Job([99], 4))  # no episode order (not a session's call): after the others
        late = b.submit(Job([20], 4, order=0))
        live.set(2)
        for job in (stray, late):
            assert arrival(job)[0] == "done"
    finally:
        b.close()
    assert seen == [[10, 11, 12, 13], [20, 99]]


def recording_batcher() -> tuple[Batcher, list[threading.Thread]]:
    """A batcher (2 live sessions) whose engine records the thread of each call, checks it runs under
    no_grad, and fails a batch whose first row starts with 66."""
    b, _ = batcher(Live(2), window_s=5.0)
    threads: list[threading.Thread] = []
    original = b.engine.continue_rows

    def recording(rows, sampling):
        threads.append(threading.current_thread())
        assert not torch.is_grad_enabled()
        if rows[0][0] == 66:
            raise RuntimeError("the engine broke")
        return original(rows, sampling)

    b.engine.continue_rows = recording
    return b, threads


def test_each_engine_call_runs_on_a_thread_that_ends_with_it():
    """The batcher's engine calls run on a thread of their own that has exited once the call returned (a
    thread's OpenMP team lives as long as the thread: gateway/batching.on_a_thread_of_its_own says why), under
    no_grad, and an engine's error still reaches the waiting requests."""
    b, threads = recording_batcher()
    try:
        for first in (10, 30):
            jobs = [b.submit(Job([first + k], 4, order=k)) for k in range(2)]
            assert [arrival(job)[0] for job in jobs] == ["done", "done"]
        broken = [b.submit(Job([66 + k], 4, order=k)) for k in range(2)]
        assert [job.events.get(timeout=10)[0] for job in broken] == ["error", "error"]
    finally:
        b.close()
    assert len(threads) == 3 and len({id(t) for t in threads}) == 3
    assert b._thread not in threads and threading.main_thread() not in threads
    for t in threads:
        t.join(5)
        assert not t.is_alive()


def test_engine_calls_run_on_the_thread_that_hosts_the_step():
    """While a thread hosts (`Batcher.host(work)`: the step's thread, waiting for its episodes), every engine
    call runs on it, under no_grad even where its grad mode is on, and work's result or error comes back;
    after it, calls go to threads of their own again. An engine error on the host reaches the requests and
    leaves the host serving. Why: one OpenMP team per process (Batcher.host says why)."""
    b, threads = recording_batcher()

    def episodes() -> list[str]:
        assert threading.current_thread() is not threading.main_thread()
        events = []
        for first in (10, 66, 30):
            jobs = [b.submit(Job([first + k], 4, order=k)) for k in range(2)]
            events += [job.events.get(timeout=10)[0] for job in jobs]
        return events

    def broken_agents():
        raise ValueError("an agent driver failed")

    try:
        with torch.enable_grad():
            assert b.host(episodes) == ["done", "done", "error", "error", "done", "done"]
        assert threads == [threading.main_thread()] * 3
        with pytest.raises(ValueError, match="an agent driver failed"):
            b.host(broken_agents)
        assert b._host is None
        jobs = [b.submit(Job([50 + k], 4, order=k)) for k in range(2)]  # nobody hosts: a thread of its own
        assert [arrival(job)[0] for job in jobs] == ["done", "done"]
        assert threads[-1] not in (threading.main_thread(), b._thread)
    finally:
        b.close()
