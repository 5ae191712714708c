"""Rollout on Ray actors, apart from the learner (`rollout.mode=sync|async`).

    learner ──(name, tensor) pairs via the object store, every weight_sync_steps──▶ RolloutWorker × R
    learner ◀──────────── Rollouts + the policy version that sampled them ───────── RolloutWorker × R

Each step's prompts are split over the R replicas (data-parallel sampling, MaxText's inference
replicas). `sync` asks for a step's rollouts only after the newest weights went out, so it is
on-policy and gives the single-process loop's numbers. `async` keeps the next batches sampling while
the learner trains, as far ahead as `max_staleness` allows: a batch sampled with weights v and used at
learner version v' has staleness v' − v; one above `max_staleness` is dropped and counted, and the
learner corrects the rest with the behaviour log-probs the actor returned (learner.py, `tis`).

Faults: every Ray call waits at most `timeout_s`; an actor that dies is replaced (up to
`max_actor_restarts` times), given the current weights, and its share of the batch is sampled again.

Agents (env.agent / env.agent_command, gateway/runner.py): the runner travels to each actor, which serves
its own gateway on 127.0.0.1 of its node (a free port, a key per episode) and runs the agents there (a
command is spawned on the actor's node). Under `async` the learner's weights load between two engine calls
of a running episode (a second thread of the actor, the "control" concurrency group), so one row may hold
tokens of two versions: every token carries its own (rollout/weight_versions.py), the staleness bound reads
each row's oldest, and an episode with a row past `max_staleness` is dropped and counted. A stop signal
reaches the actors' agents (STOP_GRACE_S, as in one process); closing ends their agents and servers.
"""

from __future__ import annotations

import inspect
import logging
import os
import pickle
import time
from collections import deque
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from grpo.agents.environments import EnvironmentContractError
from grpo.config import ConfigError, DistributedConfig
from grpo.distributed.runtime import Runtime
from grpo.model.lora import ADAPTER_MARK, is_lora
from grpo.records import PromptBatch, Rollouts, SamplingParams, concat_rollouts
from grpo.redact import argv_redacted
from grpo.rewards.isolation import request_stop, stop_requested
from grpo.rollout.source import PromptFeed, join_prompts, prompt_rows
from grpo.rollout.weight_versions import VersionedEngine, drop_stale, mixed_rows, row_lags

log = logging.getLogger("grpo")
ACTOR_PREFIX = "grpo-rollout-"
CONTROL = "control"  # the concurrency group of an agent actor's calls that must not wait for a step
# Gateway metrics that add up over the actors; the others are per episode or per call: averaged.
_SUMMED = ("gateway/forks", "gateway/drift_tokens", "gateway/engine_calls")


@dataclass
class EngineSpec:
    """What an actor needs to build its own engine: the policy's architecture (its weights arrive by
    `load_weights`), LoRA settings, the tokenizer, and the generation settings that name the engine."""

    model_config: Any  # the (base) policy's transformers config
    dtype: torch.dtype  # compute dtype: the actor's copy is held and sampled in it
    lora: dict | None  # LoraSettings as a dict, or None
    tokenizer: Any
    generation: Any  # GenerationConfig; generation.engine names the engine
    seed: int
    num_threads: int
    episodes: Any = None  # the EpisodeRunner (rollout/episodes.py); None: one turn
    environments: bool = False  # send each episode's environment back (reward functions read them)

    @classmethod
    def of_policy(cls, policy, dtype: torch.dtype, tokenizer, cfg, rank: int, episodes=None) -> EngineSpec:
        base = policy.get_base_model() if is_lora(policy) else policy
        lora = asdict(cfg.lora) if is_lora(policy) else None
        threads = cfg.train.num_threads or 1
        seed = cfg.train.seed + rank
        return cls(base.config, dtype, lora, tokenizer, cfg.generation, seed, threads, episodes)


@dataclass
class Placement:
    """This learner rank's actors: how many, GPUs each, and (one machine) which GPU ids each is pinned to."""

    replicas: int
    gpus: int
    pinned: list[list[int]]


