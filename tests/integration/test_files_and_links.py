"""Issue 24, §1 and §3: nothing a user owns is destroyed, nothing is written through a planted symbolic link,
and what grpo reads back (its own logs, a vLLM server's reply) is not trusted. Plus the §7 items on the run
lock, dataset columns named like the trainer's values, and a reward that calls os.chdir.

Each test fails on 091d311 (before grpo/files.py) and passes now; docs/reliability.md lists them."""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import pytest
from safetensors.torch import load_file

from grpo import GRPOConfig, GRPOTrainer, SimplePromptDataset
from grpo.cli import main as cli
from grpo.config import ConfigError
from grpo.run.runlock import LOCK_FILE, RunLock
from tests import tiny_run

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("inputs")
    return tiny_run.make_model_dir(root / "model"), tiny_run.write_dataset(root / "data.jsonl", 4)


@pytest.fixture(scope="module")
def trained(inputs, tmp_path_factory):
    """A finished 2-step run (checkpoints, final_model, logs, report) and its trainer."""
    model, data = inputs
    run = tmp_path_factory.mktemp("trained") / "run"
    settings = tiny_run.config(model, data, run, steps=2, tensorboard=True, log_samples=2, report=True)
    cfg = GRPOConfig(**settings)
    trainer = GRPOTrainer(config=cfg)
    trainer.train()
    return trainer, run


def _listing(directory: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()
    }


def _cli_args(model: Path, data: Path, out: Path, *extra: str) -> list[str]:
    return [
        "train", "--model", str(model), "--dataset", str(data), "--output-dir", str(out), "--steps", "1",
        "--batch-size", "2", "--num-generations", "2", "--max-new-tokens", "4",
        "--gradient-accumulation-steps", "1", "--progress-bar", "false", "--eval-dataset", "none",
        "--num-threads", "1", *extra,
    ]  # fmt: skip


# -- §1 data the user owns ------------------------------------------------------------------------
def test_save_model_into_the_run_directory_or_a_users_folder_deletes_nothing(trained, tmp_path):
    trainer, run = trained
    before = _listing(run)
    trainer.save_model(run)  # TRL's everyday trainer.save_model(training_args.output_dir)
    after = _listing(run)
    kept = [name for name in before if name not in {"model.safetensors", "config.json"}]
    assert all(after.get(name) == before[name] for name in kept if not name.startswith("tokenizer"))
    for name in ("metrics.jsonl", "train.log", "checkpoint-2/manifest.json", "final_model/model.safetensors"):
        assert after[name] == before[name], name
    assert load_file(str(run / "model.safetensors")).keys() == tiny_run.weights(run / "final_model").keys()
    assert (run / "report" / "index.html").is_file() and any((run / "tensorboard").iterdir())

    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "notes.txt").write_text("my notes\n")
    (folder / "config.yaml").write_text("# my own config\nsteps: 3\n")
    trainer.save_model(folder)
    assert (folder / "notes.txt").read_text() == "my notes\n"
    assert (folder / "config.yaml").read_text() == "# my own config\nsteps: 3\n"
    assert tiny_run.same_weights(folder, run / "final_model")
    assert not list(folder.glob(".grpo-save-*"))


def test_a_config_file_in_the_output_directory_is_never_replaced(inputs, tmp_path, monkeypatch, capfd):
    model, data = inputs
    monkeypatch.chdir(tmp_path)
    mine = "# hand-written, comments and all\nmodel:\n  name_or_path: tiny-math-lm\n"
    (tmp_path / "config.yaml").write_text(mine)
    assert cli([*_cli_args(model, data, Path(".")), "--config", "config.yaml"]) == 2
    err = capfd.readouterr().err
    assert "config.yaml is not a config grpo wrote" in err and "another --output-dir" in err
    assert (tmp_path / "config.yaml").read_text() == mine


def test_a_start_in_a_users_folder_never_replaces_their_report_or_model(inputs, tmp_path, capfd):
    model, data = inputs
    (tmp_path / "report").mkdir()
    (tmp_path / "report" / "index.html").write_text("<h1>my site</h1>\n")
    (tmp_path / "final_model").mkdir()
    assert cli(_cli_args(model, data, tmp_path)) == 2
    assert "holds report, final_model, which grpo did not write" in capfd.readouterr().err
    assert (tmp_path / "report" / "index.html").read_text() == "<h1>my site</h1>\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final_model", "report"]  # refused before the lock


