"""Every hostile input in docs/reliability.md's table, one case each: the message the user gets must be
the one the table shows (`<...>` there stands for a path, a number or a library's own words)."""

import builtins
import contextlib
import errno
import io
import json
import logging
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

import grpo.checkpoint.store as ckpt
from grpo import GRPOConfig, GRPOTrainer, cli
from grpo.checkpoint.store import CheckpointError, save_model_dir
from grpo.config import ConfigError, load_config
from grpo.model.loading import prepare_tokenizer
from grpo.rewards import RewardError
from grpo.run.runlock import RunLock
from tests import tiny_run

pytestmark = pytest.mark.slow
DOC = Path(__file__).resolve().parents[2] / "docs" / "reliability.md"
ROW = re.compile(r"^\| (H\d+) \| (.+?) \| `(.+)` \|$")


def doc_rows() -> dict[str, str]:
    rows = {}
    for line in DOC.read_text(encoding="utf-8").splitlines():
        m = ROW.match(line)
        if m:
            rows[m.group(1)] = m.group(3)
    return rows


def as_regex(message: str) -> str:
    return ".*?".join(re.escape(part) for part in re.split(r"<[^<>]*>", message.replace("\\|", "|")))


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile")
    model = tiny_run.make_model_dir(root / "model")
    data = tiny_run.write_dataset(root / "data.jsonl", 4)
    run = root / "run"
    GRPOTrainer(config=GRPOConfig(**tiny_run.config(model, data, run, steps=1))).train()
    return {"root": root, "model": model, "data": data, "run": run}


class Ctx:
    def __init__(self, base, tmp: Path, monkeypatch):
        self.base, self.tmp, self.monkeypatch = base, tmp, monkeypatch
        self.held = []  # objects a case keeps alive until it is over (a lock another "run" holds)

    def trainer(self, **overrides):
        overrides.setdefault("output_dir", str(self.tmp / "out"))
        cfg = tiny_run.config(self.base["model"], self.base["data"], overrides.pop("output_dir"), steps=2)
        return GRPOTrainer(config=GRPOConfig(**{**cfg, **overrides}))

    def file(self, name: str, content: str | bytes) -> Path:
        path = self.tmp / name
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
        return path

    def model_dir(self, name: str, files: dict[str, str]) -> Path:
        path = self.tmp / name
        path.mkdir()
        for f, text in files.items():
            (path / f).write_text(text)
        return path

    def copy_run(self) -> Path:
        return Path(shutil.copytree(self.base["run"], self.tmp / "run"))


def _unusable_warning(c: Ctx):
    run = c.copy_run()
    ckpt.save_model_dir(run / "checkpoint-2", _Model(), _Tok(), "x: 1\n", {"step": 2})
    (run / "checkpoint-2" / "manifest.json").unlink()
    c.trainer(output_dir=str(run), resume="latest")


class _Model:
    def save_pretrained(self, d, safe_serialization=True):
        (Path(d) / "model.safetensors").write_bytes(b"0")


class _Tok:
    def save_pretrained(self, d):
        (Path(d) / "tokenizer.json").write_text("{}")


class _NoPad:
    pad_token = None
    eos_token = "<|end|>"


class _NoPadNoEos:
    pad_token = eos_token = None


def _disk_full(c: Ctx):
    save_model_dir(c.tmp / "checkpoint-1", _Model(), _Tok(), "x: 1\n", {"step": 1})

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    c.monkeypatch.setattr(ckpt.torch, "save", full)
    save_model_dir(c.tmp / "checkpoint-2", _Model(), _Tok(), "x: 1\n", {"step": 2})


def _damaged_explicit(c: Ctx):
    run = c.copy_run()
    target = run / "checkpoint-1" / "model.safetensors"
    data = bytearray(target.read_bytes())
    data[100] ^= 0xFF
    target.write_bytes(bytes(data))
    c.trainer(output_dir=str(run), resume=str(run / "checkpoint-1"))


def _different_dataset(c: Ctx):
    data = tiny_run.write_dataset(c.tmp / "d.jsonl", 4)
    GRPOTrainer(config=GRPOConfig(**tiny_run.config(c.base["model"], data, c.tmp / "r", steps=1))).train()
    data.write_text(data.read_text().replace("apples", "pears"))
    GRPOTrainer(
        config=GRPOConfig(**tiny_run.config(c.base["model"], data, c.tmp / "r", steps=2, resume="latest"))
    ).train()


