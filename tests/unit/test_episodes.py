"""Multi-turn episodes on a real chat template (Qwen2.5's) with a scripted policy: token exactness, the loss
mask, tool failures as messages, caps, concurrency, and the three environment forms."""

from __future__ import annotations

import json
import random
import time

import pytest
import torch

from grpo.agents import ChatRenderer, HermesParser
from grpo.agents.factory import EnvironmentFactory
from grpo.config import DataConfig
from grpo.data import PromptFormatter
from grpo.records import PromptBatch, Rollouts, SamplingParams
from grpo.rollout.episodes import SingleTurn, answer_texts
from grpo.rollout.multi_turn import EpisodeLimits, MultiTurn
from tests.chat_templates import family_tokenizer

SAMPLING = SamplingParams(max_new_tokens=200)


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: The expression, e.g. 12 * 34.
    """
    return str(eval(expression, {"__builtins__": {}}))


def call_text(name: str, arguments: dict) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


class ScriptedEngine:
    """Each turn's text is `script(conversation so far as text)`; it samples that text then the eos token
    (or stops at max_new_tokens, truncated). Log-prob of every sampled token: -0.25."""

    def __init__(self, tokenizer, script, eos: str = "<|im_end|>"):
        self.tokenizer, self.script = tokenizer, script
        self.eos = tokenizer.convert_tokens_to_ids(eos)
        self.calls: list[int] = []  # rows per call

    def generate(self, prompt_ids, n, sampling, chunk_prompts=None):
        return self.continue_rows([ids for ids in prompt_ids for _ in range(n)], sampling)

    def continue_rows(self, rows, sampling):
        self.calls.append(len(rows))
        outs = []
        for ids in rows:
            text = self.script(self.tokenizer.decode(ids))
            new = [*self.tokenizer(text, add_special_tokens=False)["input_ids"], self.eos]
            outs.append(new[: sampling.max_new_tokens])
        width = max(len(o) for o in outs)
        ids = torch.zeros(len(outs), width, dtype=torch.long)
        mask = torch.zeros(len(outs), width)
        for r, o in enumerate(outs):
            ids[r, : len(o)], mask[r, : len(o)] = torch.tensor(o), 1.0
        return Rollouts(
            group_ids=torch.arange(len(outs)),
            completion_ids=ids,
            completion_mask=mask,
            sampling_logprobs=-0.25 * mask,
            truncated=torch.tensor([o[-1] != self.eos for o in outs]),
        )


def runner(
    tokenizer, tools=None, environment=None, max_turns=4, max_tokens=2000, turn_tokens=200, parser=None, **kw
):
    factory = EnvironmentFactory(tools, environment)
    formatter = PromptFormatter(tokenizer, DataConfig(max_prompt_length=4096))
    limits = EpisodeLimits(max_turns, max_tokens, turn_tokens)
    return MultiTurn(factory, formatter, parser or HermesParser(), limits, **kw)


def batch(questions: list[str], **columns) -> PromptBatch:
    return PromptBatch(prompts=list(questions), prompt_token_ids=[[] for _ in questions], columns=columns,
                       indices=list(range(len(questions))))  # fmt: skip


def calls_then_answers(text: str) -> str:
    if "<tool_response>" not in text:
        return call_text("calculator", {"expression": "12*34"})
    return "The answer is 408."


@pytest.fixture(scope="module")
def qwen():
    return family_tokenizer("qwen2.5")


def test_an_episode_is_the_chat_templates_rendering_of_its_conversation_token_for_token(qwen):
    run = runner(qwen, tools=[calculator])
    engine = ScriptedEngine(qwen, calls_then_answers)
    prompts, r = run.run(engine, batch(["What is 12 * 34?"]), 2, SAMPLING)
    episode = r.episodes[0]
    assert [m["role"] for m in episode.messages] == ["assistant", "tool", "assistant"]
    assert episode.messages[1]["content"] == "408" and episode.ended_by == "answer" and episode.turns == 2
    assert episode.tool_calls == 1 and not r.truncated.any()
    chat = ChatRenderer(qwen, run.factory.schemas({}))
    n = int(r.completion_mask[0].sum())
    full = prompts.prompt_token_ids[0] + r.completion_ids[0, :n].tolist()
    conversation = [*prompts.prompts[0], *episode.messages]
    rendered = chat.encode(chat.render(conversation, add_generation_prompt=False))
    assert full == rendered[: len(full)] and len(rendered) - len(full) == len(chat.encode(chat.turn_tail))
    # The loss mask is exactly the sampled turns: the call and the answer, each with its eos.
    sampled = r.completion_ids[0][r.loss_mask[0].bool()].tolist()
    turn1 = qwen(call_text("calculator", {"expression": "12*34"}), add_special_tokens=False)["input_ids"]
    turn2 = qwen("The answer is 408.", add_special_tokens=False)["input_ids"]
    assert sampled == [*turn1, engine.eos, *turn2, engine.eos]
    assert (r.sampling_logprobs[0][r.loss_mask[0] == 0] == 0).all()  # injected: no sampler log-probs
    assert qwen.decode(r.completion_ids[0][(r.completion_mask[0] - r.loss_mask[0]).bool()]).startswith(
        "\n<|im_start|>user\n<tool_response>\n408\n</tool_response>"
    )
    assert engine.calls == [2, 2]  # each turn: one batched call over every live episode
    assert answer_texts(r, qwen) == ["The answer is 408."] * 2


def slow(seconds: float) -> str:
    """Sleep, then say done.

    Args:
        seconds: How long to sleep.
    """
    time.sleep(seconds)
    return "done"


def boom(x: int) -> str:
    """Always fails.

    Args:
        x: Anything.
    """
    raise RuntimeError(f"no luck with {x}")


def huge() -> str:
    """Returns a lot of text."""
    return "y" * 5_000_000


@pytest.mark.parametrize(
    ("turn", "error", "says"),
    [
        ("<tool_call>\n{not json}\n</tool_call>", "malformed", "JSON"),
        (call_text("weather", {"city": "Paris"}), "unknown_tool", "calculator"),
        (call_text("calculator", {"expr": "1+1"}), "bad_arguments", "expression"),
        (call_text("boom", {"x": 3}), "raised", "no luck with 3"),
        (call_text("slow", {"seconds": 5}), "timeout", "did not finish within 0.5 s"),
        (call_text("huge", {}), None, "truncated"),
    ],
)
def test_a_failing_tool_call_is_a_message_to_the_model_and_the_episode_goes_on(qwen, turn, error, says):
    run = runner(qwen, tools=[calculator, slow, boom, huge], tool_timeout_s=0.5, tool_max_chars=200)
    script = lambda text: turn if "<tool_response>" not in text else "Sorry."  # noqa: E731
    start = time.perf_counter()
    _, r = run.run(ScriptedEngine(qwen, script), batch(["q"]), 1, SAMPLING)
    assert time.perf_counter() - start < 4  # the 5 s tool was abandoned at its 0.5 s limit
    episode = r.episodes[0]
    tool = episode.messages[1]
    assert tool["role"] == "tool" and says in tool["content"]
    assert len(tool["content"]) < 400
    assert episode.ended_by == "answer" and episode.turns == 2  # it read the message and answered
    assert episode.tool_errors == ({error: 1} if error else {})


def test_turn_and_token_caps_end_episodes_as_truncated(qwen):
    always_call = lambda text: call_text("calculator", {"expression": "1+1"})  # noqa: E731
    _, r = runner(qwen, tools=[calculator], max_turns=3).run(
        ScriptedEngine(qwen, always_call), batch(["q"]), 1, SAMPLING
    )
    assert r.episodes[0].ended_by == "max_turns" and r.episodes[0].turns == 3 and bool(r.truncated[0])
    _, r = runner(qwen, tools=[calculator], max_tokens=45).run(
        ScriptedEngine(qwen, always_call), batch(["q"]), 1, SAMPLING
    )
    assert r.episodes[0].ended_by == "max_tokens" and bool(r.truncated[0])
    assert r.completion_mask.sum() <= 45
    long_turn = lambda text: "word " * 100  # noqa: E731
    _, r = runner(qwen, tools=[calculator], turn_tokens=10).run(
        ScriptedEngine(qwen, long_turn), batch(["q"]), 1, SamplingParams(max_new_tokens=10)
    )
    assert r.episodes[0].ended_by == "turn_length" and r.lengths.tolist() == [10]


def test_tools_of_all_episodes_run_at_once(qwen):
    script = lambda text: call_text("slow", {"seconds": 0.4}) if "<tool_response>" not in text else "ok"  # noqa: E731
    start = time.perf_counter()
    _, r = runner(qwen, tools=[slow]).run(ScriptedEngine(qwen, script), batch(["a", "b"]), 4, SAMPLING)
    assert time.perf_counter() - start < 8 * 0.4 / 2  # 8 episodes' calls overlap
    assert all(e.messages[1]["content"] == "done" for e in r.episodes)


class Counter:
    """TRL's environment_factory form: reset(**row), public methods are tools, get_reward() scores."""

    made = 0

    def __init__(self):
        Counter.made += 1

    def reset(self, **row):
        assert row["prompt"] == "Count."  # TRL passes the whole row, prompt included
        self.target, self.total = int(row["target"]), 0
        return f" Reach {self.target}."

    def add(self, amount: int) -> str:
        """Add to the running total.

        Args:
            amount: How much to add.
        """
        self.total += amount
        return str(self.total)

    def get_reward(self) -> float:
        return 1.0 if self.total == self.target else 0.0


