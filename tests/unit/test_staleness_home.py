"""The staleness rule has one home: no product module but `asyncrl/staleness.py` orders versions against
`max_staleness` or computes with it (checked on the source's syntax tree), and the rule's functions give
hand-worked values."""

import ast
from pathlib import Path

import pytest

from asyncrl.staleness import admission_capacity, staleness, trainable, weights_lag

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


@pytest.mark.parametrize(("policy", "oldest", "k", "expected"), [
    (5, 3, 2, True),  # staleness 2 = K
    (5, 2, 2, False),  # staleness 3 > K
    (5, -1, 0, True),  # nothing trained: staleness 0
    (0, 0, 0, True),
])
def test_trainable(policy, oldest, k, expected):
    assert trainable(policy, oldest, k) is expected
    assert weights_lag(policy, oldest, k) is not expected


def test_staleness_and_admission_capacity_by_hand():
    assert staleness(7, 4) == 3 and staleness(7, -1) == 0
    # K = 2 at version 3 with 8 groups per step: (2 + 3 + 1) · 8 = 48 groups may exist; 30 accepted, 10 running
    assert admission_capacity(3, 2, 8, accepted=30, running=10) == 8
    assert admission_capacity(0, 0, 4, accepted=4, running=0) == 0  # K = 0: one batch at a time
