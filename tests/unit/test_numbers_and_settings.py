"""Issue 24, checked without a model: numbers range-checked where they enter (rewards, weighted sums,
config values), one value per setting, YAML read with limits, and user reward code that can be stopped.
Each test fails on 091d311."""

import http.server
import os
import threading
import time

import pytest

from grpo import cli
from grpo.config import ConfigError, GRPOConfig, load_config
from grpo.ranges import REWARD_LIMIT, OutOfRangeError, check_range
from grpo.rewards import RewardError
from grpo.rewards.scoring import RewardTimeoutError, score_completions

PROMPTS, COMPLETIONS = ["p0", "p1"], ["c0", "c1"]


def returning(values):
    def reward(prompts, completions, **_):
        return values

    return reward


def score(fn, **kwargs):
    return score_completions([fn], None, PROMPTS, COMPLETIONS, {}, **kwargs)


# -- §4 numbers ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("huge", [1e20, 3e38, 10**400, -2e9])
def test_a_reward_outside_the_range_where_the_math_holds_stops_naming_function_sample_and_value(huge):
    # On 091d311 1e20 and 3e38 gave loss 0 and grad 0 silently (their squares overflow float32), and
    # 10**400 raised a raw OverflowError.
    with pytest.raises(RewardError, match=r"'reward' returned .* for sample 1, outside ±1e\+09"):
        score(returning([0.0, huge]))


def test_an_out_of_range_reward_is_scored_as_missing_under_skip():
    scores = score(returning([0.5, 1e20]), on_error="skip")
    assert scores.per_function[0, 0].item() == 0.5 and scores.per_function[1, 0].isnan()
    assert scores.skipped == 1


@pytest.mark.parametrize(
    ("returned", "message"),
    [
        (["1.0", "2.0"], r"returned '1.0' \(str\) for sample 0; expected a float, int, bool or None"),
        ([1.0], r"returned 1 rewards for 2 completions"),
        ((x for x in [1.0, 2.0]), r"returned a generator; expected a list"),
    ],
)
def test_a_reward_breaking_the_contract_is_a_reward_error_not_a_traceback(returned, message):
    # 091d311: TypeError / ValueError, which the CLI printed as a raw traceback.
    with pytest.raises(RewardError, match=message):
        score(returning(returned))


def test_the_weighted_total_is_range_checked_too():
    def ten(prompts, completions, **_):
        return [10.0, 10.0]

    with pytest.raises(RewardError, match=r"weighted reward total 1e\+10 of sample 0"):
        score_completions([ten], [1e9], PROMPTS, COMPLETIONS, {})


def test_check_range_names_the_value_and_the_interval():
    assert check_range(0.5, "x", 0, 1) == 0.5
    with pytest.raises(OutOfRangeError, match=r"x = 2 is outside \(0, 1\]"):
        check_range(2, "x", 0, 1, low_open=True)
    with pytest.raises(OutOfRangeError, match="an integer of 1329 bits"):
        check_range(10**400, "x")
    with pytest.raises(OutOfRangeError, match=r"must be a number, got 'a' \(str\)"):
        check_range("a", "x")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"learning_rate": 5.0}, r"optim.learning_rate = 5.0 is outside \(0, 1\]"),
        ({"reward_weights": [1e30]}, r"algorithm.reward_weights = 1e\+30 is outside"),
        ({"reward_timeout": 1e30}, r"algorithm.reward_timeout = 1e\+30 is outside"),
        ({"steps": 10**30}, r"train.steps = 10{30} is outside"),
    ],
)
def test_config_numbers_pass_the_same_range_check(overrides, message):
    with pytest.raises(ConfigError, match=message):
        GRPOConfig(**overrides).validate()
    assert REWARD_LIMIT == 1e9


# -- §6 one setting, one value -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "optim.learning_rate: 0.1\noptim:\n  learning_rate: 0.2\n",
            r"optim.learning_rate is set twice in config file .*: as 'optim.learning_rate' and as "
            r"'optim:' > 'learning_rate'",
        ),
        (
            "kl_coef: 0.1\nalgorithm:\n  beta: 0.3\n",
            r"algorithm.beta is set twice in config file .*: by 'kl_coef' and by 'algorithm.beta'",
        ),
    ],
)
def test_one_setting_written_twice_in_one_yaml_is_an_error_naming_both(tmp_path, text, message):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_config(str(path))