class RolloutWorker:
    """A Ray actor: its own copy of the policy (weights arrive by `load_weights`) and a rollout engine."""

    def __init__(self, spec: EngineSpec, use_gpu: bool):
        from transformers import AutoModelForCausalLM

        from grpo.config import LoraSettings
        from grpo.model.lora import apply_lora
        from grpo.rollout import build_engine
        from grpo.rollout.episodes import SingleTurn

        torch.set_num_threads(spec.num_threads)
        model = AutoModelForCausalLM.from_config(spec.model_config, dtype=spec.dtype)
        if spec.lora is not None:
            model = apply_lora(model, LoraSettings(**spec.lora))
        model.to("cuda" if use_gpu else "cpu").eval()
        g = spec.generation
        engine = build_engine(g.engine, model, spec.tokenizer, generation=g, seed=spec.seed)  # vllm: own LLM
        self.engine = VersionedEngine(engine)
        torch.manual_seed(
            spec.seed
        )  # after the random init: sampling noise starts where a colocated run's does
        self.version = -1  # no weights yet
        self.episodes = spec.episodes or SingleTurn()
        self.environments = spec.environments
        self.ended = False  # end_episodes was called: no step starts again

    def sampler_differs(self) -> bool:
        return self.engine.sampler_differs

    def load_weights(self, named_tensors: list[tuple[str, torch.Tensor]], version: int) -> int:
        self.engine.load(named_tensors, version)  # between two engine calls, never during one
        self.version = version
        return version

    def generate(
        self, prompts: PromptBatch, n: int, sampling: SamplingParams, chunk_prompts: int | None
    ) -> tuple[PromptBatch, Rollouts, int, dict]:
        """The prompts' episodes (one turn or many), the weight version that sampled them (each token's own
        is in rollouts.weight_version when the runner keeps it) and the runner's metrics."""
        if self.ended:
            raise RuntimeError("this rollout actor is closing")
        if getattr(self.episodes, "weights_mid_episode", False):
            prompts, rollouts = self.episodes.run(self.engine, prompts, n, sampling, chunk_prompts)
        else:
            with self.engine.lock:  # one turn, or turns whose rows keep no versions: one set of weights
                prompts, rollouts = self.episodes.run(self.engine, prompts, n, sampling, chunk_prompts)
        if rollouts.episodes is not None and not self.environments:
            for episode in rollouts.episodes:  # no reward function reads them: they stay here
                episode.environment = None
        metrics = getattr(self.episodes, "metrics", None)  # the agent gateway's (rows, forks, batching)
        return prompts, rollouts, self.version, metrics() if metrics is not None else {}

    def stop(self) -> None:
        """The learner got SIGINT/SIGTERM: the episodes in flight get STOP_GRACE_S, as in one process."""
        request_stop()

    def end_episodes(self) -> None:
        """End every agent and server now (the run is over), even while a step runs; no step starts again."""
        self.ended = True
        self.episodes.close()

    def close(self) -> None:
        try:
            self.engine.close()
        finally:
            self.episodes.close()


@dataclass
class _Request:
    prompts: PromptBatch
    parts: list  # one ObjectRef per replica that got prompts
    splits: list[slice]  # which prompts each part answers
    data_state: dict  # the prompt stream's position once this request's prompts were drawn


