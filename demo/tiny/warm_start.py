"""Supervised phase that teaches the tiny model the answer format and the task, so that RL starts from a
policy with a non-trivial success rate: reward signal in most groups. With `label_noise` the teacher
is sloppy: the model learns the task but samples wrong digits often, the precision RL then adds.
Held-out questions are never shown (validation measures generalisation)."""

from __future__ import annotations

import logging
import math
import random
from typing import Any, Callable

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from asyncrl.config.sections import TaskConfig, WarmStartConfig
from asyncrl.environments import ChatDelta
from asyncrl.thinking import Thinking
from demo.tasks.catalog import SingleTurn, task_kind
from demo.tasks.dialogue import IGNORE_INDEX, dialogue_example
from demo.tasks.splits import Problem, draw_problems

log = logging.getLogger(__name__)

Example = tuple[list[int], list[int]]  # input ids, labels
AnswerScorer = Callable[[str, Any], float]  # (completion, ground truth) -> reward, as the rollout servers score

LOG_EVERY = 50  # supervised steps between progress lines
WARM_START_STREAM = 7919  # seed offset: the split's own stream (seed) would start with the held-out questions
ANSWER_SLACK_TOKENS = 3  # decode budget beyond the longest right response (sign, end marker)


def prompt_ids(tokenizer: PreTrainedTokenizerBase, question: str, thinking: Thinking = Thinking()) -> list[int]:
    """The question rendered as RL renders it (`rollout.thinking`'s template options included)."""
    return ChatDelta(tokenizer, thinking).prompt_ids([{"role": "user", "content": question}])


def supervised_example(tokenizer: PreTrainedTokenizerBase, question: str, answer: str,
                       thinking: Thinking = Thinking()) -> tuple[list[int], list[int]]:
    """Input ids and labels: the answer and end marker are learned, the prompt is not."""
    prompt = prompt_ids(tokenizer, question, thinking)
    target = tokenizer.encode(answer, add_special_tokens=False) + [tokenizer.eos_token_id]
    return prompt + target, [IGNORE_INDEX] * len(prompt) + target


def warm_start(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    task: TaskConfig,
    schedule: WarmStartConfig,
    seed: int,
    held_out: frozenset[str],
    thinking: Thinking = Thinking(),
) -> None:
    """Train `model` in place, where it is, for `schedule.steps` supervised steps on freshly drawn problems, none
    of whose questions is in `held_out` (validation measures generalisation, not recall), their prompts rendered as
    `thinking` has RL render them (`accumulate_gradient`: on a GPU in bf16 autocast, the weights and AdamW's state
    float32)."""
    rng = random.Random(seed + WARM_START_STREAM)
    optimizer = torch.optim.AdamW(model.parameters(), lr=schedule.lr, weight_decay=0.0)
    lr_at = _warmup_cosine(schedule.lr, schedule.warmup_steps, schedule.steps)
    model.train()
    examples = example_source(tokenizer, task, schedule, held_out, thinking)
    for step in range(schedule.steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step)
        optimizer.zero_grad(set_to_none=True)
        loss = accumulate_gradient(model, examples(rng), tokenizer.pad_token_id, schedule.micro_batches)
        optimizer.step()
        if step % LOG_EVERY == 0 or step == schedule.steps - 1:  # the only wait on the GPU: read at these steps only
            log.info("warm-start step %d/%d loss %.4f", step + 1, schedule.steps, loss.item())
    model.eval()


def accumulate_gradient(model: PreTrainedModel, batch: list[Example], pad_id: int, micro_batches: int) -> torch.Tensor:
    """Backward of the batch's mean loss over its learned tokens, in `micro_batches` passes over the examples sorted
    by length, each padded to its own longest: the gradient one pass over the whole batch gives (up to rounding),
    without padding every short example to the batch's longest (a scratchpad batch of 64 holds a 900-token solution
    beside a median of 84). On a GPU each pass runs in bf16 autocast. Returns the batch's mean loss, a 0-d tensor on
    the model's device: nothing here waits for the GPU, so that the CPU queues the next passes while it computes."""
    ordered = sorted(batch, key=lambda example: len(example[0])) if micro_batches > 1 else batch
    learned = sum(label != IGNORE_INDEX for _, labels in batch for label in labels[1:])  # the targets HF's loss shifts to
    loss = torch.zeros((), device=model.device)
    for part in _near_equal_parts(ordered, micro_batches):
        input_ids, labels = (_to_device(t, model.device) for t in pad_examples(part, pad_id))
        # no attention mask: the padding is on the right, where causal attention keeps it from every real token, and
        # unmasked causal attention may take the flash kernel (a mask rules it out)
        with torch.autocast(model.device.type, torch.bfloat16, enabled=model.device.type == "cuda"):
            part_loss = model(input_ids=input_ids, labels=labels,
                              num_items_in_batch=learned).loss  # this part's summed token losses / the batch's count
        part_loss.backward()
        loss += part_loss.detach()
    return loss