def _unreadable(c: Ctx, what: str):
    real = os.access
    c.monkeypatch.setattr(os, "access", lambda p, mode, **k: False if Path(p).name == what else real(p, mode))


def _cli(*argv: str) -> str:
    """The error line `grpo ...` prints (a case that goes through the command line)."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = cli.main(list(argv))
    assert code != 0, f"{argv} exited 0"
    return [line for line in err.getvalue().splitlines() if line.startswith("grpo ")][-1]


def _live_run(c: Ctx):
    run = c.copy_run()
    c.held.append(RunLock(run).acquire())  # as a live `grpo train` on this directory holds it
    c.trainer(output_dir=str(run), resume="latest")


def _final_model_without_state(c: Ctx):
    run = c.copy_run()
    (run / "final_model" / ckpt.STATE_FILE).unlink(missing_ok=True)  # final_model as older versions wrote it
    ckpt.write_manifest(run / "final_model")
    c.trainer(output_dir=str(run), resume=str(run / "final_model"))


def _run_dir_without_checkpoints(c: Ctx):
    run = c.tmp / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    c.trainer(output_dir=str(c.tmp / "out"), resume=str(run))


def _newer_checkpoint(c: Ctx, config_yaml: str = "x: 1\n") -> Path:
    run = c.copy_run()
    ckpt.save_model_dir(run / "checkpoint-2", _Model(), _Tok(), config_yaml, {"step": 2})
    return run


def _manifest_of_wrong_shape(c: Ctx, files):
    run = _newer_checkpoint(c)
    (run / "checkpoint-2" / "manifest.json").write_text(json.dumps({"version": 1, "files": files}))
    c.trainer(output_dir=str(run), resume="latest")


def _config_not_yaml(c: Ctx):
    run = _newer_checkpoint(c, config_yaml="train: [unclosed\n")  # hashed as written: the manifest verifies
    c.trainer(output_dir=str(run), resume="latest")


class _Payload:
    def __reduce__(self):
        return os.getcwd, ()  # harmless, and never called: the point is that loading would call it


def _pickle_payload(c: Ctx):
    run = c.copy_run()
    torch.save({"step": 1, "x": _Payload()}, run / "checkpoint-1" / ckpt.STATE_FILE)
    ckpt.write_manifest(run / "checkpoint-1")  # re-made over it, as an attacker would
    c.trainer(output_dir=str(run), resume=str(run / "checkpoint-1"))


def _metrics_not_utf8(c: Ctx):
    run = c.copy_run()
    with open(run / "metrics.jsonl", "ab") as fh:
        fh.write(b'{"step": 1, "note": "caf\xe9"}\n')
    c.trainer(output_dir=str(run), resume="latest").train()


def _metrics_is_a_directory(c: Ctx):
    run = c.copy_run()
    (run / "metrics.jsonl").unlink()
    (run / "metrics.jsonl").mkdir()
    c.trainer(output_dir=str(run), resume="latest").train()


def _run_dir_deleted_mid_run(c: Ctx):
    out = c.tmp / "out"

    def deletes_the_run_dir(prompts, completions, **_):
        shutil.rmtree(out, ignore_errors=True)
        return [0.0] * len(completions)

    cfg = tiny_run.config(c.base["model"], c.base["data"], out, steps=2)
    GRPOTrainer(config=GRPOConfig(**cfg), reward_funcs=[deletes_the_run_dir, tiny_run.letter_score]).train()


def _reward_calls_sys_exit(c: Ctx):
    def exits(prompts, completions, **_):
        raise SystemExit(3)

    cfg = tiny_run.config(c.base["model"], c.base["data"], c.tmp / "out", steps=1, reward_timeout=None)
    GRPOTrainer(config=GRPOConfig(**cfg), reward_funcs=[exits]).train()


class _SmallDisk(io.FileIO):
    """A file on a disk with 1 KiB left: writes past it fail as a full disk's do (ENOSPC)."""

    def write(self, data):
        if self.tell() + len(data) > 1024:
            raise OSError(errno.ENOSPC, "No space left on device")
        return super().write(data)


