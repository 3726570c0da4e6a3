"""The staleness rule has one home: no product module but `asyncrl/staleness.py` orders versions against
`max_staleness` or computes with it (checked on the source's syntax tree), and the rule's functions give
hand-worked values: a group is judged by its start alone, however stale it is when trained."""

import ast
from pathlib import Path

import pytest

from asyncrl.staleness import (TOKEN_BOUND_OFF, admission_capacity, drained_version, oldest_trained_token_version,
                               staleness, starts_within_bound)

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("asyncrl", "rollout_servers", "buffer", "learner")
HOME = ROOT / "asyncrl" / "staleness.py"


def names_max_staleness(node: ast.AST) -> bool:
    return any(isinstance(part, ast.Name) and part.id == "max_staleness"
               or isinstance(part, ast.Attribute) and part.attr == "max_staleness" for part in ast.walk(node))


ORDERINGS = (ast.Lt, ast.LtE, ast.Gt, ast.GtE)  # a version against the bound (== / != only check a setting)


def rule_uses(path: Path) -> list[int]:
    """Lines where `max_staleness` is ordered against something or enters arithmetic."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and any(isinstance(op, ORDERINGS) for op in node.ops) and names_max_staleness(node):
            found.append(node.lineno)
        elif isinstance(node, ast.BinOp) and not isinstance(node.op, ast.BitOr) \
                and (names_max_staleness(node.left) or names_max_staleness(node.right)):  # `|`: a dict merged, not arithmetic
            found.append(node.lineno)
    return found


def test_no_module_but_the_rules_home_applies_the_bound():
    offenders = {str(path.relative_to(ROOT)): lines for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))
                 if path != HOME and (lines := rule_uses(path))}
    assert offenders == {}
    assert rule_uses(HOME)  # the check sees a use where there is one


@pytest.mark.parametrize(("learner", "start", "k", "expected"), [
    (5, 3, 2, True),  # started from weights 2 versions behind the learner: = K
    (5, 2, 2, False),  # 3 > K
    (0, 0, 0, True),  # K = 0: only from the learner's own weights
    (1, 0, 0, False),
    (9, -1, 0, True),  # no trained token: nothing to judge
    (-1, 4, 0, True),  # the learner's version was not recorded (a chat session's group)
    (3, 5, 0, True),  # weights newer than the learner it heard of (a resumed learner): never too old
])
def test_a_group_starts_within_the_bound_by_its_start_alone(learner, start, k, expected):
    assert starts_within_bound(learner, start, k) is expected


def test_staleness_admission_capacity_drain_and_token_bound_by_hand():
    assert staleness(7, 4) == 3 and staleness(7, -1) == 0
    # K = 2 at version 3 with 8 groups per step: (2 + 3 + 1) · 8 = 48 groups may exist; 30 accepted, 10 running
    assert admission_capacity(3, 2, 8, accepted=30, running=10) == 8
    assert admission_capacity(0, 0, 4, accepted=4, running=0) == 0  # K = 0: one batch at a time
    # a drain at version 10 under K = 2 takes the 3 batches the window holds: the learner goes on as version 13
    assert drained_version(10, 2) == 13 and drained_version(10, 0) == 11
    # M = 3 at version 10: tokens of versions 7 and newer are trained, older ones masked
    assert oldest_trained_token_version(10, 3) == 7 and oldest_trained_token_version(10, 0) == 10
    assert oldest_trained_token_version(10, TOKEN_BOUND_OFF) is None