class RayRollout:
    """The RolloutSource of `rollout.mode=sync|async`: R actors per learner rank, each with its own engine."""

    exact_logprobs = False  # an actor's copy and kernels are not the learner's

    def __init__(
        self,
        d: DistributedConfig,
        spec: EngineSpec,
        placement: Placement,
        feed: PromptFeed,
        num_generations: int,
        sampling: SamplingParams,
        rt: Runtime,
        chunk_prompts: int | None = None,
    ):
        import ray

        self.d, self.spec, self.placement, self.feed, self.rt = d, spec, placement, feed, rt
        self.n, self.sampling, self.chunk_prompts, self.timeout = (
            num_generations,
            sampling,
            chunk_prompts,
            d.timeout_s,
        )
        self.ahead = 0 if d.rollout_mode == "sync" else max(1, d.max_staleness - d.weight_sync_steps + 1)
        self.started_ray = not ray.is_initialized()
        if self.started_ray:
            # Ray starts workers at niceness 15; rollout is the run's main work, not background work.
            os.environ.setdefault("RAY_worker_niceness", "0")
            try:
                with argv_redacted():  # Ray keeps the driver's command line in its job table and logs
                    ray.init(address=d.ray_address, include_dashboard=False, logging_level=logging.WARNING)
            except ConnectionError as e:
                raise ConfigError(
                    f"Could not join the Ray cluster at ray_address={d.ray_address} ({e}). Is it running "
                    "(`ray status`)? Ray >= 2.59 clusters check a token: a process on the head's machine "
                    "reads it from ~/.ray/auth_token (same user, same HOME); elsewhere export "
                    "RAY_AUTH_TOKEN=$(ray get-auth-token) (run on the head) or RAY_AUTH_TOKEN_PATH=FILE "
                    "before `ray start --address` and torchrun."
                ) from e
        self.spawned = 0
        self.live = getattr(spec.episodes, "weights_mid_episode", False)
        self.stopping = False  # the actors were told of a stop signal
        self.actors = [self._spawn(i) for i in range(placement.replicas)]
        self.sampler_differs = self._get(self.actors[0].sampler_differs.remote(), "sampler_differs")
        self.pending: deque[_Request] = deque()
        self.multi_turn = spec.episodes is not None and spec.episodes.multi_turn
        self.runner_metrics: dict[str, float] = {}
        self.dropped_rows = self.mixed = 0
        self.policy: torch.nn.Module | None = None  # what sync_weights last pushed; None: nothing yet
        self.version = 0  # optimizer steps the learner had taken at the last sync
        self.pushed = -1  # the version the actors hold
        self.consumed: dict | None = None  # the data position after the last batch handed to the learner
        self.restarts = self.dropped = self.staleness_max = self.last_lag = 0
        self.behaviour, self.wait_s = 0, 0.0
        log.info(
            "Rollout: %d Ray actor(s) (%s), mode %s, weights every %d step(s), max staleness %d.",
            placement.replicas,
            f"{placement.gpus} GPU each" if placement.gpus else "CPU",
            d.rollout_mode,
            d.weight_sync_steps,
            d.max_staleness,
        )

    # -- actors and weights ----------------------------------------------------------------------
    def _spawn(self, i: int):
        import ray

        # Named, so `ray list actors` (and a test) can find them: grpo-rollout-<pid>-r<rank>-<n>.
        self.spawned += 1
        name = f"{ACTOR_PREFIX}{os.getpid()}-r{self.rt.rank}-{self.spawned}"
        gpus, pinned = self.placement.gpus, self.placement.pinned
        options = {"name": name, "num_cpus": 1, "num_gpus": gpus, "max_restarts": 0}
        if pinned:
            devices = ",".join(map(str, pinned[i % len(pinned)]))
            options.update(num_gpus=0, runtime_env={"env_vars": {"CUDA_VISIBLE_DEVICES": devices}})
        # agents: the actors take weights and stop requests while a step runs (a second thread)
        remote = ray.remote(concurrency_groups={CONTROL: 1}) if self.live else ray.remote
        return remote(RolloutWorker).options(**options).remote(self.spec, gpus > 0)

    def sync_weights(self, step: int, policy: torch.nn.Module) -> None:
        """Every weight_sync_steps learner steps (and first of all), push the policy to every actor."""
        first = self.policy is None
        self.policy, self.version = policy, step
        if first or step % self.d.weight_sync_steps == 0:
            self._push(full=first)

    def _weights(self, full: bool) -> list[tuple[str, torch.Tensor]]:
        only = (
            None if full or self.spec.lora is None else ADAPTER_MARK
        )  # LoRA: adapters only after the first push
        return [(n, t.cpu()) for n, t in self.rt.full_named_parameters(self.policy, only=only)]

    def _push(self, full: bool, actors: list[int] | None = None) -> None:
        import ray

        if actors is None:
            self.pushed = self.version
        weights = ray.put(self._weights(full))
        for i in range(len(self.actors)) if actors is None else actors:
            load = self.actors[i].load_weights
            if self.live and self.d.rollout_mode == "async":
                load = load.options(concurrency_group=CONTROL)  # into running episodes, between engine calls
            try:
                self._get(load.remote(weights, self.version), "load_weights")
            except ray.exceptions.RayActorError as e:
                self._replace(i, e)

    # -- batches -----------------------------------------------------------------------------------
    def _submit(self) -> None:
        prompts = self.feed.next()
        k = len(self.actors)
        size = -(-len(prompts) // k)
        splits = [slice(i, min(i + size, len(prompts))) for i in range(0, len(prompts), size)]
        parts = [self._generate(i, prompt_rows(prompts, s)) for i, s in enumerate(splits)]
        self.pending.append(_Request(prompts, parts, splits, self.feed.stream.state_dict()))

    def next_batch(self) -> tuple[PromptBatch, Rollouts, int]:
        """The next usable batch and its staleness (learner steps since the weights that sampled it)."""
        while True:
            if not self.pending:
                self._submit()
            request = self.pending.popleft()
            while len(self.pending) < self.ahead:  # keep sampling while the learner trains on this batch
                self._submit()
            prompts, rollouts, behaviour = self._collect(request)
            self.consumed = request.data_state
            rollouts, lag = self._fresh_rows(rollouts, behaviour)
            if lag <= self.d.max_staleness:
                self.staleness_max = max(self.staleness_max, lag)
                self.last_lag, self.behaviour = lag, self.version - lag
                self.mixed += mixed_rows(rollouts)
                return prompts, rollouts, lag
            self.dropped += len(request.prompts)
            log.warning(
                "Dropped %d prompts sampled with weights %d steps old (max_staleness %d).",
                len(request.prompts),
                lag,
                self.d.max_staleness,
            )

    def _fresh_rows(self, rollouts: Rollouts, behaviour: int) -> tuple[Rollouts, int]:
        """The batch's lag: its oldest token's (rows keep per-token versions) or the actors' version. Where
        only some episodes are past max_staleness (an agent's episode spans weight updates), those are
        dropped and counted, and the lag is the oldest kept row's."""
        lags = row_lags(rollouts, self.version)  # [N], or None: every row sampled with `behaviour`
        if lags is None:
            return rollouts, self.version - behaviour
        fresh = lags <= self.d.max_staleness  # [N]
        if bool(fresh.all()) or not bool(fresh.any()) or rollouts.episodes is None:
            return rollouts, int(lags.max())
        rollouts, dropped = drop_stale(rollouts, lags, self.d.max_staleness)
        self.dropped_rows += dropped
        log.warning(
            "Dropped %d rows with tokens sampled more than %d steps ago (max_staleness).",
            dropped,
            self.d.max_staleness,
        )
        return rollouts, int(lags[fresh].max())

    def data_state(self) -> dict:
        """After the last batch the learner *used*, not after the batches still sampling ahead of it."""
        return dict(self.consumed) if self.consumed is not None else self.feed.stream.state_dict()

    def sample(self, prompts: PromptBatch, n: int, sampling: SamplingParams) -> tuple[PromptBatch, Rollouts]:
        """On the first actor, after giving it the newest weights if it holds older ones."""
        if self.policy is not None and self.pushed != self.version:
            self._push(full=False)
        out = self._get(self.actors[0].generate.remote(prompts, n, sampling, self.chunk_prompts), "sample")
        self.runner_metrics = {}  # an evaluation's gateway metrics are not the next step's
        return out[0], out[1]

    def _collect(self, request: _Request) -> tuple[PromptBatch, Rollouts, int]:
        import ray

        results = []
        for i, split in enumerate(request.splits):
            start = time.perf_counter()
            try:
                results.append(self._get(request.parts[i], "generate"))
            except ray.exceptions.RayActorError as e:
                self._replace(i, e)
                results.append(self._get(self._generate(i, prompt_rows(request.prompts, split)), "generate"))
            self.wait_s += time.perf_counter() - start
        sizes = [s.stop - s.start for s in request.splits]
        pad_id = self.spec.tokenizer.pad_token_id
        rollouts = concat_rollouts([r for _, r, _, _ in results], sizes, pad_id)
        self.runner_metrics = combine_metrics([m for *_, m in results])
        return join_prompts([p for p, *_ in results]), rollouts, min(v for _, _, v, _ in results)

    def _generate(self, i: int, prompts: PromptBatch):
        return self.actors[i].generate.remote(prompts, self.n, self.sampling, self.chunk_prompts)

    def _replace(self, i: int, error: Exception) -> None:
        """Actor i died: start another with the current weights and resend what was queued on it."""
        import ray

        self.restarts += 1
        if self.restarts > self.d.max_actor_restarts:
            raise RuntimeError(
                f"Rollout actors died {self.restarts} times (max_actor_restarts="
                f"{self.d.max_actor_restarts}); last error: {error}"
            ) from error
        log.warning(
            "Rollout actor %d died (%s); starting a new one (restart %d of at most %d).",
            i,
            type(error).__name__,
            self.restarts,
            self.d.max_actor_restarts,
        )
        ray.kill(self.actors[i], no_restart=True)
        self.actors[i] = self._spawn(i)
        if self.policy is not None:
            self._push(full=True, actors=[i])
        for request in self.pending:  # requests queued on the dead actor died with it
            if i < len(request.splits):
                request.parts[i] = self._generate(i, prompt_rows(request.prompts, request.splits[i]))

    def _get(self, refs, what: str):
        import ray

        try:
            return self._wait(refs) if self.live else ray.get(refs, timeout=self.timeout)
        except ray.exceptions.RayTaskError as e:
            if isinstance(e.cause, EnvironmentContractError | ConfigError):  # the user's one-line error
                raise e.cause.with_traceback(None) from None
            raise
        except ray.exceptions.GetTimeoutError as e:
            raise RuntimeError(
                f"Ray rollout call '{what}' gave no answer within distributed.timeout_s="
                f"{self.timeout:.0f}s; the actor is hung or starved of resources."
            ) from e

    def _wait(self, refs):
        """ray.get, watching for a stop signal meanwhile: the actors' agents then get STOP_GRACE_S, as in one
        process (an agent may hang for env.episode_timeout_s, and the step waits for every episode)."""
        import ray

        deadline = time.monotonic() + self.timeout
        while True:
            try:
                return ray.get(refs, timeout=max(0.0, min(0.25, deadline - time.monotonic())))
            except ray.exceptions.GetTimeoutError:
                if time.monotonic() >= deadline:
                    raise
            if stop_requested() and not self.stopping:
                self.stopping = True
                for actor in self.actors:
                    actor.stop.options(concurrency_group=CONTROL).remote()

    def metrics(self) -> dict[str, float]:
        runner, self.runner_metrics = self.runner_metrics, {}
        if self.live:
            runner["rollout/dropped_stale_rows"] = float(self.dropped_rows)
            runner["rollout/mixed_version_rows"] = float(self.mixed)
        return {
            **runner,
            "rollout/policy_version": float(self.version),
            "rollout/behaviour_version": float(self.behaviour),
            "rollout/staleness": float(self.last_lag),
            "rollout/staleness_max": float(self.staleness_max),
            "rollout/dropped_stale": float(self.dropped),
            "rollout/actor_restarts": float(self.restarts),
            "time/rollout_wait": self.wait_s,
        }

    def close(self) -> None:
        import ray

        if self.live:  # agents and servers end now, even mid-step (the step in flight is not wanted)
            ends = [actor.end_episodes.options(concurrency_group=CONTROL).remote() for actor in self.actors]
            try:
                ray.get(ends, timeout=min(self.timeout, 60))
            except Exception as e:  # noqa: BLE001 - a dead or hung actor is killed below all the same
                log.warning("Rollout actors did not end their agents cleanly (%s).", type(e).__name__)
        for actor in self.actors:
            try:  # the actor's engine releases what it holds outside memory (vLLM's weight folder)
                ray.get(actor.close.remote(), timeout=min(self.timeout, 60))
            except Exception as e:  # noqa: BLE001 - a dead or hung actor is killed below all the same
                log.warning("Rollout actor did not close cleanly (%s); killing it.", type(e).__name__)
            ray.kill(actor, no_restart=True)
        self.actors = []
        if self.started_ray:
            ray.shutdown()


def placement(cfg, rt: Runtime) -> Placement:
    """This rank's share of the planned rollout replicas (each learner rank drives its own actors)."""
    from grpo.distributed.roles import plan_roles

    plan = plan_roles(cfg, torch.cuda.device_count(), rt.world_size, rt.local_rank)
    replicas = max(1, plan.rollout_replicas // rt.world_size)
    # On one machine the plan names each replica's GPU; pin it (Ray would pick any free GPU, the
    # learner's included, as it does not know torchrun's processes use them).
    pinned = (
        plan.rollout_devices[rt.rank * replicas : (rt.rank + 1) * replicas]
        if plan.rollout_devices and cfg.distributed.ray_address is None
        else []
    )
    return Placement(replicas, plan.rollout_gpus_per_replica, pinned)


def build(cfg, parts, rt: Runtime, feed: PromptFeed, sampling: SamplingParams, chunk_prompts: int | None):
    spec = EngineSpec.of_policy(
        parts.policy, parts.compute_dtype, parts.tokenizer, cfg, rt.rank, getattr(parts, "episodes", None)
    )
    spec.environments = environments_travel(parts.episodes, parts.reward_funcs)
    if spec.episodes is not None:
        episodes_travel(spec.episodes)
    if getattr(parts, "settings", None):  # vLLM's max_model_len from the run's one completion limit
        spec = replace(spec, generation=parts.settings.generation)
    g = cfg.generation
    return RayRollout(
        cfg.distributed, spec, placement(cfg, rt), feed, g.num_generations, sampling, rt, chunk_prompts
    )


def combine_metrics(parts: list[dict[str, float]]) -> dict[str, float]:
    """The actors' runner metrics as one line: counts added up, the rest averaged over the actors."""
    keys = {k for part in parts for k in part}
    out = {}
    for k in sorted(keys):
        values = [part[k] for part in parts if k in part]
        out[k] = sum(values) if k in _SUMMED else sum(values) / len(values)
    return out


def episodes_travel(episodes) -> None:
    """Refuse at start-up, in one line, an episode runner that cannot be sent to the actors (an agent
    object that does not pickle, say), rather than fail inside Ray."""
    from ray import cloudpickle

    try:
        cloudpickle.dumps(episodes)
    except Exception as err:  # noqa: BLE001 - whatever pickling raises, the answer is "it does not travel"
        what = getattr(getattr(episodes, "agent", None), "__qualname__", type(episodes).__name__)
        raise ConfigError(
            f"Under Ray the episodes run on rollout actors, and {what} cannot be sent there "
            f"({type(err).__name__}: {err}). Give it as an import path (env.agent=pkg.module:run or "
            "path/to/file.py:run), make it picklable, or set distributed.rollout_mode=colocated."
        ) from None


def environments_travel(episodes, reward_funcs: list) -> bool:
    """Whether the actors send each episode's environment back with its rollouts, so that reward functions get
    `environments` as they do in one process: when the environments pickle. A reward function that names
    `environments` while they do not is refused at start-up, saying why."""
    samples = getattr(episodes, "environment_samples", lambda: [])()
    if not samples:
        return False
    readers = [getattr(f, "__name__", type(f).__name__) for f in reward_funcs if _names_environments(f)]
    for instance in samples:
        try:
            pickle.dumps(instance)
        except Exception as err:  # noqa: BLE001 - whatever pickling raises, the answer is "it does not pickle"
            if readers:
                raise ConfigError(
                    f"The reward function {readers[0]} reads `environments`, but under Ray the episodes run "
                    f"on rollout actors and {type(instance).__name__} instances cannot be sent back "
                    f"({type(err).__name__}: {err}). Make the class picklable (__getstate__), or set "
                    "distributed.rollout_mode=colocated."
                ) from None
            log.info("Environments stay on the rollout actors (%s does not pickle).", type(instance).__name__)
            return False
    return True


def _names_environments(fn) -> bool:
    try:
        return "environments" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