def _disk_full_in_torch_save(c: Ctx):
    save_model_dir(c.tmp / "checkpoint-1", _Model(), _Tok(), "x: 1\n", {"step": 1})

    def small_disk(file, mode="r", *args, **kwargs):  # the real torch.save writes the state onto it
        if Path(file).name == ckpt.STATE_FILE and "w" in mode:
            return _SmallDisk(file, "w")
        return builtins.open(file, mode, *args, **kwargs)

    c.monkeypatch.setattr(ckpt, "open", small_disk, raising=False)
    save_model_dir(c.tmp / "checkpoint-2", _Model(), _Tok(), "x: 1\n", {"step": 2, "t": torch.zeros(4096)})


CASES = {
    "H01": lambda c: GRPOConfig(lerning_rate=1e-3),
    "H02": lambda c: GRPOConfig(beta="high"),
    "H03": lambda c: GRPOConfig(temperature=0).validate(),
    "H04": lambda c: GRPOConfig(learning_rate="nan").validate(),
    "H05": lambda c: GRPOConfig(batch_size=3, num_generations=4, gradient_accumulation_steps=5).validate(),
    "H06": lambda c: load_config(str(c.file("bad.yaml", "train: [unclosed"))),
    "H07": lambda c: load_config("tiny_mth"),
    "H08": lambda c: c.trainer(model=str(c.tmp / "nope")),
    "H09": lambda c: c.trainer(model=str(c.file("weights.safetensors", "x"))),
    "H10": lambda c: (_unreadable(c, "model"), c.trainer())[1],
    "H11": lambda c: c.trainer(model=str(c.model_dir("m", {"model.safetensors": "x"}))),
    "H12": lambda c: c.trainer(model=str(c.model_dir("m", {"config.json": "{}", "pytorch_model.bin": "x"}))),
    "H13": lambda c: c.trainer(
        model=str(
            c.model_dir(
                "m",
                {"config.json": json.dumps({"auto_map": {"AutoConfig": "a.B"}}), "model.safetensors": "x"},
            )
        )
    ),
    "H14": lambda c: c.trainer(tokenizer_path=str(c.model_dir("t", {"config.json": "{}"}))),
    "H15": lambda c: c.trainer(dataset=str(c.tmp / "nope.jsonl")),
    "H16": lambda c: (c.monkeypatch.setattr(Path, "read_bytes", _denied), c.trainer())[1],
    "H17": lambda c: c.trainer(dataset=str(c.file("empty.jsonl", "\n"))),
    "H18": lambda c: c.trainer(dataset=str(c.file("none.json", "[]"))),
    "H19": lambda c: c.trainer(
        dataset=str(c.file("latin1.jsonl", '{"prompt": "ok"}\n{"prompt": "caf\xe9"}\n'.encode("latin-1")))
    ),
    "H20": lambda c: c.trainer(dataset=str(c.file("broken.jsonl", '{"prompt": "ok"}\n{"prompt": "no end\n'))),
    "H21": lambda c: c.trainer(dataset=str(c.file("text.jsonl", '{"text": "hello"}\n'))),
    "H22": lambda c: c.trainer(dataset=str(c.file("p.jsonl", '{"prompt": "a"}\n{"prompt": ""}\n{"x": 1}\n'))),
    "H23": lambda c: c.trainer(
        dataset=str(c.file("a.jsonl", '{"prompt": "a", "answer": "1"}\n{"prompt": "b"}\n'))
    ),
    "H24": lambda c: c.trainer(
        skip_invalid_rows=True, dataset=str(c.file("s.jsonl", '{"prompt": "a"}\n{"prompt": ""}\n{"x": 1}\n'))
    ),
    "H25": lambda c: c.trainer(max_prompt_length=8),
    "H26": lambda c: prepare_tokenizer(_NoPad()),
    "H27": lambda c: prepare_tokenizer(_NoPadNoEos()),
    "H28": lambda c: c.trainer(output_dir=str(c.file("out", "x"))),
    "H29": lambda c: c.trainer(output_dir=str(c.file("f", "x") / "sub")),
    "H30": lambda c: c.trainer(output_dir=str(c.base["run"])).train(),  # refused when train() starts
    "H31": lambda c: c.trainer(output_dir=str(c.base["run"]), resume="latest", learning_rate=1e-3, top_k=5),
    "H32": _damaged_explicit,
    "H33": _unusable_warning,
    "H34": _different_dataset,
    "H35": _disk_full,
    "H36": _live_run,
    "H37": _disk_full_in_torch_save,
    "H38": _final_model_without_state,
    "H39": _run_dir_without_checkpoints,
    "H40": lambda c: _manifest_of_wrong_shape(c, [1, 2]),
    "H41": lambda c: _manifest_of_wrong_shape(c, {"../../outside": {"bytes": 1, "sha256": "00"}}),
    "H42": _config_not_yaml,
    "H43": _pickle_payload,
    "H44": _metrics_not_utf8,
    "H45": _metrics_is_a_directory,
    "H46": _run_dir_deleted_mid_run,
    "H47": _reward_calls_sys_exit,
    "H48": lambda c: _cli("eval", "--model", str(c.tmp / "run") + "/checkpoint-6"),
    "H49": lambda c: _cli("eval", "--model", "runs/exp1/checkpoint-6"),
    "H50": lambda c: _cli("eval", "--model", "gs://bucket/run/checkpoint-6"),
    "H51": lambda c: _cli("eval", "--k", "0"),
    "H52": lambda c: _cli("eval", "--limit", "-2"),
    "H53": lambda c: GRPOConfig(eval_max_new_tokens=0).validate(),
    "H54": lambda c: GRPOConfig(seed=2**70).validate(),
    "H55": lambda c: GRPOConfig(num_threads=-1).validate(),
    "H56": lambda c: GRPOConfig(device="banana").validate(),
    "H57": lambda c: c.trainer(reward_funcs=["no_such_package.rewards:brevity"]),
    "H58": lambda c: c.trainer(dataset=str(c.file("n.jsonl", '{"prompt": 5}\n'))),
    "H59": lambda c: c.trainer(
        dataset=str(c.file("pretty.json", '{\n  "prompt": "a",\n  "answer": "1",\n}\n'))
    ),
    "H60": lambda c: GRPOConfig(run_name="../../x").validate(),
    "H61": lambda c: load_config(
        str(c.file("latin1.yaml", "train:\n  run_name: caf\xe9\n".encode("latin-1")))
    ),
    "H62": lambda c: _write_report_of(c.file("metrics.jsonl", b"\xff\xfe\n[1, 2]\n").parent),
    "H63": lambda c: GRPOConfig(adam_beta1=1.5).validate(),
    "H64": lambda c: GRPOConfig().update({"lora.dropout": 1.5}).validate(),
    "H65": lambda c: c.trainer(model=str(c.model_dir("m", {"config.json": "[]", "model.safetensors": "x"}))),
    "H66": lambda c: c.trainer(
        output_dir=str(_newer_checkpoint(c, config_yaml="model: 5\n")), resume="latest"
    ),
}