def test_a_trl_environment_class_runs_unchanged(qwen):
    script = lambda text: call_text("add", {"amount": 5}) if "<tool_response>" not in text else "Done."  # noqa: E731
    prompts, r = runner(qwen, environment=Counter).run(
        ScriptedEngine(qwen, script), batch(["Count.", "Count."], target=[5, 7]), 2, SAMPLING
    )
    assert prompts.prompts[0][-1]["content"] == "Count. Reach 5."  # reset's text joins the prompt
    assert "Reach 7" in qwen.decode(prompts.prompt_token_ids[1])
    assert [e.env_reward for e in r.episodes] == [1.0, 1.0, 0.0, 0.0]
    assert all(isinstance(e.environment, Counter) for e in r.episodes)
    assert len({id(e.environment) for e in r.episodes}) == 4  # one instance per episode
    # TRL 1.16: construct once, reset often; the next step reuses the 4 instances.
    run = runner(qwen, environment=Counter)
    run.run(ScriptedEngine(qwen, script), batch(["Count.", "Count."], target=[5, 7]), 2, SAMPLING)
    made = Counter.made
    _, again = run.run(ScriptedEngine(qwen, script), batch(["Count.", "Count."], target=[7, 5]), 2, SAMPLING)
    assert Counter.made == made and [e.env_reward for e in again.episodes] == [0.0, 0.0, 1.0, 1.0]
    assert run.reward_names == ["Counter"]  # its reward column, logged as reward/Counter


