"""The `scratchpad` task: addition of two equally long numbers ("367+398="), answered with a worked solution
written column by column, so that responses are long and their lengths long-tailed.

    367+398:7+8+0=15:5
    36+39:6+9+1=16:65
    3+3:3+3+1=07:765
    =765

Line i (columns from the right) restates the digits not added yet, adds the last column with the carry in
("7+8+0"), writes the carry out and the sum digit ("15"), then the answer's digits so far ("5"); the last
line is "=" and the sum, the answer that is scored (`rollout_servers.rewards.builtin.final_answer_match`).
Every digit a line needs stands right before it (the last restated digits, the previous partial answer): the
model never has to find the i-th digit of a long number by position, which small models with rotary
positions learn slowly. The price is a solution quadratic in the size: 1.5 size² + 14.5 size + 3 tokens
at most in the tiny model's character tokens (`ScratchpadTaskConfig.longest_response_tokens`), from 18 for
one digit to 969 for 21.

Sizes (digits per operand) are drawn with probability ∝ size^-tail between `task.scratchpad.min_size` and
`max_size`, held-out ones with `val_tail` (uniform by default, so every length is measured). The warm-start
teacher slips: each column's sum digit is a random digit with probability `model.warm_start.label_noise`,
and it carries on from what it wrote, so a slip anywhere makes the answer wrong. One slip in a long solution
is likelier than in a short one: long problems start with a lower reward, and RL has something to fix at
every length.
"""

from __future__ import annotations

import random
from typing import Any

from asyncrl.config.sections import ScratchpadTaskConfig, TaskConfig
from asyncrl.data.builtin_sources import FINAL_ANSWER_MARK, SCRATCHPAD_SOURCE
from demo.tasks import arithmetic
from demo.tasks.arithmetic import noisy_answer
from demo.tasks.splits import Problem, ProblemMaker, TaskSplit, split_problems

DATA_SOURCE = SCRATCHPAD_SOURCE  # scored by the rollout servers' built-in final-answer match


def split(task: TaskConfig, seed: int) -> TaskSplit:
    """Held-out problems with sizes drawn with `val_tail`, training problems with `tail`."""
    settings = task.scratchpad
    return split_problems(problems(settings, settings.val_tail), problems(settings, settings.tail), task, seed)


def problems(settings: ScratchpadTaskConfig, tail: float) -> ProblemMaker:
    """Additions of two numbers of the same size, the size drawn with probability ∝ size^-tail."""
    sizes = range(settings.min_size, settings.max_size + 1)
    weights = [size ** -tail for size in sizes]

    def make(rng: random.Random) -> Problem:
        (size,) = rng.choices(sizes, weights)
        return arithmetic.make_problem(rng, size, size, "+")

    return make


def make_row(problem: Problem, index: int, split_name: str, task: TaskConfig) -> dict[str, Any]:
    question, answer = problem
    return arithmetic.make_row(question, answer, index, split_name) | {"data_source": DATA_SOURCE}


def worked_solution(problem: Problem, noise: float, rng: random.Random) -> str:
    """The teacher's solution of `problem`: each column's sum digit is a random digit with probability `noise`, and
    the lines after it (partial answers, the final answer) carry the digit it wrote."""
    question, _ = problem
    left, right = question.rstrip("=").split("+")
    lines, carry, written = [], 0, ""
    for rest in range(len(left), 0, -1):  # digits not added yet; the column is the last of them
        a, b = int(left[rest - 1]), int(right[rest - 1])
        total = a + b + carry
        digit = noisy_answer(str(total % 10), noise, rng)
        written = digit + written
        lines.append(f"{left[:rest]}+{right[:rest]}:{a}+{b}+{carry}={total // 10}{digit}:{written}")
        carry = total // 10
    final = (str(carry) if carry else "") + written
    return "\n".join(lines) + "\n" + FINAL_ANSWER_MARK + final
