"""Environments: the built-ins, the registry by name and path:Class, deadline guards, chat deltas and the
token transcript of an episode, with exact values."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from asyncrl.config import ConfigError, load_config
from asyncrl.data import PromptRow
from asyncrl.environments import ChatDelta, ModelTurn, StepResult, Transcript
from rollout_servers.environments import ENV_ERROR, ENV_TIMEOUT, EnvironmentConfigError, EnvironmentFailure, EnvironmentRegistry
from asyncrl.environments.calculator_tool import CALCULATOR_TOOL, evaluate
from rollout_servers.environments.calculator import CalculatorEnvironment
from rollout_servers.environments.guarded import GuardedEnvironment
from rollout_servers.environments.guess_number import GuessNumberEnvironment
from demo.tiny.tokenizer import build_char_tokenizer

FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "environments.py"
CALL_TIMEOUT_S = 0.2  # deadline of the guarded calls to the hanging fixture


def spec(name: str) -> str:
    return f"{FIXTURE}:{name}"


def row(source: str, truth: str = "", **extra) -> PromptRow:
    return PromptRow([{"role": "user", "content": "q"}], source, truth, extra_info=extra)


def turn(text: str, number: int = 0) -> ModelTurn:
    return ModelTurn(text, [], "stop", number)


def test_calculator_evaluates_with_precedence_and_refuses_anything_else():
    assert [evaluate(e) for e in ("12*7", "2+3*4", "10-2*3-1", " 5 ", "007")] == ["84", "14", "3", "5", "7"]
    assert [evaluate(e) for e in ("2**8", "(1+2)", "1/2", "a+1", "", "1+", "9" * 41)] == ["error"] * 7


def test_calculator_episode_tool_call_then_scored_answer():
    environment = CalculatorEnvironment()
    messages = asyncio.run(environment.reset(row("calculator", "84")))
    assert messages == [{"role": "user", "content": "q"}]
    called = asyncio.run(environment.step(turn("<calc>12*7</calc>")))
    assert called == StepResult([{"role": "tool", "content": "84"}], 0.0, False, {"tool_calls": 1.0})
    answered = asyncio.run(environment.step(turn(" 84 ", 1)))
    assert answered == StepResult([], 1.0, True, {"tool_calls": 1.0})
    assert asyncio.run(environment.step(turn("85", 2))).reward == 0.0


def function_turn(*calls: tuple[str, str, str], text: str = "") -> ModelTurn:
    return ModelTurn(text, [], "stop", 0, [{"id": call_id, "type": "function",
                                            "function": {"name": name, "arguments": arguments}}
                                           for call_id, name, arguments in calls])


def test_calculator_with_function_tools_answers_each_call_by_id():
    environment = CalculatorEnvironment()
    asyncio.run(environment.reset(row("calculator", "84", tool_format="hermes")))
    assert environment.tools() == [CALCULATOR_TOOL]
    called = asyncio.run(environment.step(function_turn(("a", "calc", '{"expr": "12*7"}'), ("b", "calc", '{"expr": "1+"}'),
                                                        ("c", "sqrt", '{"x": 4}'), ("d", "calc", "{nope"))))
    assert called.observation == [{"role": "tool", "tool_call_id": "a", "content": "84"},
                                  {"role": "tool", "tool_call_id": "b", "content": "error"},
                                  {"role": "tool", "tool_call_id": "c", "content": "error: no function 'sqrt'"},
                                  {"role": "tool", "tool_call_id": "d", "content": "error"}]
    assert (called.done, called.info) == (False, {"tool_calls": 4.0})
    # a tag is plain text in this format: without a parsed call the turn is the answer
    assert asyncio.run(environment.step(function_turn(text="<calc>12*7</calc>"))).done
    asyncio.run(environment.reset(row("calculator", "84")))
    assert environment.tools() is None  # the tag format lists no tools


def test_calculator_refuses_an_unknown_tool_format():
    with pytest.raises(ValueError, match=r"extra_info.tool_format is 'xml', expected 'calc' or 'hermes'"):
        asyncio.run(CalculatorEnvironment().reset(row("calculator", "84", tool_format="xml")))


def test_guess_number_feedback_and_reward_falls_with_guesses():
    environment = GuessNumberEnvironment()
    asyncio.run(environment.reset(row("guess_number", "7", max_guesses=4)))
    answers = [asyncio.run(environment.step(turn(text, i))) for i, text in enumerate(["3", "x", "9", "7"])]
    assert [a.observation for a in answers[:3]] == [[{"role": "user", "content": c}] for c in ("higher", "invalid", "lower")]
    assert [a.done for a in answers] == [False, False, False, True]
    assert answers[3].reward == pytest.approx(1 - 3 / 4) and answers[3].info == {"guesses": 4.0, "solved": 1.0}
    asyncio.run(environment.reset(row("guess_number", "7", max_guesses=2)))
    assert asyncio.run(environment.step(turn("7"))).reward == 1.0
    asyncio.run(environment.reset(row("guess_number", "7", max_guesses=2)))
    asyncio.run(environment.step(turn("1")))
    assert asyncio.run(environment.step(turn("2", 1))) == StepResult([], 0.0, True, {"guesses": 2.0, "solved": 0.0})


def test_guess_number_solved_rule_pays_one_whenever_found_in_time():
    environment = GuessNumberEnvironment()
    asyncio.run(environment.reset(row("guess_number", "7", max_guesses=3, reward="solved")))
    answers = [asyncio.run(environment.step(turn(text, i))) for i, text in enumerate(["4", "9", "7"])]
    assert [(a.reward, a.done) for a in answers] == [(0.0, False), (0.0, False), (1.0, True)]
    asyncio.run(environment.reset(row("guess_number", "7", max_guesses=2, reward="solved")))
    asyncio.run(environment.step(turn("1")))
    assert asyncio.run(environment.step(turn("2", 1))) == StepResult([], 0.0, True, {"guesses": 2.0, "solved": 0.0})


def test_guess_number_rejects_an_unknown_reward_rule():
    with pytest.raises(ValueError, match="extra_info.reward 'fastest' is not one of"):
        asyncio.run(GuessNumberEnvironment().reset(row("guess_number", "7", reward="fastest")))


def test_guess_number_range_feedback_narrows_and_ignores_guesses_outside_the_range():
    environment = GuessNumberEnvironment()
    asyncio.run(environment.reset(row("guess_number", "7", max_guesses=6, max_number=31, feedback="range")))
    answers = [asyncio.run(environment.step(turn(text, i))) for i, text in enumerate(["16", "3", "20", "x", "6"])]
    texts = [a.observation[0]["content"] for a in answers]
    assert texts == ["lower: 1-15", "higher: 4-15", "lower: 4-15", "invalid: 4-15", "higher: 7-15"]


def test_guess_number_range_feedback_needs_max_number():
    with pytest.raises(ValueError, match="range feedback needs extra_info.max_number"):
        asyncio.run(GuessNumberEnvironment().reset(row("guess_number", "7", feedback="range")))


def test_registry_resolves_builtins_and_user_classes_per_data_source():
    registry = EnvironmentRegistry.from_config({"calc": "calculator", "mine": spec("CountdownEnvironment")})
    assert registry.handles("calc") and registry.handles("mine") and not registry.handles("arithmetic")
    assert isinstance(registry.create("calc").environment, CalculatorEnvironment)
    assert type(registry.create("mine").environment).__name__ == "CountdownEnvironment"


@pytest.mark.parametrize("bad, problem", [
    ("calculater", "'calculater' is neither a built-in environment"),
    (f"{FIXTURE.parent}/nowhere.py:Env", "nowhere.py' does not exist"),
    (spec("Missing"), "defines no 'Missing'"),
    (spec("NotAnEnvironment"), r"not an environment class.*\['reset', 'step'\]"),
    ("no_such_module:Env", "importing module 'no_such_module' failed"),
])
def test_registry_errors_name_the_config_key(bad, problem):
    with pytest.raises(EnvironmentConfigError, match=r"environment\.by_source\.src: .*" + problem):
        EnvironmentRegistry.from_config({"src": bad})


def test_config_section_validates_names_and_token_limit():
    config = load_config(None, [f"environment.by_source.mine={spec('CountdownEnvironment')}", "environment.max_turns=3"])
    assert config.environment.by_source == {"calculator": "calculator", "guess_number": "guess_number",
                                            "mine": spec("CountdownEnvironment")}
    assert config.environment.total_token_limit(256) == 256
    with pytest.raises(ConfigError, match=r"environment\.by_source\.mine: 'calc' is neither"):
        load_config(None, ["environment.by_source.mine=calc"])
    with pytest.raises(ConfigError, match=r"environment\.max_total_tokens: must not exceed rollout\.engine\.max_model_len=256"):
        load_config(None, ["environment.max_total_tokens=300"])
    with pytest.raises(ConfigError, match=r"environment\.max_turns"):
        load_config(None, ["environment.max_turns=0"])


@pytest.mark.parametrize("name, reason, message", [
    ("CrashingEnvironment", ENV_ERROR, "step 1 raised RuntimeError: the tool server went away"),
    ("HangingEnvironment", ENV_TIMEOUT, f"step 1 ran past its {CALL_TIMEOUT_S:g}s deadline"),
    ("GarbageEnvironment", ENV_ERROR, "step returned str, expected StepResult"),
])
def test_guard_turns_raising_hanging_and_garbage_steps_into_failures(name, reason, message):
    guarded = EnvironmentRegistry.from_config({"src": spec(name)}).create("src")

    async def play():
        await guarded.reset(row("src", turns=3), CALL_TIMEOUT_S)
        first = await guarded.step(turn("a", 0), CALL_TIMEOUT_S)
        if name == "GarbageEnvironment":
            return first
        return await guarded.step(turn("b", 1), CALL_TIMEOUT_S)

    with pytest.raises(EnvironmentFailure, match=message) as failure:
        asyncio.run(play())
    assert failure.value.finish_reason == reason


def test_guard_checks_reset_messages():
    class EmptyReset(CalculatorEnvironment):
        async def reset(self, sample):
            return [{"role": "narrator", "content": "hi"}]

    with pytest.raises(EnvironmentFailure, match=r"reset returned message 0 .*expected \{'role': one of"):
        asyncio.run(GuardedEnvironment(EmptyReset(), "empty").reset(row("x"), CALL_TIMEOUT_S))


def test_chat_delta_closes_the_turn_and_cues_the_next_one():
    tokenizer = build_char_tokenizer()
    delta = ChatDelta(tokenizer)
    eos = tokenizer.eos_token_id
    tool = [{"role": "tool", "content": "84"}]
    after_eos = delta.observation_ids(tool, [tokenizer.convert_tokens_to_ids("7"), eos])
    assert tokenizer.decode(after_eos) == "\n<|im_start|>tool\n84<|im_end|>\n<|im_start|>assistant\n"
    cut_off = delta.observation_ids(tool, [tokenizer.convert_tokens_to_ids("7")])
    assert cut_off == [eos] + after_eos  # a turn cut by its token cap gets the end-of-turn token from the template
    # the full conversation rendered by the template tokenizes to the same ids: no drift at the joins
    messages = [{"role": "user", "content": "12*7="}, {"role": "assistant", "content": "<calc>12*7</calc>"}, *tool]
    model = tokenizer.encode("<calc>12*7</calc>", add_special_tokens=False) + [eos]
    joined = delta.prompt_ids(messages[:1]) + model + delta.observation_ids(tool, model)
    assert joined == delta.prompt_ids(messages)


def test_chat_delta_refuses_a_template_that_rewrites_the_models_content():
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}{{ m['role'] + ':' + m['content'] | lower + '\\n' }}{% endfor %}"
    with pytest.raises(ValueError, match="does not write an assistant message's content as it is"):
        ChatDelta(tokenizer).observation_ids([{"role": "user", "content": "1"}], [tokenizer.eos_token_id])


def test_transcript_masks_and_versions_token_by_token():
    transcript = Transcript(prompt_ids=[1, 2, 3], start_version=4)
    transcript.add_observation([9])  # before any model token: the start version
    transcript.add_model_turn([10, 11], [-0.5, -0.25], [4, 5])
    transcript.add_observation([20, 21, 22])
    transcript.add_model_turn([12], [-1.0], [6])
    assert transcript.context() == [1, 2, 3, 9, 10, 11, 20, 21, 22, 12]
    assert transcript.completion_ids == [9, 10, 11, 20, 21, 22, 12]
    assert transcript.loss_mask == [0, 1, 1, 0, 0, 0, 1]
    assert transcript.logprobs == [0.0, -0.5, -0.25, 0.0, 0.0, 0.0, -1.0]
    assert transcript.versions == [4, 4, 5, 5, 5, 5, 6]
    assert transcript.total_tokens() == 10
    with pytest.raises(ValueError, match="2 tokens with 1 log-probs and 2 versions"):
        transcript.add_model_turn([1, 2], [0.0], [0, 0])
    transcript.untrained()
    assert transcript.loss_mask == [0] * 7
