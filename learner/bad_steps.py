"""Non-finite steps: a step whose loss or gradient is NaN or infinite is skipped, and `learner.max_bad_steps` of
them in a row stop the run. One rule for the learner's loop and the synchronous reference's."""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


class TooManyBadSteps(RuntimeError):
    """learner.max_bad_steps batches in a row gave a non-finite loss or gradient."""


def note_bad_step(in_a_row: int, step: int, max_bad_steps: int) -> None:
    """Log that the update of `step` was skipped, the `in_a_row`-th in a row; stop the run (TooManyBadSteps) once
    that count reaches `max_bad_steps`."""
    log.warning("non-finite loss or gradient at step %d: update skipped (%d in a row)", step, in_a_row)
    if in_a_row >= max_bad_steps:
        raise TooManyBadSteps(f"{in_a_row} non-finite steps in a row (learner.max_bad_steps)")
