"""A run's directory — and anything printed — never contains the HF token, however it was passed:
--hf_access_token, model.hf_token=, $HF_TOKEN, inside a path that ends up in an error message, in a
sweep; nor other secret-looking environment variables."""

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
        "--steps",
        "1",
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
    assert cli(["train", *common, "--output-dir", str(out), "--hf_access_token", TOKENS["flag"]]) == 0
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
    assert cli(["train", *common, "--multirun", "--hf_access_token", TOKENS["sweep"], "lr=1e-3,2e-3"]) == 0
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
