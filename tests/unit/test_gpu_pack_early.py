"""scripts/gpu_pack.sh's EARLY wheels are all that `asyncrl data` and `asyncrl init-model` need of the pack: a GPU
host's first call carries them (.device/early) and starts the race's warm start (gpu_bench.sh warm) before vLLM's
pieces arrive. Emulated here: this environment less every wheel the pack brings but EARLY's, both commands run on a
CPU-sized model; less EARLY's too, `data` fails, so the check can fail."""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACK = (ROOT / "scripts" / "gpu_pack.sh").read_text()
TINY = ["model.tiny.hidden_size=64", "model.tiny.num_layers=2", "model.tiny.intermediate_size=128",
        "model.tiny.num_heads=2", "model.tiny.num_kv_heads=1", "model.warm_start.steps=2",
        "model.warm_start.eval_samples=0", "model.warm_start.device=cpu", "task.num_train=64", "learner.device=cpu",
        "metrics.wandb_mode=disabled"]


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def bash_array(name: str) -> list[str]:
    """The words of the first `name=(...)` array in gpu_pack.sh, version pins dropped."""
    words = re.search(rf"^{name}=\((.*?)\)", PACK, re.S | re.M).group(1).split()
    return [normalized(word.split("==")[0]) for word in words]


def site_without(tmp_path: Path, wheels: set[str]) -> Path:
    """A directory of links to this environment's installed packages, less the files of `wheels`."""
    site = Path(sysconfig.get_paths()["purelib"])
    left_out = set()
    for dist in importlib.metadata.distributions(path=[str(site)]):
        if normalized(dist.metadata["Name"]) in wheels:
            left_out |= {Path(file).parts[0] for file in dist.files or [] if not str(file).startswith("..")}
    linked = tmp_path / "site"
    linked.mkdir()
    for entry in site.iterdir():
        if entry.name not in left_out:
            (linked / entry.name).symlink_to(entry)
    return linked


def launch(command: str, site: Path, work: Path) -> subprocess.CompletedProcess:
    """`asyncrl COMMAND` on the CPU-sized model, with only the repository and `site` importable (no site hooks)."""
    files = [f"task.out_dir={work}/data", f"data.train_files=[{work}/data/train.parquet]",
             f"data.val_files=[{work}/data/val.parquet]", f"model.path={work}/model"]
    code = (f"import runpy, sys; sys.path[:0] = [{str(ROOT)!r}, {str(site)!r}]; sys.argv[0] = 'launch'; "
            "runpy.run_module('launch', run_name='__main__')")
    return subprocess.run([sys.executable, "-S", "-c", code, command, "--config", str(ROOT / "configs" /
                           "gpu_longtail.yaml"), *TINY, *files], cwd=work, capture_output=True, text=True, timeout=300)


def test_the_early_wheels_are_all_the_warm_start_needs_of_the_pack(tmp_path):
    early, pack = set(bash_array("EARLY")), set(bash_array("WHEELS"))
    assert early and early <= pack  # each early wheel one the pack brings: the same version on the host
    site = site_without(tmp_path, pack - early)
    for command in ("data", "init-model"):
        done = launch(command, site, tmp_path)
        assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "model" / "config.json").is_file()


def test_without_the_early_wheels_the_data_command_fails(tmp_path):
    done = launch("data", site_without(tmp_path, set(bash_array("WHEELS"))), tmp_path)
    assert done.returncode != 0 and "No module named" in done.stderr