def test_the_command_line_sets_a_setting_once_whatever_the_spelling(capsys):
    # 091d311: optimizer.lr=5e-3 silently beat --learning-rate 1e-4, in either order.
    assert cli.main(["train", "--learning-rate", "1e-4", "optimizer.lr=5e-3", "--print-config"]) == 2
    err = capsys.readouterr().err
    assert (
        "optim.learning_rate is set twice in the command line: by '--learning-rate' and by 'optimizer.lr'"
        in err
    )
    assert GRPOConfig(kl_coef=0.1).algorithm.beta == 0.1
    with pytest.raises(ConfigError, match=r"algorithm\.beta is set twice in the keyword arguments"):
        GRPOConfig(kl_coef=0.1, algorithm={"beta": 0.2})


def test_a_key_for_one_field_refines_an_alias_for_several_and_origins_are_recorded():
    cfg = load_config(None, [("epsilon", "0.2"), ("epsilon_high", "0.28")], origin="the command line")
    assert (cfg.algorithm.epsilon_low, cfg.algorithm.epsilon_high) == (0.2, 0.28)
    assert cfg.origin_of("algorithm.epsilon_high") == "the command line (epsilon_high)"
    assert cfg.origin_of("optim.learning_rate") == "default"
    assert load_config("tiny_math").origin_of("train.steps") == "preset tiny_math"


def test_an_alias_bomb_is_refused_quickly_with_a_short_message(tmp_path):
    lines = ['a: &a ["x","x","x","x","x","x","x","x","x"]']
    lines += [f"{c}: &{c} [{','.join([f'*{p}'] * 9)}]" for p, c in zip("abcdefgh", "bcdefghi", strict=True)]
    path = tmp_path / "bomb.yaml"
    path.write_text("\n".join(lines) + "\n")  # under 700 bytes; 9^9 = 387M strings expanded
    start = time.perf_counter()
    with pytest.raises(ConfigError, match="expands to more than 100,000 YAML values") as raised:
        load_config(str(path))
    assert time.perf_counter() - start < 5 and len(str(raised.value)) < 400


def test_yaml_nested_5000_deep_is_a_config_error_in_a_file_and_in_a_value(tmp_path):
    path = tmp_path / "deep.yaml"
    path.write_text("x: " + "[" * 5000 + "]" * 5000 + "\n")
    with pytest.raises(ConfigError, match="nests deeper than YAML can be read here"):
        load_config(str(path))
    with pytest.raises(ConfigError, match=r"The value of algorithm\.reward_funcs nests"):
        load_config(None, {"reward_funcs": "[" * 5000 + "]" * 5000})


# -- §7 user code ---------------------------------------------------------------------------------------


def catastrophic_regex(prompts, completions, **_):
    import re

    re.match(r"(a+)+$", "a" * 64 + "b")  # ~2^64 steps inside C, holding the GIL
    return [1.0] * len(completions)


def test_a_reward_stuck_in_c_holding_the_gil_is_killed_at_its_time_limit():
    # 091d311 ran it on a thread, which cannot be stopped: the call outlived the limit for good.
    start = time.perf_counter()
    with pytest.raises(RewardTimeoutError, match=r"no result after 1 s \(its process was killed\)"):
        score(catastrophic_regex, timeout=1.0, isolation="process")
    assert time.perf_counter() - start < 10  # batch + one per-sample retry, 1 s each, plus forks


def test_a_reward_process_keeps_closures_and_sends_log_metric_back():
    seen = {"threshold": 0.5}

    def closure(prompts, completions, log_metric, **_):
        log_metric("calls", 1)
        return [seen["threshold"]] * len(completions)

    scores = score(closure, isolation="process")
    assert scores.per_function[:, 0].tolist() == [0.5, 0.5] and scores.logged == {"calls": 1.0}


