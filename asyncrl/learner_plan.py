"""The passes a run's learner planned, as it ran them: learner rank 0 writes them into the run directory once the
policy is loaded (`auto` settings resolved), and `asyncrl tune` advises from them rather than from the config
alone (a run configured `learner.activation_checkpointing: auto` may have run without checkpointing)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from asyncrl.whole_files import write_json_whole

PLAN_FILE = "learner_plan.json"


@dataclass(frozen=True)
class LearnerPlan:
    micro_batch_tokens: int  # tokens per forward/backward pass (learner.micro_batch_tokens, auto resolved)
    packed: bool  # each micro-batch's samples back to back in one sequence (learner.packing, resolved)
    activation_checkpointing: str  # none, selective or full: the mode the decoder layers ran in (auto resolved)


def write_plan(run_dir: Path, plan: LearnerPlan) -> None:
    write_json_whole(Path(run_dir) / PLAN_FILE, asdict(plan))


def read_plan(run_dir: Path) -> LearnerPlan | None:
    """The run's recorded plan; None where it holds none (a run from before the file existed, or one that stopped
    before its policy loaded) or an unreadable one (the reader then falls back on the config)."""
    try:
        return LearnerPlan(**json.loads((Path(run_dir) / PLAN_FILE).read_text()))
    except (OSError, ValueError, TypeError):
        return None
