"""vLLM's engine stepped by hand: requests join the running batch at the next step (vLLM's continuous
batching), and each step's new tokens reach the request's owner as they are sampled.

`vllm.LLM.generate` adds its requests and steps the engine until they have all finished: a request that
arrives meanwhile waits for the whole batch, and one added by another thread would be stepped, and its
output swallowed, by that loop. So every request of the in-process engine goes through one `StepDriver`:
`add` renders the ids into an engine input (`Renderer.render_cmpl`, what `LLM.generate` does) and adds the
request to `LLMEngine`; `step` runs one engine step and hands each request's output to its sink, whichever
thread stepped. `run` is `generate`'s loop on it (final outputs only), and `add_row` is the gateway's
streamed row (`RequestOutputKind.DELTA`: each step's new token ids and their log-probs).
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Callable


class _Final:
    """generate's request: keeps the final RequestOutput (all n completions)."""

    def __init__(self):
        self.output = None
        self.error: BaseException | None = None

    def update(self, output) -> None:
        if output.finished:
            self.output = output

    def fail(self, error: BaseException) -> None:
        self.error = error


class _Row:
    """A streamed row: report(token ids, log-probs, finished, truncated) after every step that sampled."""

    def __init__(self, report: Callable, fail: Callable[[BaseException], None], logprobs: Callable):
        self.report, self.fail, self.logprobs = report, fail, logprobs

    def update(self, output) -> None:
        (completion,) = output.outputs
        self.report(
            list(completion.token_ids),
            self.logprobs(completion),
            output.finished,
            output.finished and completion.finish_reason == "length",
        )


class StepDriver:
    """One `LLMEngine`, stepped by whichever caller needs progress; each output goes to its request's sink."""

    def __init__(self, llm):
        from vllm.sampling_params import RequestOutputKind

        self.engine = llm.llm_engine
        self.kinds = RequestOutputKind
        self.lock = threading.RLock()  # steps, adds and weight reloads never overlap
        self._sinks: dict[str, _Final | _Row] = {}
        self._ids = itertools.count()

    @property
    def busy(self) -> bool:
        return bool(self._sinks)

    def add(self, ids: list[int], params, sink, lora_request=None) -> str:
        with self.lock:
            request_id = f"grpo-{next(self._ids)}"  # LLM's own requests are numbered "0", "1", ...
            (prompt,) = self.engine.renderer.render_cmpl([{"prompt_token_ids": list(ids)}])
            self.engine.add_request(request_id, prompt, params, lora_request=lora_request)
            self._sinks[request_id] = sink
        return request_id

    def add_row(self, ids, params, report, fail, logprobs, lora_request=None) -> str:
        params.output_kind = self.kinds.DELTA
        return self.add(ids, params, _Row(report, fail, logprobs), lora_request)

    def step(self) -> int:
        """One engine step over every request in flight; returns how many were (0: nothing to step)."""
        with self.lock:
            if not self._sinks:
                return 0
            rows = self.engine.get_num_unfinished_requests()
            try:
                outputs = self.engine.step()
            except BaseException as err:
                self._fail_all(err)
                raise
            for output in outputs:
                sink = self._sinks.get(output.request_id)
                if sink is None:
                    continue
                if output.finished:
                    del self._sinks[output.request_id]
                sink.update(output)
            return rows

    def run(self, prompts: list[list[int]], params: list, lora_request=None) -> list:
        """generate: every prompt's final RequestOutput, in order; other callers' requests step along."""
        sinks, added = [_Final() for _ in prompts], []
        try:
            for ids, p, sink in zip(prompts, params, sinks, strict=True):
                p.output_kind = self.kinds.FINAL_ONLY
                added.append(self.add(ids, p, sink, lora_request))
        except BaseException:  # a prompt vLLM refuses: the ones added before it leave the engine too
            self.abort(added)
            raise
        while any(s.output is None and s.error is None for s in sinks):
            self.step()
        for sink in sinks:
            if sink.error is not None:
                raise sink.error
        return [s.output for s in sinks]

    def abort(self, request_ids: list[str]) -> None:
        with self.lock:
            for request_id in request_ids:
                self._sinks.pop(request_id, None)
            self.engine.abort_request(list(request_ids))

    def _fail_all(self, error: BaseException) -> None:
        sinks, self._sinks = self._sinks, {}
        # The engine already failed: its requests are dropped whether or not the abort goes through.
        with contextlib.suppress(Exception):
            self.engine.abort_request(list(sinks))
        for sink in sinks.values():
            sink.fail(error)