def test_write_model_dir_never_overwrites_an_existing_checkpoint(trained):
    from grpo.rollout.vllm import write_model_dir

    trainer, run = trained
    before = _listing(run / "final_model")
    with pytest.raises(ConfigError, match="already holds files that grpo did not write for vLLM"):
        write_model_dir(trainer.model, trainer.tokenizer, run / "final_model")
    assert _listing(run / "final_model") == before


def test_resume_cuts_a_killed_process_rows_from_samples_and_metrics(inputs, tmp_path):
    model, data = inputs
    run = tmp_path / "run"
    settings = tiny_run.config(model, data, run, steps=2, log_samples=2, report=False)
    GRPOTrainer(config=GRPOConfig(**settings)).train()
    # As if killed after logging step 2 but before its checkpoint: only checkpoint-1 survives.
    import shutil

    shutil.rmtree(run / "checkpoint-2")
    shutil.rmtree(run / "final_model")
    GRPOTrainer(config=GRPOConfig(**{**settings, "resume": "latest"})).train()
    steps = [json.loads(line)["step"] for line in (run / "samples.jsonl").read_text().splitlines()]
    assert steps == [1, 1, 2, 2]
    assert [m["step"] for m in tiny_run.metrics(run) if "reward" in m] == [1, 2]


# -- §3 links and what is read back ---------------------------------------------------------------
@pytest.mark.parametrize("planted", ["run.lock", "config.yaml", "train.log", "metrics.jsonl"])
def test_a_planted_link_is_refused_and_its_target_untouched(inputs, tmp_path, planted, capfd):
    model, data = inputs
    run, victim = tmp_path / "run", tmp_path / "victim.txt"
    run.mkdir()
    victim.write_text("precious\n")
    if planted != LOCK_FILE:
        (run / LOCK_FILE).write_text("")  # a run directory received from someone else
    (run / planted).symlink_to(victim)
    assert cli(_cli_args(model, data, run)) == 2
    assert f"{run / planted} is a symbolic link" in capfd.readouterr().err
    assert victim.read_text() == "precious\n"


def test_report_refuses_a_planted_link(trained, tmp_path, capfd):
    _, run = trained
    victim = tmp_path / "victim.html"
    victim.write_text("precious\n")
    page = run / "report" / "index.html"
    page.unlink()
    page.symlink_to(victim)
    assert cli(["report", str(run)]) == 2
    assert "is a symbolic link" in capfd.readouterr().err and victim.read_text() == "precious\n"
    page.unlink()


def test_report_escapes_every_field_of_a_tampered_samples_log(trained):
    _, run = trained
    page = run / "report" / "index.html"
    tampered = {
        "step": "<script>alert(1)</script>",
        "length": "<img src=x onerror=alert(2)>",
        "rewards": {"<b>f</b>": "<i>1</i>"},
        "prompt": "p",
        "completion": "c",
        "reward": "<u>r</u>",
        "advantage": [1],
    }
    with open(run / "samples.jsonl", "a") as fh:
        fh.write(json.dumps(tampered) + "\n")
    assert cli(["report", str(run)]) == 0
    html = page.read_text()
    for raw in ("<script>", "<img src=x", "<b>f</b>", "<i>1</i>", "<u>r</u>"):
        assert raw not in html, raw
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html


