"""The learner's RL maths checked against an independent plain-PyTorch GRPO step (plain_grpo.py), and both against
numbers worked out by hand.

The K = 0 integration test compares the async job with the synchronous reference, which trains with the same
learner code, so it cannot see a mistake in that code. Here the learner's own step (ReferenceTrainer.train, the
entry point of the synchronous reference: learning rate, collate, advantages, proximal pass, micro-batched loss,
clipping, AdamW) runs on the tiny model beside a step written from the definitions, on a batch that exercises
every part: a group with distinct rewards, a group whose rewards are all equal (zero advantage), unequal
response lengths, a masked tool span, and behaviour log-probs off the current policy, with importance weights
truncated at C and PPO ratios clipped on both sides.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from pathlib import Path

import pytest
import torch

from asyncrl.config import AsyncRLConfig
from asyncrl.config.algorithm import AlgorithmConfig
from asyncrl.config.sections import TinyModelConfig
from asyncrl.messages import Trajectory, TrajectoryGroup
from demo.tiny.model import build_tiny_model
from demo.tiny.tokenizer import build_char_tokenizer
from learner import reference_trainer
from learner.distributed import World
from learner.maths import attention
from learner.maths.advantages import compute_advantages
from learner.maths.logprobs import attach_scoring
from learner.maths.losses import LossInputs, compute_policy_loss
from learner.policy import policy_trainer
from plain_grpo import PlainStep, Sample, completion_logprobs, group_advantages, grpo_step, policy_loss

MODEL_SEED = 11
MICRO_BATCH_TOKENS = 32  # below rows x shortest row: the learner must split the batch (asserted below)
# log(π_prox / π_behav) of the trained tokens, in turn: ln C = 0.69 (0.9 and 1.1 are truncated at C = 2);
# ln 1.2 = 0.18 and ln 0.8 = -0.22 (naive_ppo's clip range: 0.9, 1.1 above it, -0.3, -0.6, -0.25 below)
BEHAVIOUR_OFFSETS = (0.0, 0.9, -0.3, 0.1, 1.1, -0.6, 0.05, -0.25)
TOOL_OUTPUT = "=42\n"  # the environment's tokens inside the tool group's first completion (loss mask 0)
# float64 on both sides: the two compute the same numbers in a different order (one unpadded sample at a time
# and eager attention against padded micro-batches, sdpa and the fused log-prob head), so they differ by
# round-off, ~1e-16 relative, summed over thousands of terms: far below these bounds
LOSS_RTOL = 1e-10
GRADIENT_ATOL_SHARE = 1e-10  # of the largest gradient entry
# AdamW's first step is lr · g / (|g| + 1e-8): a gradient entry near zero magnifies its round-off by up to
# lr / 1e-8 = 1e3 (lr = 1e-5), and the step itself is ~1e-5 per entry
PARAMETER_ATOL = 1e-12
LOSSES = ("decoupled_ppo", "naive_ppo")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread: on a few cores shared with other jobs a second one made each pass ten times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def tiny_model(tokenizer) -> torch.nn.Module:
    """demo/tiny's model in its default shape, randomly initialised with a fixed seed, in float64."""
    return build_tiny_model(TinyModelConfig(), tokenizer, MODEL_SEED).double()


def plain_policy(model: torch.nn.Module) -> torch.nn.Module:
    plain = copy.deepcopy(model)
    plain.set_attn_implementation("sdpa")  # torch's attention on one unpadded sample (eager's softmax runs in float32)
    return plain


def learner_policy(model: torch.nn.Module) -> torch.nn.Module:
    """`model` prepared as learner.policy.policy_model.load_policy prepares it (the learner's attention and scoring
    head), without FSDP: this test checks the maths, not the sharding."""
    policy = copy.deepcopy(model)
    policy.set_attn_implementation(attention.register())
    return attach_scoring(policy)


def sampled_batch(tokenizer, model: torch.nn.Module) -> tuple[list[Sample], list[list[float]]]:
    """The batch and, per sample, log(π_prox / π_behav) of its trained tokens. The behaviour log-probs are the
    model's own, shifted by BEHAVIOUR_OFFSETS, and rounded to float32 as the wire carries them."""
    encode = tokenizer.encode
    tool_call, tool_output, answer = encode("<calc>6*7</calc>"), encode(TOOL_OUTPUT), encode(" so 42")
    drafts = [  # (prompt, completion, loss mask, reward, group)
        ("3+4=", encode("7"), None, 1.0, "distinct"),
        ("3+4=", encode("7 or 8"), None, 0.5, "distinct"),
        ("3+4=", encode("12"), None, 0.0, "distinct"),
        ("9-2=", encode("7"), None, 1.0, "tied"),
        ("9-2=", encode("7.0"), None, 1.0, "tied"),
        ("9-2=", encode("seven"), None, 1.0, "tied"),
        ("6*7=?", tool_call + tool_output + answer, [1] * len(tool_call) + [0] * len(tool_output) + [1] * len(answer),
         1.0, "tool"),
        ("6*7=?", encode("41"), None, 0.0, "tool"),
    ]
    samples, offsets, turn = [], [], 0
    for prompt, completion, mask, reward, group in drafts:
        mask = mask or [1] * len(completion)
        draft = Sample(encode(prompt), completion, [0.0] * len(completion), mask, reward, group)
        with torch.no_grad():
            current = completion_logprobs(model, draft).tolist()
        shifts = [BEHAVIOUR_OFFSETS[(turn + j) % len(BEHAVIOUR_OFFSETS)] if m else 0.0 for j, m in enumerate(mask)]
        turn += sum(mask)
        behaviour = torch.tensor([lp - s if m else 0.0 for lp, s, m in zip(current, shifts, mask)],
                                 dtype=torch.float32).tolist()
        samples.append(dataclasses.replace(draft, behaviour_logprobs=behaviour))
        offsets.append([s for s, m in zip(shifts, mask) if m])
    return samples, offsets


