"""The package boundaries of the design, checked on the source (AST), plus an instant `--help`."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ROLES = ("rollout_servers", "buffer", "learner")
LAZY_ROLE_IMPORTERS = ("asyncrl/cli.py", "asyncrl/commands/", "asyncrl/launch")
FSDP_MODULES = ("torch.distributed.fsdp", "torch.distributed._composable.fsdp")


def imports(path: Path) -> list[tuple[str, bool]]:
    """(module, at_module_level) for every import statement in the file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    top_level = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, id(node) in top_level) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{alias.name}" for alias in node.names]
            found += [(name, id(node) in top_level) for name in names]
    return found


def sources(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def top(module: str) -> str:
    return module.split(".")[0]


@pytest.mark.parametrize("role", ROLES)
def test_roles_do_not_import_each_other(role):
    for path in sources(role):
        for module, _ in imports(path):
            assert top(module) not in set(ROLES) - {role}, f"{path.relative_to(ROOT)} imports {module}"


def test_only_rollout_servers_import_vllm():
    for package in ("asyncrl", "buffer", "learner"):
        for path in sources(package):
            for module, _ in imports(path):
                assert top(module) != "vllm", f"{path.relative_to(ROOT)} imports {module}"


def test_only_learner_imports_fsdp():
    for package in ("asyncrl", "buffer", "rollout_servers"):
        for path in sources(package):
            for module, _ in imports(path):
                fsdp = module.startswith(FSDP_MODULES) or module.endswith(".fully_shard")
                assert not fsdp, f"{path.relative_to(ROOT)} imports {module}"


def test_buffer_imports_neither_torch_nor_vllm():
    for path in sources("buffer"):
        for module, _ in imports(path):
            assert top(module) not in ("torch", "vllm"), f"{path.relative_to(ROOT)} imports {module}"


def test_core_imports_roles_only_lazily_from_the_cli():
    for path in sources("asyncrl"):
        relative = str(path.relative_to(ROOT))
        for module, at_top in imports(path):
            if top(module) not in ROLES:
                continue
            allowed = relative.startswith(LAZY_ROLE_IMPORTERS) and not at_top
            assert allowed, f"{relative} imports {module} ({'module level' if at_top else 'lazily'})"


def test_rule_checker_sees_nested_imports(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("import zmq\ndef f():\n    from learner import losses\n")
    assert imports(sample) == [("zmq", True), ("learner.losses", False)]


PRODUCT_PACKAGES = ("asyncrl", *ROLES)
TRANSPORT = "asyncrl/transport/"  # the one home of ZeroMQ sockets: binding, connecting, the CURVE rule
ZMQ_SOCKET_TYPES = {"ROUTER", "DEALER", "REQ", "REP", "PUB", "SUB", "XPUB", "XSUB", "PUSH", "PULL", "PAIR", "STREAM"}


def _roots_in_zmq(node: ast.expr) -> bool:
    """`zmq.X`, `zmq.asyncio.X`, or a bare socket type name imported from zmq."""
    while isinstance(node, ast.Attribute):
        node = node.value
    return isinstance(node, ast.Name) and (node.id == "zmq" or node.id in ZMQ_SOCKET_TYPES)


def zmq_creations(path: Path) -> list[int]:
    """Lines that create a ZeroMQ context (`Context(...)`, `Context.instance()`) or socket
    (`.socket(<zmq socket type>)`); the standard library's `socket.socket()` is not one."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
        context = name == "Context" or (name == "instance" and isinstance(func, ast.Attribute)
                                        and getattr(func.value, "attr", getattr(func.value, "id", "")) == "Context")
        socket = name == "socket" and any(_roots_in_zmq(arg) for arg in node.args)
        if context or socket:
            lines.append(node.lineno)
    return lines


@pytest.mark.parametrize("package", PRODUCT_PACKAGES)
def test_zeromq_sockets_are_created_only_in_the_transport(package):
    for path in sources(package):
        relative = str(path.relative_to(ROOT))
        if relative.startswith(TRANSPORT):
            continue
        assert not zmq_creations(path), f"{relative}:{zmq_creations(path)} creates a ZeroMQ socket or context outside {TRANSPORT}"


def test_socket_rule_checker_sees_every_form(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("import socket, zmq, zmq.asyncio\nfrom zmq import DEALER\n"
                      "a = zmq.Context()\nb = zmq.asyncio.Context.instance()\nc = a.socket(zmq.ROUTER)\n"
                      "d = b.socket(DEALER)\ne = socket.socket()\n")
    assert zmq_creations(sample) == [3, 4, 5, 6]


def test_help_imports_nothing_heavy():
    code = (
        "import sys\nfrom asyncrl import cli\n"
        "try:\n    cli.main(['--help'])\nexcept SystemExit:\n    pass\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'vllm', 'transformers', 'zmq', *"
        + repr(ROLES) + "))\nprint('HEAVY', heavy)\n"
    )
    from asyncrl.cli import COMMANDS

    for args in ([], *([command.name] for command in COMMANDS)):
        snippet = code.replace("['--help']", repr([*args, "--help"]))
        out = subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert "HEAVY []" in out.stdout, out.stdout + out.stderr


def test_the_rollout_supervisor_leaves_vllm_to_its_servers():
    # Each process that imports vLLM spends seconds of CPU on it; the supervisor runs no engine, so importing
    # vLLM there only delays the servers it starts (and every job start on a small machine).
    code = "import sys\nimport rollout_servers.supervisor\nprint('VLLM', 'vllm' in sys.modules)\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert "VLLM False" in out.stdout, out.stdout + out.stderr
