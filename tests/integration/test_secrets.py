"""A run's directory — and anything printed — never contains the HF token, however it was passed:
--hf_access_token, model.hf_token=, $HF_TOKEN, inside a path that ends up in an error message, in a
sweep; nor other secret-looking environment variables."""

from pathlib import Path

import pytest

from grpo.cli import main as cli
from tests import tiny_run

pytestmark = pytest.mark.slow
TOKENS = {
    "flag": "hf_FLAGSECRET1",
    "key": "hf_KEYSECRET22",
    "env": "hf_ENVSECRET333",
    "sweep": "hf_SWEEPSECRET4",
    "wandb": "wandb_APIKEY5555",
}


def test_no_token_reaches_the_run_directory_or_the_output(tmp_path, monkeypatch, capfd):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_TOKEN", TOKENS["env"])
    monkeypatch.setenv("WANDB_API_KEY", TOKENS["wandb"])
    model = tiny_run.make_model_dir(tmp_path / "model")
    data = tiny_run.write_dataset(tmp_path / "data.jsonl", 4)
    common = [
        "--model",
        str(model),
        "--dataset",
        str(data),
        "--batch-size",
        "2",
        "--num-generations",
        "2",
        "--max-new-tokens",
        "4",
        "--gradient-accumulation-steps",
        "1",
        "--progress-bar",
        "false",
        "--eval-dataset",
        "none",
        "--logging-steps",
        "1",
        "--save-steps",
        "1",
    ]
    out = tmp_path / "run"
    assert (
        cli(["train", *common, "--steps", "1", "--output-dir", str(out), "--hf_access_token", TOKENS["flag"]])
        == 0
    )
    assert (
        cli(
            [
                "train",
                *common,
                "--output-dir",
                str(out),
                "--steps",
                "2",
                "--resume",
                "latest",
                f"model.hf_token={TOKENS['key']}",
            ]
        )
        == 0
    )
    # An error whose message would echo the token (it is part of a path here).
    assert (
        cli(
            [
                "train",
                *common,
                "--steps",
                "1",
                "--output-dir",
                str(tmp_path / "bad"),
                "--hf-access-token",
                TOKENS["flag"],
                "--dataset",
                str(tmp_path / f"{TOKENS['flag']}.jsonl"),
            ]
        )
        == 2
    )
    sweep = [
        "train",
        *common,
        "--steps",
        "1",
        "--multirun",
        "--hf_access_token",
        TOKENS["sweep"],
        "lr=1e-3,2e-3",
    ]
    assert cli(sweep) == 0
    with pytest.raises(SystemExit):  # a usage error echoes the arguments argparse could not place
        cli(["train", f"--no-such-flag={TOKENS['key']}", "--seed", "1", f"hf_token={TOKENS['key']}"])
    printed = capfd.readouterr()
    assert "<redacted>" in printed.err
    files = [p for p in tmp_path.rglob("*") if p.is_file() and p.suffix != ".safetensors"]
    assert (out / "config.yaml") in files and len(list((tmp_path / "multirun").rglob("config.yaml"))) >= 2
    for name, token in TOKENS.items():
        assert token not in printed.out + printed.err, f"the {name} token was printed"
        leaked = [p for p in files if token.encode() in p.read_bytes()]
        assert not leaked, f"the {name} token reached {leaked}"


SPELLINGS = {
    "flag": "hf_FLAGSPELLING01",  # --hf_access_token X
    "equals": "hf_EQUALSSPELL02",  # --hf_access_token=X
    "assignment": "hf_ASSIGNSPELL03",  # model.hf_token=X
    "yaml": "hf_YAMLSPELLING04",  # hf_token: X in a --config file
    "env": "hf_ENVSPELLING05",  # $HF_TOKEN
    "wandb": "wandbKEYSPELL06",  # $WANDB_API_KEY
    "holder": "hf_HOLDERARGV07",  # on the command line of the process holding the run lock
}
HOLDER = (
    "import sys, time\n"
    "from grpo.run.runlock import RunLock\n"
    "lock = RunLock(sys.argv[1]).acquire()\n"
    "print('locked', flush=True)\n"
    "time.sleep(60)\n"
)


def test_an_attacker_finds_no_secret_in_any_byte_of_a_run_a_resume_a_refused_start_or_a_report(
    tmp_path, monkeypatch, capfd
):
    """Issue 24 §2: every spelling of a secret, then every byte written (run directory, lock, logs, report,
    checkpoints, TensorBoard) and everything printed is scanned."""
    import os
    import subprocess
    import sys

    import grpo

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_TOKEN", SPELLINGS["env"])
    monkeypatch.setenv("WANDB_API_KEY", SPELLINGS["wandb"])
    model = tiny_run.make_model_dir(tmp_path / "inputs" / "model")
    data = tiny_run.write_dataset(tmp_path / "inputs" / "data.jsonl", 4)
    config = tmp_path / "inputs" / "secret.yaml"
    config.write_text(f"model:\n  hf_token: {SPELLINGS['yaml']}\n")
    run = tmp_path / "run"
    common = [
        "train", "--model", str(model), "--dataset", str(data), "--output-dir", str(run),
        "--batch-size", "2", "--num-generations", "2", "--max-new-tokens", "4",
        "--gradient-accumulation-steps", "1", "--progress-bar", "false", "--eval-dataset", "none",
        "--logging-steps", "1", "--save-steps", "1", "--tensorboard", "true", "--num-threads", "1",
        "--config", str(config),
    ]  # fmt: skip
    assert (
        cli([*common, "--steps", "1", "--config", str(config), "--hf_access_token", SPELLINGS["flag"]]) == 0
    )
    assert (
        cli([*common, "--steps", "2", "--resume", "latest", f"--hf_access_token={SPELLINGS['equals']}"]) == 0
    )

    env = {**os.environ, "PYTHONPATH": str(Path(grpo.__file__).parents[1])}
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(run), "--hf_access_token", SPELLINGS["holder"]],
        stdout=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "locked"
        refused = [*common, "--steps", "3", "--resume", "latest", f"model.hf_token={SPELLINGS['assignment']}"]
        assert cli(refused) == 2
    finally:
        holder.kill()
        holder.wait()
    assert cli(["report", str(run)]) == 0

    printed = capfd.readouterr()
    assert "in use by another grpo run" in printed.err and "<redacted>" in printed.err
    written = [
        p for p in tmp_path.rglob("*") if p.is_file() and "inputs" not in p.relative_to(tmp_path).parts
    ]
    assert {"run.lock", "train.log", "config.yaml", "metrics.jsonl", "samples.jsonl"} <= {
        p.name for p in written
    }
    assert any(p.parent.name == "tensorboard" for p in written) and (run / "report" / "index.html") in written
    for name, secret in SPELLINGS.items():
        assert secret not in printed.out + printed.err, f"the {name} secret was printed"
        leaked = [str(p) for p in written if secret.encode() in p.read_bytes()]
        assert not leaked, f"the {name} secret reached {leaked}"