class Guess:
    """The step form: reset(row) -> messages, step(messages) -> (messages, reward, done)."""

    def reset(self, row):
        self.secret, self.tries = int(row["secret"]), 0
        return [{"role": "user", "content": "Guess my number (1-9)."}]

    def step(self, messages):
        self.tries += 1
        guess = int("".join(c for c in messages[-1]["content"] if c.isdigit()) or 0)
        if guess == self.secret:
            return [], 1.0, True
        return [{"role": "user", "content": "Higher." if guess < self.secret else "Lower."}], -0.1, False


def test_a_step_environment_drives_the_conversation_and_its_rewards_add_up(qwen):
    def script(text):
        return f"{text.count('Higher.') + 3}"  # guesses 3, 4, 5, ...

    _, r = runner(qwen, environment=Guess, max_turns=5).run(
        ScriptedEngine(qwen, script), batch(["ignored"], secret=[5]), 1, SAMPLING
    )
    episode = r.episodes[0]
    assert [m["content"] for m in episode.messages] == ["3", "Higher.", "4", "Higher.", "5"]
    assert episode.ended_by == "done" and episode.env_reward == pytest.approx(0.8)


class Moody:
    def reset(self, **row):
        return random.choice([" A", " B", " C", " D"])

    def noop(self) -> str:
        """Does nothing."""
        return ""