def as_groups(samples: list[Sample]) -> list[TrajectoryGroup]:
    groups: dict[str, list[Trajectory]] = {}
    for s in samples:
        groups.setdefault(s.group, []).append(Trajectory(
            prompt_ids=s.prompt, completion_ids=s.completion, behaviour_logprobs=s.behaviour_logprobs,
            token_versions=[0] * len(s.completion), loss_mask=s.loss_mask, reward=s.reward, group_id=s.group,
            data_source="arithmetic", finish_reason="stop"))
    return [TrajectoryGroup(record_id=g, group_id=g, server_id="test", trajectories=t) for g, t in groups.items()]


def learner_step(config: AsyncRLConfig, model: torch.nn.Module, groups: list[TrajectoryGroup],
                 monkeypatch: pytest.MonkeyPatch) -> dict[str, float]:
    """One `train` of the synchronous reference's trainer, set up by its own `load` around `model` (which the
    step updates in place); the step's metrics."""
    monkeypatch.setattr(policy_trainer, "load_policy", lambda path, dtype, settings, world, lora: model)
    trainer = reference_trainer.ReferenceTrainer.load(config, World(rank=0, size=1, device=torch.device("cpu")))
    outcome = trainer.train(groups, version=0)
    assert outcome.finite
    return outcome.metrics


def exercised_clips(samples: list[Sample], offsets: list[list[float]], algorithm: AlgorithmConfig) -> dict[str, bool]:
    """Which parts of the loss the batch reaches: trained tokens with a non-zero advantage whose importance
    weight is truncated at C, or whose PPO ratio π_θ/π_behav (π_θ = π_prox before the update) is clipped."""
    advantages = group_advantages([s.reward for s in samples], [s.group for s in samples], algorithm.adv_eps)
    trained = [(a, o) for a, per_token in zip(advantages, offsets) for o in per_token]
    return {
        "truncated": any(a != 0 and o > math.log(algorithm.is_cap) for a, o in trained),
        "clipped_above": any(a > 0 and o > math.log(1 + algorithm.clip_eps_high) for a, o in trained),
        "clipped_below": any(a < 0 and o < math.log(1 - algorithm.clip_eps_low) for a, o in trained),
        "zero_advantage": any(a == 0 for a in advantages),
    }


@pytest.mark.parametrize("loss", LOSSES)
def test_the_learners_step_equals_a_plain_grpo_step(loss, tiny_model, tokenizer, tmp_path: Path, monkeypatch):
    tokenizer.save_pretrained(tmp_path)  # the trainer reads its pad id from model.path
    config = AsyncRLConfig()
    config.model.path = str(tmp_path)
    config.learner.micro_batch_tokens = str(MICRO_BATCH_TOKENS)
    config.algorithm.loss = loss
    samples, offsets = sampled_batch(tokenizer, plain_policy(tiny_model))
    assert all(exercised_clips(samples, offsets, config.algorithm).values())
    assert MICRO_BATCH_TOKENS < len(samples) * min(len(s.prompt) + len(s.completion) for s in samples)

    plain: PlainStep = grpo_step(plain_policy(tiny_model), samples, config.algorithm, config.learner)
    trained = learner_policy(tiny_model)
    metrics = learner_step(config, trained, as_groups(samples), monkeypatch)

    assert metrics["actor/pg_loss"] == pytest.approx(plain.loss, rel=LOSS_RTOL)
    assert metrics["actor/grad_norm"] == pytest.approx(plain.grad_norm, rel=LOSS_RTOL)
    assert plain.grad_norm > config.learner.grad_clip  # the clip is active: the gradients below are scaled
    largest = max(float(g.abs().max()) for g in plain.gradients.values())
    initial = dict(tiny_model.named_parameters())
    for name, parameter in trained.named_parameters():
        torch.testing.assert_close(parameter.grad, plain.gradients[name], rtol=0, atol=GRADIENT_ATOL_SHARE * largest)
        torch.testing.assert_close(parameter.detach(), plain.parameters[name], rtol=0, atol=PARAMETER_ATOL)
        assert not torch.equal(parameter.detach(), initial[name].detach()), name  # every weight moved