def _write_report_of(run: Path):
    from grpo.run.report import write_report

    write_report(run)


def _denied(self):
    raise PermissionError(errno.EACCES, "Permission denied", str(self))


class _Collect(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def message_for(case_id: str, ctx: Ctx) -> str:
    """The error the case raises, or else the first warning it logs."""
    logger, handler = logging.getLogger("grpo"), _Collect()
    logger.addHandler(handler)
    try:
        said = CASES[case_id](ctx)
        if isinstance(said, str):  # a command-line case: the line it printed
            return said
    except (ConfigError, CheckpointError, RewardError) as e:
        return str(e)
    finally:
        logger.removeHandler(handler)
        for held in ctx.held:
            held.release()
    assert handler.messages, f"{case_id} was accepted silently"
    return handler.messages[0]


def test_the_table_and_the_cases_list_the_same_inputs():
    assert sorted(doc_rows()) == sorted(CASES)


@pytest.mark.parametrize("case_id", sorted(CASES))
def test_hostile_input_gets_the_documented_message(case_id, base, tmp_path, monkeypatch):
    message = message_for(case_id, Ctx(base, tmp_path, monkeypatch))
    expected = doc_rows()[case_id]
    assert re.fullmatch(as_regex(expected), message, flags=re.DOTALL), (
        f"{case_id}:\n  got  {message}\n  doc  {expected}"
    )


# -- the same families, where the promise is a behaviour rather than a message ---------------------------
def _release(trainer: GRPOTrainer) -> Path | None:
    trainer.parts.lock.release()
    return trainer.parts.resume_from


def test_resume_with_a_run_directory_means_its_newest_intact_checkpoint(base, tmp_path, monkeypatch):
    c = Ctx(base, tmp_path, monkeypatch)
    run = c.copy_run()
    assert _release(c.trainer(output_dir=str(run), resume=str(run))) == run / "checkpoint-1"


def test_resume_from_a_final_model_with_its_training_state_continues_the_run(base, tmp_path, monkeypatch):
    c = Ctx(base, tmp_path, monkeypatch)
    run = c.copy_run()
    shutil.copy(run / "checkpoint-1" / ckpt.STATE_FILE, run / "final_model" / ckpt.STATE_FILE)
    ckpt.write_manifest(run / "final_model")
    c.trainer(output_dir=str(run), resume=str(run / "final_model")).train()
    assert [m["step"] for m in tiny_run.metrics(run)] == [1, 2]


def test_a_pickle_payload_is_refused_without_advising_weights_only_false(base, tmp_path, monkeypatch):
    message = message_for("H43", Ctx(base, tmp_path, monkeypatch))
    assert "posix.getcwd" in message and "weights_only" not in message


def test_report_reads_logs_with_damaged_lines_and_a_damaged_config(tmp_path):
    from grpo.run.report import write_report

    (tmp_path / "metrics.jsonl").write_bytes(
        b'{"step": 1, "reward": 0.25}\n\xff\xfe\n[3]\n{"step": "x", "reward": 1}\n'
        b'{"step": 2, "reward": 0.5}\n{"step": 3, "rew'
    )  # still being written
    (tmp_path / "samples.jsonl").write_bytes(
        '{"step": 2, "prompt": "p", "completion": "caf\u00e9 ok"}\n'.encode()
        + b'{"step": 2, "completion": "caf\xe9"}\n'
    )
    (tmp_path / "config.yaml").write_text("model: 5\ntrain: [unclosed\n")
    page = write_report(tmp_path).read_text(encoding="utf-8")
    assert "café ok" in page and "steps logged</th><td>1–2" in page


def test_pretty_printed_json_files_load(tmp_path):
    from grpo.config import DataConfig
    from grpo.data import load_rows

    rows = {
        "array.json": '[\n  {"prompt": "a", "answer": "1"},\n  {"prompt": "b", "answer": "2"}\n]\n',
        "object.json": '{\n  "prompt": "a",\n  "answer": "1"\n}\n',
        "wrapped.json": '{\n  "version": 2,\n  "data": [\n    {"prompt": "a", "answer": "1"}\n  ]\n}\n',
    }
    loaded = {
        name: load_rows(str(Ctx(None, tmp_path, None).file(name, text)), DataConfig())
        for name, text in rows.items()
    }
    assert [r["prompt"] for r in loaded["array.json"]] == ["a", "b"]
    assert loaded["object.json"] == [{"prompt": "a", "answer": "1"}] == loaded["wrapped.json"]


def test_a_really_full_disk_keeps_the_previous_checkpoint(tmp_path):
    """A 1 MiB tmpfs: the real torch.save (and safetensors) meet ENOSPC. Needs permission to mount."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mount = ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)]
    if subprocess.run(mount, check=False, capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        save_model_dir(disk / "checkpoint-1", _Model(), _Tok(), "x: 1\n", {"step": 1})
        with pytest.raises(
            CheckpointError,
            match=r"No space left on the device while saving checkpoint-2 .*"
            r"The previous checkpoint checkpoint-1 is intact\.",
        ):
            save_model_dir(
                disk / "checkpoint-2", _Model(), _Tok(), "x: 1\n", {"step": 2, "t": torch.zeros(2**18)}
            )
        assert ckpt.verify_checkpoint(disk / "checkpoint-1") is None
        assert sorted(p.name for p in disk.iterdir()) == ["checkpoint-1"]
    finally:
        subprocess.run(["umount", "--lazy", str(disk)], check=False)


def test_ctrl_c_in_eval_or_report_says_interrupted_not_resume(monkeypatch, capsys):
    def interrupted(args):
        raise KeyboardInterrupt

    for command, argv, name in (
        ("eval", ["eval"], "run_eval"),
        ("report", ["report", "somewhere"], "cmd_report"),
    ):
        monkeypatch.setattr(cli, name, interrupted)
        assert cli.main(argv) == 130
        assert capsys.readouterr().err.strip().splitlines()[-1] == f"grpo {command}: interrupted."
