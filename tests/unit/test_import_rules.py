"""The package boundaries of the design, checked on the source (AST), plus an instant `--help`."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ROLES = ("rollout_servers", "buffer", "learner")
LAUNCH, DEMO = "launch", "demo"
OURS = ("asyncrl", *ROLES, LAUNCH, DEMO)
# Which of our packages each package's modules may import. `asyncrl` is the floor every role stands on (the
# contracts: messages, config, transport, weight-transfer protocol, staleness, data, placement, process
# plumbing, the row keys and texts of the built-in tasks); each role owns its room; the demo writes rows for
# the rollout servers' built-in environments and scorers through those shared words, and is handed the
# scorers it measures with; `launch` (the CLI, its commands, the Ray launcher) is the one place that puts
# the roles together.
MAY_IMPORT = {
    "asyncrl": {"asyncrl"},
    "rollout_servers": {"asyncrl", "rollout_servers"},
    "buffer": {"asyncrl", "buffer"},
    "learner": {"asyncrl", "learner"},
    DEMO: {"asyncrl", DEMO},
    LAUNCH: set(OURS),
}
# The libraries the buffer may import besides ours and the standard library: light ones only (no torch, no vllm),
# so that a buffer process starts in a blink and runs beside the learner on any machine.
BUFFER_LIBRARIES = {"numpy", "zmq", "msgspec", "xxhash"}
HEAVY = ("torch", "vllm", "transformers", "zmq", "numpy", "msgspec", "pyarrow", "aiohttp")
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


def loaded_after(statement: str) -> list[str]:
    """The modules of ours and the heavy libraries that `statement` leaves in sys.modules (a fresh interpreter)."""
    code = (f"import sys\n{statement}\n"
            f"print('LOADED', sorted(m for m in sys.modules if m.split('.')[0] in {OURS + HEAVY!r}))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert "LOADED" in out.stdout, out.stdout + out.stderr
    return ast.literal_eval(out.stdout.split("LOADED", 1)[1].strip())


@pytest.mark.parametrize("package", OURS)
def test_each_package_imports_only_what_it_stands_on(package):
    for path in sources(package):
        for module, _ in imports(path):
            if top(module) in OURS:
                assert top(module) in MAY_IMPORT[package], f"{path.relative_to(ROOT)} imports {module}"


def test_only_rollout_servers_import_vllm():
    for package in set(OURS) - {"rollout_servers"}:
        for path in sources(package):
            for module, _ in imports(path):
                assert top(module) != "vllm", f"{path.relative_to(ROOT)} imports {module}"


def test_only_learner_imports_fsdp():
    for package in set(OURS) - {"learner"}:
        for path in sources(package):
            for module, _ in imports(path):
                fsdp = module.startswith(FSDP_MODULES) or module.endswith(".fully_shard")
                assert not fsdp, f"{path.relative_to(ROOT)} imports {module}"


def test_buffer_imports_only_light_libraries():
    allowed = set(OURS) | BUFFER_LIBRARIES | set(sys.stdlib_module_names) | {"__future__"}
    for path in sources("buffer"):
        for module, _ in imports(path):
            assert top(module) in allowed, f"{path.relative_to(ROOT)} imports {module}"


def test_the_config_loads_no_implementation():
    # Any process reads its config first: a config section must not pull in environments, data readers,
    # sockets or tensors (it once loaded 33 modules through the environment section).
    loaded = loaded_after("import asyncrl.config")
    outside = [m for m in loaded if not m.startswith(("asyncrl.config", "asyncrl.staleness", "asyncrl.net",
                                                       "asyncrl.units", "asyncrl.wire_limits")) and m != "asyncrl"]
    assert outside == [], outside


def test_the_config_knows_every_built_in_environment():
    from asyncrl.config.environment import BUILTIN_ENVIRONMENT_NAMES
    from rollout_servers.environments import BUILTIN_ENVIRONMENTS

    assert set(BUILTIN_ENVIRONMENT_NAMES) == set(BUILTIN_ENVIRONMENTS)


def test_rule_checker_sees_nested_imports(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("import zmq\ndef f():\n    from learner.maths import losses\n")
    assert imports(sample) == [("zmq", True), ("learner.maths.losses", False)]


def test_package_rule_catches_a_role_importing_another(tmp_path, monkeypatch):
    (tmp_path / "buffer").mkdir()
    (tmp_path / "buffer" / "bad.py").write_text("from learner.maths.losses import ppo\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    with pytest.raises(AssertionError, match="buffer/bad.py imports learner.maths.losses.ppo"):
        test_each_package_imports_only_what_it_stands_on("buffer")


# The learner's rooms stand on one another in one order: the step's maths (pure tensor code) imports no other part
# of the learner, the policy only the maths and the process group; the rank-0 services and the loop above them may
# import what is below. So the maths never reaches the plumbing that faces the job, nor the plumbing the maths.
LEARNER_ROOMS_MAY_IMPORT = {
    "learner/maths": ("learner.maths",),
    "learner/policy": ("learner.maths", "learner.policy", "learner.distributed"),
}


def room_breaches(room: str) -> list[str]:
    allowed = LEARNER_ROOMS_MAY_IMPORT[room]
    return [f"{path.relative_to(ROOT)} imports {module}" for path in sorted((ROOT / room).rglob("*.py"))
            for module, _ in imports(path)
            if top(module) == "learner" and not (module + ".").startswith(tuple(a + "." for a in allowed))]


@pytest.mark.parametrize("room", LEARNER_ROOMS_MAY_IMPORT)
def test_each_learner_room_imports_only_the_rooms_below_it(room):
    assert (ROOT / room).is_dir()
    assert room_breaches(room) == []


def test_room_rule_catches_the_maths_importing_the_services(tmp_path, monkeypatch):
    (tmp_path / "learner" / "maths").mkdir(parents=True)
    (tmp_path / "learner" / "maths" / "bad.py").write_text("def f():\n    from learner.services.pacing import Pacer\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert room_breaches("learner/maths") == ["learner/maths/bad.py imports learner.services.pacing.Pacer"]


PRODUCT_PACKAGES = OURS
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
        "import sys\nfrom launch import cli\n"
        "try:\n    cli.main(['--help'])\nexcept SystemExit:\n    pass\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'vllm', 'transformers', 'zmq', *"
        + repr((*ROLES, DEMO)) + "))\nprint('HEAVY', heavy)\n"
    )
    from launch.cli import COMMANDS

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
