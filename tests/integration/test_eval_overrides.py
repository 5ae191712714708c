"""`grpo eval` takes the key=value overrides `grpo train` takes (issue 31), in any place on the line."""

import json

from transformers import AutoTokenizer

from grpo.cli import main
from grpo.model.loading import bundled_model_path


def test_grpo_eval_applies_key_value_overrides_like_grpo_train(tmp_path, capsys):
    dump = tmp_path / "dump.jsonl"
    argv = ["eval", "--limit", "2", "train.eval_max_new_tokens=2", "--json", "--dump", str(dump)]
    assert main([*argv, "data.eval_dataset=tiny_math:test"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["n"] == 2 and out["dataset"] == "tiny_math:test"
    tokenizer = AutoTokenizer.from_pretrained(bundled_model_path())
    completions = [c for line in dump.read_text().splitlines() for c in json.loads(line)["completions"]]
    # the override's cap of 2 tokens, not the preset's (the default cap writes whole solutions)
    lengths = [len(tokenizer(c, add_special_tokens=False).input_ids) for c in completions]
    assert lengths and max(lengths) <= 2


def test_a_bad_override_to_grpo_eval_is_one_line_with_a_suggestion(capsys):
    assert main(["eval", "train.eval_max_new_tokenz=2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("grpo eval: error: Unknown config key 'train.eval_max_new_tokenz'. Did you")
    assert main(["eval", "--limit", "2", "nonsense"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "grpo eval: error: 'nonsense' is not key=value (e.g. generation.max_new_tokens=64)."
    )