def test_a_group_must_start_from_one_conversation(qwen):
    random.seed(1)
    with pytest.raises(ValueError, match="different conversations"):
        runner(qwen, environment=Moody).run(ScriptedEngine(qwen, lambda t: "x"), batch(["q"]), 4, SAMPLING)


def test_single_turn_is_the_engines_own_generate():
    class Engine:
        def generate(self, ids, n, sampling, chunk_prompts=None):
            return ("generated", ids, n, chunk_prompts)

    prompts = batch(["a"])
    assert SingleTurn().run(Engine(), prompts, 3, SAMPLING, chunk_prompts=2) == (
        prompts,
        ("generated", prompts.prompt_token_ids, 3, 2),
    )


def test_a_template_that_rewrites_earlier_turns_is_refused_at_start_up():
    from grpo.config import ConfigError, GRPOConfig
    from grpo.rollout.episodes import build_episodes

    qwen3 = family_tokenizer("qwen3")
    cfg = GRPOConfig(model="Qwen/Qwen3-0.6B", tools=["tests.unit.test_episodes:calculator"])
    with pytest.raises(ConfigError, match=r"Qwen3-0.6B: .*not prefix-preserving.*<think>"):
        build_episodes(cfg, PromptFormatter(qwen3, DataConfig()))
    qwen25 = build_episodes(cfg, PromptFormatter(family_tokenizer("qwen2.5"), DataConfig()))
    assert qwen25.multi_turn and qwen25.parser.name == "hermes"


def test_native_continue_rows_extends_each_row_as_given(tiny_model):
    from grpo.rollout.native import NativeEngine
    from tests.conftest import IdTokenizer

    engine = NativeEngine(tiny_model, IdTokenizer())
    rows = [[5, 6, 7], [9, 3]]
    greedy = SamplingParams(max_new_tokens=5, greedy=True)
    out = engine.continue_rows(rows, greedy)
    assert out.group_ids.tolist() == [0, 1]
    for r, ids in enumerate(rows):
        alone = engine.generate([ids], 1, greedy)
        n = int(alone.completion_mask.sum())
        assert out.completion_ids[r, :n].tolist() == alone.completion_ids[0, :n].tolist()


@pytest.mark.parametrize("family", ["mistral-nemo", "llama3.2", "qwen2.5"])
def test_each_familys_calls_are_parsed_from_the_tokens_as_sampled(family):
    """Mistral marks calls with a special token ([TOOL_CALLS]): decoding must keep special tokens."""
    from grpo.agents import PARSERS, ToolCall, detect_parser

    tokenizer = family_tokenizer(family)
    parser = detect_parser(tokenizer, family)
    end = ChatRenderer(tokenizer, [], date_string="26 Jul 2024").end_of_turn
    call = parser.format_call(ToolCall("calculator", {"expression": "12*34"}))
    script = lambda text: call if text.count("408") < 1 else "It is 408."  # noqa: E731
    run = runner(tokenizer, tools=[calculator], parser=parser)
    run.template_kwargs = {"date_string": "26 Jul 2024"}
    _, r = run.run(ScriptedEngine(tokenizer, script, eos=end), batch(["What is 12 * 34?"]), 1, SAMPLING)
    episode = r.episodes[0]
    assert episode.tool_calls == 1 and episode.tool_errors == {}, (family, episode.messages)
    assert [m["role"] for m in episode.messages] == ["assistant", "tool", "assistant"]
    assert episode.ended_by == "answer" and parser.name in PARSERS


def test_a_turn_the_template_cannot_render_ends_its_episode_not_the_run():
    """Llama 3's template takes one call per assistant turn; two end the episode (ended_by template)."""
    from grpo.agents import ToolCall, detect_parser

    tokenizer = family_tokenizer("llama3.2")
    parser = detect_parser(tokenizer, "llama3.2")
    two = "; ".join(parser.format_call(ToolCall("calculator", {"expression": e})) for e in ("1+1", "2+2"))
    run = runner(tokenizer, tools=[calculator], parser=parser)
    run.template_kwargs = {"date_string": "26 Jul 2024"}
    _, r = run.run(ScriptedEngine(tokenizer, lambda t: two, eos="<|eot_id|>"), batch(["q"]), 1, SAMPLING)
    assert r.episodes[0].ended_by == "template" and r.episodes[0].turns == 1
