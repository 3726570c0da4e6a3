"""Package boundaries of the buffer (DESIGN.md's import rules) and the CLI's lazy imports."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
BUFFER_MAY_IMPORT = {"asyncrl", "buffer", "numpy", "zmq", "msgspec", "xxhash"} | set(sys.stdlib_module_names)
LAZY_BUFFER_IMPORTERS = ("launch/cli.py", "launch/commands/", "asyncrl/launch")


def imports(path: Path) -> list[tuple[str, bool]]:
    """(top-level module, imported at module level) for every import in the file."""
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found += [(name.split(".")[0], node in tree.body) for name in names]
    return found


def test_buffer_imports_only_asyncrl_and_light_libraries():
    for path in (ROOT / "buffer").rglob("*.py"):
        for module, _ in imports(path):
            assert module in BUFFER_MAY_IMPORT, f"{path.relative_to(ROOT)} imports {module}"


def test_asyncrl_imports_buffer_only_lazily_from_the_cli_and_launchers():
    for path in (ROOT / "asyncrl").rglob("*.py"):
        relative = path.relative_to(ROOT).as_posix()
        for module, top_level in imports(path):
            if module == "buffer":
                assert relative.startswith(LAZY_BUFFER_IMPORTERS) and not top_level, f"{relative} imports buffer"


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launch.cli", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=60)


def test_cli_lists_buffer_and_keygen_without_heavy_imports():
    probe = ("import sys, launch.cli as cli; cli.build_parser().format_help(); "
             "print(sorted(m for m in ('torch', 'vllm', 'buffer', 'zmq') if m in sys.modules))")
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT,
                          timeout=60).stdout.strip() == "[]"
    assert "fsync" in run_cli("buffer", "--help").stdout
    assert "CURVE" in run_cli("keygen", "--help").stdout


def test_keygen_writes_keys_and_names_the_missing_key(tmp_path):
    assert "buffer.curve_dir" in run_cli("keygen").stderr
    result = run_cli("keygen", f"buffer.curve_dir={tmp_path}")
    assert result.returncode == 0, result.stderr
    assert {p.name for p in tmp_path.iterdir()} >= {"server.key", "server.key_secret", "client.key",
                                                    "client.key_secret", "authorized_clients"}
