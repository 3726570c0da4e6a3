"""The agent loop on a scripted fake engine and the real character tokenizer: what each turn's prompt
is, and masks, log-probs and versions token by token; limits and misbehaving environments."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from asyncrl.config.environment import EnvironmentConfig
from asyncrl.config.rollout import SamplingConfig
from asyncrl.data import PromptRow
from asyncrl.environments import ChatDelta
from rollout_servers.environments import EnvironmentRegistry
from asyncrl.environments.calculator_tool import CALCULATOR_TOOL
from demo.tiny.tokenizer import build_char_tokenizer
from rollout_servers.agent_loop import TURN_SEED_STRIDE, AgentLoop
from rollout_servers.completion import Completion

FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "environments.py"
TOKENIZER = build_char_tokenizer()
EOS = TOKENIZER.eos_token_id
MAX_MODEL_LEN = 256
SAMPLING = SamplingConfig(temperature=1.0, max_tokens=16, n=2)
HANG_S = 3600.0
OBSERVATION = "\n<|im_start|>user\n0<|im_end|>\n<|im_start|>assistant\n"  # the countdown's first feedback, as ids follow


def ids(text: str) -> list[int]:
    return TOKENIZER.encode(text, add_special_tokens=False)


@dataclass
class ScriptedEngine:
    """Answers request k with `turns[k]` (ids, log-probs), each token tagged with the current version;
    `updates[k]` is the version the weights move to after request k (a weight update between turns)."""

    turns: list[tuple[list[int], list[float]]]
    current_version: int = 3
    updates: dict[int, int] = field(default_factory=dict)
    hang_on: int = -1  # request number that never finishes
    requests: list[tuple[list[int], int, int | None]] = field(default_factory=list)  # (prompt, max_tokens, seed)
    constraints: list = field(default_factory=list)  # each request's structured-outputs grammar (None: free)

    async def generate(self, prompt_ids, sampling=None, *, seed=None, request_id=None,
                       on_tokens=None, structured_outputs=None) -> Completion:
        number = len(self.requests)
        self.constraints.append(structured_outputs)
        self.requests.append((list(prompt_ids), sampling.max_tokens, seed))
        if number == self.hang_on:
            await asyncio.sleep(HANG_S)  # the behaviour under test: a request that never finishes
        token_ids, logprobs = self.turns[number % len(self.turns)]
        token_ids, logprobs = token_ids[: sampling.max_tokens], logprobs[: sampling.max_tokens]
        finish = "stop" if token_ids[-1:] == [EOS] else "length"
        if on_tokens is not None:  # a streamed request: one output per sampled token, as vLLM's cumulative kind
            for count in range(1, len(token_ids) + 1):
                await on_tokens(token_ids[:count], logprobs[:count])
        versions = [self.current_version] * len(token_ids)
        self.current_version = self.updates.get(number, self.current_version)
        return Completion(f"r{number}", list(prompt_ids), token_ids, logprobs, versions, finish)


OBSERVATION_LEN = len(ids(OBSERVATION))  # 21 with the character tokenizer


def turn(text: str, first_logprob: float) -> tuple[list[int], list[float]]:
    token_ids = ids(text) + [EOS]
    return token_ids, [first_logprob - 0.125 * i for i in range(len(token_ids))]


def loop_for(engine, source_spec: str = "CountdownEnvironment", **limits) -> AgentLoop:
    registry = EnvironmentRegistry.from_config({"src": f"{FIXTURE}:{source_spec}"})
    return AgentLoop(engine, TOKENIZER, registry, EnvironmentConfig(**limits), MAX_MODEL_LEN)


def countdown_row(turns: int) -> PromptRow:
    return PromptRow([{"role": "user", "content": "go"}], "src", "", extra_info={"turns": turns}, row_index=5)


def test_three_turns_token_by_token_with_an_update_between_turns():
    turns = [turn("ab", -0.5), turn("c", -1.5), turn("de", -2.5)]
    engine = ScriptedEngine(turns, current_version=3, updates={0: 4})  # weights move to 4 after turn 0
    episode = asyncio.run(loop_for(engine).run(countdown_row(3), SAMPLING, seed=100))

    delta = ChatDelta(TOKENIZER)
    prompt = delta.prompt_ids([{"role": "user", "content": "go"}])
    obs0 = ids(OBSERVATION)
    obs1 = ids("\n<|im_start|>user\n1<|im_end|>\n<|im_start|>assistant\n")
    (a, la), (c, lc), (d, ld) = turns
    t = episode.transcript
    assert t.prompt_ids == prompt
    assert t.completion_ids == a + obs0 + c + obs1 + d
    assert t.loss_mask == [1] * 3 + [0] * len(obs0) + [1] * 2 + [0] * len(obs1) + [1] * 3
    assert t.logprobs == la + [0.0] * len(obs0) + lc + [0.0] * len(obs1) + ld
    assert t.versions == [3] * 3 + [3] * len(obs0) + [4] * 2 + [4] * len(obs1) + [4] * 3
    # each turn's prompt is exactly the ids so far (no re-tokenization), each turn seeded on its own
    assert [r[0] for r in engine.requests] == [prompt, prompt + a + obs0, prompt + a + obs0 + c + obs1]
    assert [r[2] for r in engine.requests] == [100, 100 + TURN_SEED_STRIDE, 100 + 2 * TURN_SEED_STRIDE]
    assert (episode.reward, episode.finish_reason, episode.num_turns, episode.error) == (1.5, "env_done", 3, "")
    trajectory = episode.trajectory("g-1", "src")
    assert (trajectory.num_turns, trajectory.group_id, trajectory.reward_info) == (3, "g-1", {"turn": 2.0})
    assert trajectory.oldest_version() == 3
    trajectory.validate()


def test_group_runs_n_episodes_with_consecutive_seeds_and_reports_each_finished():
    engine = ScriptedEngine([turn("x", -1.0)])
    finished = []
    group = asyncio.run(loop_for(engine).run_group(countdown_row(1), SAMPLING, 40, "g",
                                                   on_sample_done=lambda: finished.append(len(engine.requests))))
    assert [t.group_id for t in group] == ["g", "g"]
    assert sorted(r[2] for r in engine.requests) == [40, 41]
    assert len(finished) == SAMPLING.n, "each episode's slot is freed once, when it ends"


def test_max_turns_ends_the_episode_trained():
    engine = ScriptedEngine([turn("x", -1.0)])
    episode = asyncio.run(loop_for(engine, max_turns=2).run(countdown_row(5), SAMPLING))
    assert (episode.finish_reason, episode.num_turns, episode.reward) == ("max_turns", 2, 1.0)
    assert sum(episode.transcript.loss_mask) == 4  # two turns of "x" + end of turn


def test_token_limit_drops_an_observation_without_room_and_caps_a_turn():
    engine = ScriptedEngine([turn("abcdefgh", -1.0)])  # 9 ids a turn
    prompt_len = len(ChatDelta(TOKENIZER).prompt_ids([{"role": "user", "content": "go"}]))
    limit = prompt_len + 9 + OBSERVATION_LEN  # the first turn fits; after the observation no room would be left
    episode = asyncio.run(loop_for(engine, max_total_tokens=limit).run(countdown_row(5), SAMPLING))
    assert (episode.finish_reason, episode.num_turns) == ("max_tokens", 1)
    assert episode.transcript.loss_mask == [1] * 9
    limit = prompt_len + 9 + OBSERVATION_LEN + 4  # room for a second turn of 4 ids
    episode = asyncio.run(loop_for(engine, max_total_tokens=limit).run(countdown_row(5), SAMPLING))
    assert [request[1] for request in engine.requests[-2:]] == [16, 4]
    assert (episode.finish_reason, episode.num_turns, episode.transcript.total_tokens()) == ("max_tokens", 2, limit)
    assert episode.transcript.loss_mask == [1] * 9 + [0] * OBSERVATION_LEN + [1] * 4


@pytest.mark.parametrize("name, reason, error", [
    ("CrashingEnvironment", "env_error", "step 1 raised RuntimeError: the tool server went away"),
    ("HangingEnvironment", "env_timeout", "step 1 ran past its 0.2s deadline"),
    ("BrokenResetEnvironment", "env_error", "reset raised KeyError: 'target'"),
])
def test_failing_environment_ends_its_episode_untrained_with_the_error(name, reason, error):
    engine = ScriptedEngine([turn("x", -1.0)])
    episode = asyncio.run(loop_for(engine, name, call_timeout_s=0.2).run(countdown_row(4), SAMPLING))
    assert (episode.finish_reason, episode.reward) == (reason, 0.0)
    assert error in episode.error
    transcript = episode.transcript
    assert transcript.loss_mask == [0] * len(transcript.completion_ids)
    assert transcript.prompt_ids == ChatDelta(TOKENIZER).prompt_ids([{"role": "user", "content": "go"}])
    assert len(transcript.completion_ids) == (0 if name == "BrokenResetEnvironment" else 2 + OBSERVATION_LEN + 2)
    episode.trajectory("g", "src").validate()


def test_episode_time_budget_drops_the_cut_turn_and_keeps_the_rest():
    engine = ScriptedEngine([turn("x", -1.0)], hang_on=1)  # the second model turn never returns
    episode = asyncio.run(loop_for(engine, episode_timeout_s=0.3).run(countdown_row(4), SAMPLING))
    assert (episode.finish_reason, episode.num_turns, episode.error) == ("time_budget", 1, "")
    assert episode.transcript.loss_mask == [1, 1] + [0] * OBSERVATION_LEN


def test_episode_reaches_the_learner_through_the_wire_unchanged():
    from asyncrl.messages import TrajectoryGroup, decode, encode
    from learner.maths.batching import collate

    engine = ScriptedEngine([turn("ab", -0.5), turn("c", -1.5)], updates={0: 4})
    trajectory = asyncio.run(loop_for(engine).run(countdown_row(2), SAMPLING)).trajectory("g", "src")
    group = decode(encode(TrajectoryGroup("g", "g", "server-0", [trajectory])))
    assert group.trajectories[0] == trajectory
    batch = collate([group], TOKENIZER.pad_token_id)
    start = len(trajectory.prompt_ids) - 1  # the learner predicts token i+1 at position i
    targets = slice(start, start + len(trajectory.completion_ids))
    assert batch.input_ids[0].tolist() == trajectory.prompt_ids + trajectory.completion_ids
    assert batch.loss_mask[0, targets].tolist() == [1.0] * 3 + [0.0] * OBSERVATION_LEN + [1.0] * 2
    assert batch.token_versions[0, targets].tolist() == [3] * (3 + OBSERVATION_LEN) + [4] * 2
    assert batch.loss_mask[0, :start].sum() == 0


CALCULATOR_ROW = PromptRow([{"role": "user", "content": "63*43="}], "calculator", "2709",
                           extra_info={"tool_format": "hermes"}, row_index=2)
CALL_SAMPLING = SamplingConfig(temperature=1.0, max_tokens=80, n=1)  # room for the call's 71 tokens


def calculator_loop(engine, tool_parser: str = "hermes") -> AgentLoop:
    registry = EnvironmentRegistry.from_config({"calculator": "calculator"})
    return AgentLoop(engine, TOKENIZER, registry, EnvironmentConfig(tool_parser=tool_parser), MAX_MODEL_LEN)


def test_a_function_call_is_parsed_by_vllms_parser_answered_by_id_and_rendered_with_the_tools():
    call = turn('<tool_call>{"name": "calc", "arguments": {"expr": "63*43"}}</tool_call>', -0.25)
    answer = turn("2709", -0.5)
    engine = ScriptedEngine([call, answer])
    episode = asyncio.run(calculator_loop(engine).run(CALCULATOR_ROW, CALL_SAMPLING, seed=1))

    assert (episode.reward, episode.finish_reason, episode.num_turns, episode.info) == (1.0, "env_done", 2,
                                                                                         {"tool_calls": 1.0})
    # the whole episode is the template's render of the conversation with the tools listed: no drift at the joins
    conversation = [*CALCULATOR_ROW.messages,
                    {"role": "assistant", "content": "", "tool_calls": [
                        {"id": "x", "type": "function", "function": {"name": "calc", "arguments": '{"expr": "63*43"}'}}]},
                    {"role": "tool", "tool_call_id": "x", "content": "2709"},
                    {"role": "assistant", "content": "2709"}]
    rendered = TOKENIZER.apply_chat_template(conversation, tools=[CALCULATOR_TOOL], tokenize=False)
    t = episode.transcript
    assert TOKENIZER.decode(t.context()) + "\n" == rendered
    tool_reply = ids("\n<|im_start|>tool\n2709<|im_end|>\n<|im_start|>assistant\n")
    assert t.completion_ids == call[0] + tool_reply + answer[0]
    assert t.loss_mask == [1] * len(call[0]) + [0] * len(tool_reply) + [1] * len(answer[0])
    assert engine.requests[1][0] == t.prompt_ids + call[0] + tool_reply  # the next turn sees the tool's answer


def test_an_environment_with_tools_but_no_parser_ends_untrained_naming_the_key():
    engine = ScriptedEngine([turn("2709", -0.5)])
    episode = asyncio.run(calculator_loop(engine, tool_parser="").run(CALCULATOR_ROW, CALL_SAMPLING, seed=1))
    assert (episode.finish_reason, episode.reward, engine.requests) == ("env_error", 0.0, [])
    assert "set environment.tool_parser" in episode.error and set(episode.transcript.loss_mask) <= {0}