class _FakeVLLM(BaseHTTPRequestHandler):
    """A vLLM OpenAI server that answers with a reply set by the test."""

    root: str = ""
    reply: ClassVar[dict] = {}

    def _send(self, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self._send({"data": [{"id": "m", "root": self.root}]})

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self._send(self.reply)

    def log_message(self, *args):
        pass


def _choice(index: int, tokens: int, logprobs: int) -> dict:
    return {
        "index": index,
        "finish_reason": "length",
        "logprobs": {
            "tokens": [f"token_id:{5 + i}" for i in range(tokens)],
            "token_logprobs": [-0.5] * logprobs,
        },
    }


@pytest.mark.parametrize(
    ("choices", "why"),
    [
        ([_choice(0, 3, 3), _choice(1, 3, 2)], "choice 1 has 3 tokens but 2 log-probs"),
        ([_choice(0, 3, 3), _choice(1, 3, 3), _choice(2, 3, 3)], "3 choices for n = 2"),
    ],
)
def test_a_vllm_server_reply_off_by_one_is_refused(trained, tmp_path, choices, why):
    from grpo.records import SamplingParams
    from grpo.rollout.vllm import VLLMServerEngine, write_model_dir

    trainer, _ = trained
    served = write_model_dir(trainer.model, trainer.tokenizer, tmp_path / "served")
    handler = type("Handler", (_FakeVLLM,), {"root": str(served), "reply": {"choices": choices}})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        engine = VLLMServerEngine(f"http://127.0.0.1:{server.server_port}", trainer.model, trainer.tokenizer)
        with pytest.raises(ConfigError, match=why):
            engine.generate([[3, 4]], 2, SamplingParams(max_new_tokens=4))
        engine.close()
    finally:
        server.shutdown()


# -- §7 the run lock, dataset columns, os.chdir ---------------------------------------------------
def _helper(started) -> None:
    started.set()
    time.sleep(60)


def test_a_forked_child_of_user_code_does_not_keep_the_run_lock(tmp_path):
    lock = RunLock(tmp_path).acquire()
    fork = multiprocessing.get_context("fork")
    started = fork.Event()
    child = fork.Process(target=_helper, args=(started,), daemon=True)
    child.start()  # as a reward's verifier helper would be
    try:
        assert started.wait(30)
        lock.release()  # the run ends; its child lives on
        RunLock(tmp_path).acquire().release()  # the next run starts
    finally:
        child.kill()
        child.join()


HOLDER = (
    "import fcntl, sys, time\n"
    "f = open(sys.argv[1], 'a')\n"
    "fcntl.flock(f, fcntl.LOCK_EX)\n"
    "print('locked', flush=True)\n"
    "time.sleep(60)\n"
)


def test_a_refusal_names_the_live_holder_not_a_dead_pid(tmp_path):
    dead = {"pid": 2**22 + 17, "host": os.uname().nodename, "command": "x", "started": "then"}
    (tmp_path / LOCK_FILE).write_text(json.dumps(dead) + "\n")  # the run that took it is gone
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(tmp_path / LOCK_FILE)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(ConfigError) as refused:
            RunLock(tmp_path).acquire()
        message = str(refused.value)
        assert f"held by pid {holder.pid}" in message and f"kill {holder.pid}" in message
        assert f"kill {2**22 + 17}" not in message
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.parametrize("column", ["completion_ids", "completion_truncated"])
def test_a_dataset_column_named_like_a_trainer_value_is_refused(inputs, tmp_path, column):
    model, data = inputs
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    dataset = SimplePromptDataset(
        [r["question"] for r in rows], answer=[r["answer"] for r in rows], **{column: [[7]] * len(rows)}
    )
    cfg = GRPOConfig(**tiny_run.config(model, data, tmp_path / "run", steps=1))
    with pytest.raises(ConfigError, match=f"has a column named '{column}'.*Rename the column"):
        GRPOTrainer(config=cfg, train_dataset=dataset)


def wandering_reward(prompts, completions, **_):
    os.chdir(os.environ["GRPO_TEST_ELSEWHERE"])
    return tiny_run.letter_score(prompts, completions)


def test_a_reward_calling_chdir_does_not_stop_the_run(inputs, tmp_path, monkeypatch):
    model, data = inputs
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.setenv("GRPO_TEST_ELSEWHERE", str(tmp_path / "elsewhere"))
    monkeypatch.chdir(tmp_path)
    cfg = GRPOConfig(**tiny_run.config(model, data, Path("run"), steps=2, report=False))
    GRPOTrainer(config=cfg, reward_funcs=[wandering_reward]).train()
    assert [m["step"] for m in tiny_run.metrics(tmp_path / "run") if "reward" in m] == [1, 2]
    assert (tmp_path / "run" / "final_model" / "model.safetensors").is_file()
    assert not (tmp_path / "elsewhere" / "run").exists()