def _to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor` copied to `device` without waiting: from pinned memory, a copy from pageable memory would wait for
    the work queued before it."""
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def _near_equal_parts(items: list, count: int) -> list[list]:
    """`items` cut in order into `count` runs whose sizes differ by at most one (fewer when there are fewer items)."""
    size, larger = divmod(len(items), count)
    bounds = [index * size + min(index, larger) for index in range(count + 1)]
    return [items[start:end] for start, end in zip(bounds, bounds[1:]) if end > start]


def example_source(tokenizer: PreTrainedTokenizerBase, task: TaskConfig, schedule: WarmStartConfig,
                    held_out: frozenset[str], thinking: Thinking) -> Callable[[random.Random], list[Example]]:
    """A batch of supervised examples per call: question → the teacher's noisy response, or a multi-turn task's
    teacher episodes."""
    teacher = task_kind(task).teacher
    if isinstance(teacher, SingleTurn):
        space = teacher.problems(task)

        def single_turn(rng: random.Random) -> list[Example]:
            problems = draw_problems(rng, space, schedule.batch_size, exclude=held_out, unique=False)
            return [supervised_example(tokenizer, problem[0], teacher.response(problem, schedule.label_noise, rng),
                                       thinking) for problem in problems]
        return single_turn
    chat = ChatDelta(tokenizer, thinking)

    def multi_turn(rng: random.Random) -> list[Example]:
        return [dialogue_example(tokenizer, chat, teacher(rng, task, schedule.label_noise, held_out))
                for _ in range(schedule.batch_size)]
    return multi_turn


@torch.no_grad()
def greedy_accuracy(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, problems: list[Problem],
                    teacher: SingleTurn, score: AnswerScorer, thinking: Thinking = Thinking()) -> float:
    """Share of `problems` the model answers right with greedy decoding, scored by `score` (the rollout servers'
    scorer of the task's data source), with room for the longest response the teacher writes without a slip."""
    prompts = [prompt_ids(tokenizer, question, thinking) for question, _ in problems]
    width = max(map(len, prompts))
    input_ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(p)) + p for p in prompts])
    attention = (torch.arange(width)[None, :] >= torch.tensor([width - len(p) for p in prompts])[:, None]).long()
    right = [teacher.response(problem, 0.0, random.Random(0)) for problem in problems]  # noise 0: the right response
    budget = max(len(tokenizer.encode(text, add_special_tokens=False)) for text in right) + ANSWER_SLACK_TOKENS
    log.info("greedy accuracy on %d held-out problems, up to %d tokens each", len(problems), budget)
    output = model.generate(input_ids=input_ids.to(model.device), attention_mask=attention.to(model.device),
                            max_new_tokens=budget, do_sample=False)
    completions = tokenizer.batch_decode(output[:, width:], skip_special_tokens=True)
    return sum(score(text, answer) for text, (_, answer) in zip(completions, problems)) / len(problems)


def pad_examples(batch: list[tuple[list[int], list[int]]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Input ids and labels, each example padded on the right to the batch's longest: [examples, longest]."""
    width = max(len(ids) for ids, _ in batch)
    input_ids = torch.tensor([ids + [pad_id] * (width - len(ids)) for ids, _ in batch])
    labels = torch.tensor([lab + [IGNORE_INDEX] * (width - len(lab)) for _, lab in batch])
    return input_ids, labels


def _warmup_cosine(peak: float, warmup: int, total: int):
    def lr_at(step: int) -> float:
        if step < warmup:
            return peak * (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return peak * 0.5 * (1.0 + math.cos(math.pi * progress))

    return lr_at