# The hand-sized case: one group of two sequences of three tokens, rewards 1 and 0, the second sequence's middle
# token a tool token (mask 0). π_θ = π_prox (the step's first pass), and the ratios π_θ/π_behav are
# sequence 1: 1, 1.5, 3;  sequence 2: 0.5, (masked), 1.
#
# GRPO: mean 0.5, Bessel std √((0.5² + 0.5²) / 1) = √0.5, so A = ±0.5 / (√0.5 + 1e-6) = ±a, a = 0.7071058.
# token_mean divides by the 5 trained tokens.
#
# decoupled_ppo: r = π_θ/π_prox = 1, never clipped; weights min(π_prox/π_behav, 2) = 1, 1.5, 2 | 0.5, 1.
#   loss = (-a·(1 + 1.5 + 2) + a·(0.5 + 1)) / 5 = -0.6·a = -0.4242635
#   d loss / d log π_θ = -w·A / 5 = -a/5 · (1, 1.5, 2) | a/5 · (0.5, 0, 1)
#                      = (-0.1414212, -0.2121317, -0.2828423) | (0.0707106, 0, 0.1414212)
# naive_ppo: r = π_θ/π_behav, clipped to [0.8, 1.2]; the larger of -A·r and -A·clip(r):
#   sequence 1 (A = a):  -a·min(r, clip(r)) = -a·(1, 1.2, 1.2), the last two clipped
#   sequence 2 (A = -a):  a·max(r, clip(r)) = a·(0.8, 1), the first clipped
#   loss = (-3.4·a + 1.8·a) / 5 = -0.32·a = -0.2262739
#   d loss / d log π_θ = -A·r / 5 on unclipped tokens, 0 on clipped ones = (-0.1414212, 0, 0) | (0, 0, 0.1414212)
HAND_LOGPROBS = [[-1.0, -2.0, -0.5], [-1.5, -3.0, -0.25]]
HAND_RATIOS = [[1.0, 1.5, 3.0], [0.5, 1.0, 1.0]]  # π_θ/π_behav; the masked token's ratio is never used
HAND_MASK = [[1, 1, 1], [1, 0, 1]]
HAND_REWARDS = [1.0, 0.0]
A = 0.7071058
HAND_EXPECTED = {  # loss, d loss / d log π_θ
    "decoupled_ppo": (-0.4242635, [[-0.1414212, -0.2121317, -0.2828423], [0.0707106, 0.0, 0.1414212]]),
    "naive_ppo": (-0.2262739, [[-0.1414212, 0.0, 0.0], [0.0, 0.0, 0.1414212]]),
}
HAND_ATOL = 1e-7  # the hand numbers are rounded to 7 decimals


def hand_tensors() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    logprobs = torch.tensor(HAND_LOGPROBS, dtype=torch.float64, requires_grad=True)  # [2, 3]
    behaviour = logprobs.detach() - torch.tensor(HAND_RATIOS, dtype=torch.float64).log()  # [2, 3]
    return logprobs, behaviour, torch.tensor(HAND_MASK, dtype=torch.float64)


def test_hand_case_advantages():
    assert group_advantages(HAND_REWARDS, ["g", "g"], AlgorithmConfig().adv_eps) == pytest.approx([A, -A], abs=HAND_ATOL)
    learner = compute_advantages(torch.tensor(HAND_REWARDS), ["g", "g"], torch.tensor(HAND_MASK), AlgorithmConfig())
    torch.testing.assert_close(learner, torch.tensor([[A, A, A], [-A, 0.0, -A]]), rtol=0, atol=HAND_ATOL)


@pytest.mark.parametrize("loss", LOSSES)
def test_hand_case_loss_of_the_plain_step(loss):
    config = AlgorithmConfig(loss=loss)
    logprobs, behaviour, mask = hand_tensors()
    value = policy_loss(list(logprobs), list(behaviour), list(mask), [A, -A], config)
    value.backward()
    expected_loss, expected_gradient = HAND_EXPECTED[loss]
    assert value.item() == pytest.approx(expected_loss, abs=HAND_ATOL)
    torch.testing.assert_close(logprobs.grad, torch.tensor(expected_gradient, dtype=torch.float64), rtol=0, atol=HAND_ATOL)


@pytest.mark.parametrize("loss", LOSSES)
def test_hand_case_loss_of_the_learner(loss):
    config = AlgorithmConfig(loss=loss)
    logprobs, behaviour, mask = hand_tensors()
    advantages = torch.tensor([[A] * 3, [-A] * 3], dtype=torch.float64) * mask  # [2, 3]
    value, metrics = compute_policy_loss(LossInputs(logprobs=logprobs, behaviour_logprobs=behaviour, advantages=advantages,
                                                    loss_mask=mask, proximal_logprobs=logprobs.detach()), config)
    value.backward()
    expected_loss, expected_gradient = HAND_EXPECTED[loss]
    assert value.item() == pytest.approx(expected_loss, abs=HAND_ATOL)
    assert metrics["actor/pg_loss"] == pytest.approx(expected_loss, abs=HAND_ATOL)
    torch.testing.assert_close(logprobs.grad, torch.tensor(expected_gradient, dtype=torch.float64), rtol=0, atol=HAND_ATOL)