def test_auto_isolation_forks_for_rewards_named_by_path_and_keeps_python_objects_in_process(
    tmp_path, monkeypatch
):
    (tmp_path / "counting_reward.py").write_text(
        "import os\nPIDS = []\ndef pid(prompts, completions, **_):\n"
        "    PIDS.append(os.getpid())\n    return [float(os.getpid())] * len(completions)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    from grpo.rewards import resolve_reward

    by_path = resolve_reward("counting_reward:pid")
    named = score(by_path, isolation="auto").per_function[0, 0].item()
    assert named != os.getpid() and by_path.__module__ == "counting_reward"
    assert __import__("counting_reward").PIDS == []  # the child's list, not ours, was appended to

    calls = []

    def handed_over(prompts, completions, **_):
        calls.append(1)
        return [0.0] * len(completions)

    score(handed_over, isolation="auto")
    assert calls == [1]  # called in this process: its state is the caller's


def test_a_reward_process_that_dies_is_a_reward_error():
    def exits_hard(prompts, completions, **_):
        import os

        os._exit(3)

    with pytest.raises(RewardError, match="its process exited with code 3 before it returned"):
        score(exits_hard, isolation="process")


def test_a_non_json_reply_from_a_vllm_server_is_one_line():
    class HTML(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = b"<html><body>502 Bad Gateway</body></html>"
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), HTML)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        from grpo.rollout.vllm import VLLMServerEngine

        class Tok:
            pad_token_id = 0

        url = f"http://127.0.0.1:{server.server_port}"
        with pytest.raises(ConfigError, match=r"answered /v1/models with text that is not JSON: '<html>"):
            VLLMServerEngine(url, None, Tok(), timeout=5)
    finally:
        server.shutdown()


# -- §8 install ---------------------------------------------------------------------------------------


def test_transformers_broken_by_vllm_cpus_torchvision_prints_the_fix(monkeypatch, capsys):
    import importlib

    real = importlib.import_module

    def broken_torchvision(name, *args, **kwargs):
        if name == "torchvision":
            raise OSError("libcudart.so.13: cannot open shared object file")
        if name in ("torchaudio", "torchcodec"):
            raise ModuleNotFoundError(name)
        return real(name, *args, **kwargs)

    def train(args):
        raise ModuleNotFoundError(
            "Could not import module 'LlamaConfig'. Are this object's requirements defined correctly?"
        )

    monkeypatch.setattr(importlib, "import_module", broken_torchvision)
    monkeypatch.setattr(cli, "cmd_train", train)
    assert cli.main(["train"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0]
    assert err[0].startswith("grpo train: error: transformers cannot load its models")
    assert err[0].endswith("Fix: pip uninstall -y torchvision   (README, 'vLLM').")


# -- §5 sizes, by hand ----------------------------------------------------------------------------------


def test_step_bytes_counts_records_and_one_generation_batch():
    from types import SimpleNamespace

    from grpo.config.settings import RunSettings
    from grpo.run.sizes import BYTES_PER_POSITION, check_memory, step_bytes

    model = SimpleNamespace(
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=32, vocab_size=100
    )
    cfg = GRPOConfig(
        batch_size=2, num_generations=2, max_new_tokens=8, max_prompt_length=8, max_total_length=None
    )
    records, generation = step_bytes(RunSettings.resolve(cfg, {}, False), model, dtype_bytes=4)
    assert records == 4 * 16 * BYTES_PER_POSITION  # 4 completions × 16 positions
    assert generation == 4 * 16 * 2 * 2 * 2 * 8 * 4 + 4 * 100 * 4  # KV: layers × (k, v) × kv heads × head_dim
    huge = GRPOConfig(batch_size=10**7, num_generations=8, max_new_tokens=8, max_prompt_length=8)
    with pytest.raises(ConfigError, match=r"GiB is free on the host and 1\.0 GiB on the GPU"):
        check_memory(RunSettings.resolve(huge, {}, False), model, 4, device_memory=1 << 30)


def test_eval_flags_are_range_checked_too(capsys):
    # 091d311 accepted --k 100000000000 and went on to allocate for it.
    assert cli.main(["eval", "--k", "100000000000"]) == 2
    assert capsys.readouterr().err.strip() == "grpo eval: error: --k = 100000000000 is outside [1, 10000]."
