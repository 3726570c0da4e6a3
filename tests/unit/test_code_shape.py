"""The product's shape, checked on the source (AST) and the docs: functions that read as a list of named steps
stay short, and the benchmarks page holds today's figures, not their history."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("asyncrl", "rollout_servers", "buffer", "learner", "launch", "demo")
MAX_FUNCTION_LINES = 60  # a longer function is steps waiting to be named
MAX_BENCHMARKS_LINES = 600  # docs/benchmarks.md: today's figures and how to re-run them; passes go to docs/history/


def long_functions(path: Path) -> list[str]:
    """`path:name (lines)` of each function or method in the file longer than MAX_FUNCTION_LINES."""
    tree = ast.parse(path.read_text(), filename=str(path))
    return [f"{path.relative_to(ROOT)}:{node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]


def test_no_product_function_is_longer_than_sixty_lines():
    found = [entry for package in PRODUCT for path in sorted((ROOT / package).rglob("*.py"))
             for entry in long_functions(path)]
    assert found == []


def test_the_benchmarks_page_stays_the_current_figures():
    lines = len((ROOT / "docs" / "benchmarks.md").read_text().splitlines())
    assert lines <= MAX_BENCHMARKS_LINES, f"docs/benchmarks.md has {lines} lines: move passes to docs/history/"
