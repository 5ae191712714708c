"""`grpo eval`: held-out accuracy of a model from the command line (greedy pass@1, or pass@k/maj@k).

    grpo eval --json                                      # bundled model on the bundled held-out split
    grpo eval --model runs/x/final_model                  # the run's eval set and tools (its config.yaml)
    grpo eval --config tiny_tools --k 8 --limit 100       # sampled: pass@8, maj@8, tool-call rate
    grpo eval --config tiny_tools_agent train.eval_batch_size=8 generation.engine=transformers --json

key=value overrides apply to the config as `grpo train`'s do (after it, before the flags' own settings).

Without --config, the config.yaml a training run saved beside the model (final_model/, checkpoint-N/)
gives the eval set, the generation settings and the tools, so a tool-trained model is evaluated with its
tools; the command always names the evaluation set and whether tools were on.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

from grpo.config import SECTIONS, ConfigError, GRPOConfig, load_config, resolve_key
from grpo.ranges import INT_LIMIT, check_range
from grpo.redact import redact

log = logging.getLogger("grpo")


def add_eval_parser(sub, default_preset: str) -> None:
    """`grpo eval`'s flags; `default_preset`: the config when neither --config nor a run's config.yaml beside
    --model gives one."""
    ev = sub.add_parser("eval", help="Accuracy of a model on a dataset (greedy pass@1, or pass@k/maj@k).")
    ev.add_argument("--model", default=None, help="Model directory or hub id (default: the bundled model).")
    ev.add_argument("--dataset", default=None, help="Dataset spec (default: the bundled held-out split).")
    ev.add_argument(
        "--config",
        default=None,
        help="Preset or YAML file for the generation settings, eval set and tools (default: the config.yaml "
        f"saved beside --model by the run that trained it, else {default_preset}).",
    )
    ev.add_argument("--k", type=int, default=1, help="Samples per prompt; k > 1 reports pass@k and maj@k.")
    ev.add_argument("--temperature", type=float, default=1.0, help="Sampling temperature when k > 1.")
    ev.add_argument("--limit", type=int, default=None, help="Evaluate the first N rows only.")
    ev.add_argument(
        "--max-new-tokens", type=int, default=None, help="Completion cap (default: the config's)."
    )
    ev.add_argument(
        "--hf-access-token",
        "--hf_access_token",
        dest="hf_token",
        default=None,
        help="Hub token for gated models (default: $HF_TOKEN).",
    )
    env_help = {f.name: f.metadata["help"] for f in dataclasses.fields(SECTIONS["env"])}
    # in place of the config's (e.g. the tiny_tools offline control; another agent for tiny_tools_agent)
    for name in ("tools", "environment", "agent", "agent_command"):
        help_text = f"{env_help[name]} Replaces the config's (env.{name})."
        flag = "--" + name.replace("_", "-")
        ev.add_argument(flag, default=None, metavar="VALUE", help=help_text.replace("%", "%%"))
    ev.add_argument("--dump", default=None, help="Write every completion and its score to this JSONL file.")
    ev.add_argument("--json", action="store_true", help="Print one JSON object (accuracy, n, ...) only.")
    ev.add_argument(
        "assignments",
        nargs="*",
        metavar="key=value",
        help="Overrides of the config, as grpo train takes them, e.g. generation.max_new_tokens=64.",
    )
    ev.set_defaults(default_preset=default_preset)


def _eval_episodes(cfg, formatter):
    """The config's episodes, evaluated with them: its tools / environment, or its agent (each held-out
    episode driven by the agent through the gateway, greedy)."""
    if cfg.env.agent or cfg.env.agent_command:
        from grpo.gateway.runner import build_agent_runner

        return build_agent_runner(cfg, formatter, None)
    from grpo.rollout.episodes import build_episodes

    return build_episodes(cfg, formatter)


def _check_flags(args) -> None:
    """The numbers and paths of the command line, before anything loads."""
    for flag, value, high in (
        ("--k", args.k, 10_000),  # samples per prompt, all held at once
        ("--limit", args.limit, INT_LIMIT),
        ("--max-new-tokens", args.max_new_tokens, 1_000_000),
    ):
        if value is not None and value < 1:
            raise ConfigError(f"{flag} must be at least 1, got {value}.")
        if value is not None:
            check_range(value, flag, 1, high, error=ConfigError)
    if not 0 < args.temperature < float("inf"):
        raise ConfigError(f"--temperature must be a finite number > 0, got {args.temperature}.")
    if args.dump and not Path(args.dump).resolve().parent.is_dir():  # found out now, not after the evaluation
        raise ConfigError(
            f"--dump {args.dump}: the directory {Path(args.dump).resolve().parent} does not exist."
        )


def run_eval(args) -> int:
    """`grpo eval`: accuracy of --model on --dataset (default: the eval set of the run that saved the model,
    with its tools), named on stderr and in the output (`dataset`, `tools`)."""
    from grpo.data import PromptFormatter, load_rows
    from grpo.evaluation import EngineSampler, evaluate
    from grpo.model.loading import load_policy, load_tokenizer, resolve_device, resolve_dtype
    from grpo.rollout import build_engine
    from grpo.run.preflight import check_model_paths

    _check_flags(args)
    overrides = _assignments(args)
    if args.hf_token:
        overrides.append(("model.hf_token", args.hf_token))
    if args.model:
        overrides.append(("model.name_or_path", args.model))
    for name in ("tools", "environment", "agent", "agent_command"):  # in place of the config's
        if getattr(args, name) is not None:
            overrides.append((f"env.{name}", getattr(args, name)))
    config = args.config or _config_beside(args.model, args.default_preset)
    if config != (args.config or args.default_preset):  # the run's: its model paths are not this model's
        given = {path for key, _ in overrides for path in resolve_key(key)}
        paths = ("model.tokenizer_path", "model.load_parameters_path")
        overrides += [(k, None) for k in paths if k not in given]
    cfg = load_config(config, overrides, origin="the command line")
    check_model_paths(cfg, model_given=False, tokenizer_given=False)  # a missing directory, not a "repo id"
    spec = args.dataset or cfg.data.eval_dataset or "tiny_math:test"
    _refuse_unloadable_eval(cfg, spec, config)
    device = resolve_device(cfg.model.device)
    tokenizer = load_tokenizer(cfg)
    rows = load_rows(spec, cfg.data, split="test", token=cfg.hf_token())
    rows = rows[: args.limit] if args.limit else rows
    tools = ", ".join(cfg.env.tools) or (f"environment {cfg.env.environment}" if cfg.env.environment else "")
    log.info(
        "Evaluating %s on %s (%d rows), %s; settings from %s.",
        cfg.model.name_or_path,
        spec,
        len(rows),
        f"with tools: {tools}" if tools else "one turn, no tools",
        config,
    )
    model = load_policy(cfg, device)
    formatter = PromptFormatter(tokenizer, cfg.data)
    episodes = _eval_episodes(cfg, formatter)
    engine = build_engine(
        cfg.generation.engine, model, tokenizer, compute_dtype=resolve_dtype(cfg.model.dtype, device)
    )
    try:
        result = evaluate(
            EngineSampler(engine, episodes),
            formatter,
            rows,
            k=args.k,
            temperature=args.temperature,
            batch_size=cfg.train.eval_batch_size,
            max_new_tokens=args.max_new_tokens
            or cfg.train.eval_max_new_tokens
            or cfg.effective_max_new_tokens,
            stop_strings=cfg.generation.stop_strings,
        )
    finally:
        if callable(getattr(episodes, "close", None)):
            episodes.close()  # the agent gateway's server and any agent processes
        engine.close()
    if args.dump:
        from grpo.files import write_text

        write_text(args.dump, "".join(json.dumps(record) + "\n" for record in result.records))
    out = {**result.as_dict(), "dataset": spec, "tools": list(cfg.env.tools) or cfg.env.environment or None}
    if args.json:
        print(redact(json.dumps(out)))
    else:
        shown = "  ".join(f"{k}: {v:.4f}" if isinstance(v, float) else f"{k}: {v}" for k, v in out.items())
        print(redact(shown))
    return 0


def _assignments(args) -> list[tuple[str, object]]:
    """The `key=value` words in order, as (key as typed, value), the way `grpo train` reads them."""
    pairs: list[tuple[str, object]] = []
    for item in getattr(args, "assignments", None) or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"'{item}' is not key=value (e.g. generation.max_new_tokens=64).")
        if key.replace("-", "_") in ("config", "config_file", "config_name"):  # Hydra's spelling of --config
            args.config = value
            continue
        pairs.append((key.lstrip("+"), value))
    return pairs


def _config_beside(model: str | None, default_preset: str) -> str:
    """The config.yaml a training run saved in its model directory (final_model/, checkpoint-N/), so a
    tool-trained model is evaluated on its run's eval set with its tools; else the default preset."""
    saved = Path(model) / "config.yaml" if model else None
    if saved is not None and saved.is_file():
        return str(saved)
    return default_preset


def _refuse_unloadable_eval(cfg: GRPOConfig, spec: str, config: str) -> None:
    """An eval set or tools that only the Python process that trained the model had: say which and how."""
    from grpo.config import EVAL_HOLDOUT
    from grpo.run.provenance import is_recorded_object

    if spec == EVAL_HOLDOUT or is_recorded_object(spec):
        raise ConfigError(
            f"The run's evaluation set ({spec}, from {config}) cannot be loaded here: pass --dataset SPEC "
            "(a file, a hub id or a bundled task such as tiny_tools:test)."
        )
    if is_recorded_object(cfg.env.tools) or is_recorded_object(cfg.env.environment):
        raise ConfigError(
            f"The run's tools were passed in Python ({cfg.env.tools or cfg.env.environment}, from {config}): "
            "pass --tools package.module:function (or --environment package.module:Class) to evaluate with "
            "them, or --tools '' for one turn."
        )
