"""The scaling benchmark's GPU layouts: parsing, and the placement overrides each layout gives the two commands
(or `asyncrl launch`, for a layout under Ray)."""

from __future__ import annotations

import argparse

import pytest

from asyncrl.config import load_config
from asyncrl.placement import check_ray_placement
from scripts import bench_async_vs_sync
from scripts import bench_scaling
from scripts.bench_scaling import Layout


def test_layouts_parse_to_servers_and_learner_ranks():
    assert Layout.parse("3:1") == Layout(3, 1) and Layout.parse("3:1").gpus == 4 and Layout.parse("3:1").name == "3s1l"
    colocated = Layout.parse("colocated")
    assert colocated.colocated and colocated.gpus == 1 and colocated.arguments("auto") == ["--colocated"]
    assert Layout.parse("3:1").arguments("auto") == ["--servers", "3", "--learner-ranks", "1"]
    on_ray = Layout.parse("3:1@ray")
    assert (on_ray.ray, on_ray.gpus, on_ray.name, on_ray.without_ray) == (True, 4, "3s1l-ray", Layout(3, 1))
    assert on_ray.arguments("10.0.0.1:6379") == ["--servers", "3", "--learner-ranks", "1", "--ray-address", "10.0.0.1:6379"]
    for bad in ("3", "a:b", "0:1", "2:0", "colocated@ray", "3:1@slurm"):
        with pytest.raises(argparse.ArgumentTypeError, match=bad):
            Layout.parse(bad)


def test_a_ray_layout_asks_ray_for_as_many_roles_and_gpus_and_passes_the_launch_placement_check(monkeypatch):
    monkeypatch.setattr(bench_async_vs_sync, "visible_gpus", lambda: [0, 1, 2, 3])
    overrides = bench_async_vs_sync.ray_layout(layout_args(servers=1, learner_ranks=2, tensor_parallel=2))
    assert overrides == ["rollout.num_servers=1", "learner.nproc=2", "rollout.engine.tensor_parallel_size=2",
                         "ray.learner.num_gpus=1", "ray.rollout.num_gpus=2"]
    check_ray_placement(load_config("configs/gpu_qwen05b.yaml", overrides))  # no GPU lists, whole GPUs: accepted


def layout_args(**given) -> argparse.Namespace:
    return argparse.Namespace(**({"colocated": False, "mixed": False, "servers": 1, "learner_ranks": 1, "tensor_parallel": 1} | given))


def test_each_role_gets_its_own_gpus_after_the_servers(monkeypatch):
    monkeypatch.setattr(bench_async_vs_sync, "visible_gpus", lambda: list(range(8)))
    assert bench_async_vs_sync.gpu_layout(layout_args(servers=6, learner_ranks=2)) == [
        "rollout.num_servers=6", "learner.nproc=2", "rollout.engine.tensor_parallel_size=1",
        "rollout.gpus=[0,1,2,3,4,5]", "learner.gpus=[6,7]"]
    assert bench_async_vs_sync.gpu_layout(layout_args(servers=6, learner_ranks=2), "sync") == [
        "rollout.num_servers=1", "learner.nproc=1", "rollout.engine.tensor_parallel_size=1",
        "rollout.gpus=[0]", "learner.gpus=[1]"]  # one engine, one rank
    assert bench_async_vs_sync.gpu_layout(layout_args(servers=2, learner_ranks=2, tensor_parallel=2)) == [
        "rollout.num_servers=2", "learner.nproc=2", "rollout.engine.tensor_parallel_size=2",
        "rollout.gpus=[0,1,2,3]", "learner.gpus=[4,5]"]  # each server takes two GPUs
    assert bench_async_vs_sync.gpu_layout(layout_args(colocated=True)) == ["learner.gpus=[0]", "rollout.gpus=[0]"]
    assert bench_async_vs_sync.gpu_layout(layout_args(mixed=True, servers=2)) == [
        "rollout.num_servers=2", "learner.nproc=1", "rollout.engine.tensor_parallel_size=1",
        "rollout.gpus=[0,1]", "learner.gpus=[1]"]  # a server on each GPU, the learner beside the second
    assert bench_async_vs_sync.gpu_layout(layout_args(mixed=True, servers=2), "sync")[-2:] == [
        "rollout.gpus=[0]", "learner.gpus=[1]"]  # the reference keeps its two GPUs
    with pytest.raises(SystemExit, match="need 9 GPUs; 8 are visible"):
        bench_async_vs_sync.gpu_layout(layout_args(servers=8))
    monkeypatch.setattr(bench_async_vs_sync, "visible_gpus", lambda: [])
    assert bench_async_vs_sync.gpu_layout(layout_args(servers=3)) == []  # CPU: the commands place nothing


def test_the_lists_name_the_physical_gpus_the_benchmark_may_see(monkeypatch):
    monkeypatch.setattr(bench_async_vs_sync, "visible_gpus", lambda: [2, 3])  # CUDA_VISIBLE_DEVICES=2,3
    assert bench_async_vs_sync.gpu_layout(layout_args(colocated=True)) == ["learner.gpus=[2]", "rollout.gpus=[2]"]
    assert bench_async_vs_sync.gpu_layout(layout_args())[-2:] == ["rollout.gpus=[2]", "learner.gpus=[3]"]
    with pytest.raises(SystemExit, match="need 3 GPUs; 2 are visible"):
        bench_async_vs_sync.gpu_layout(layout_args(servers=2))


def test_async_figures_stand_without_the_sync_run_and_its_ratios_stay_empty(capsys):
    assert bench_async_vs_sync.against(3.0, 2.0) == 1.5 and bench_async_vs_sync.against(3.0, None) is None
    async_run = {"samples_per_s": 90.0, "trained_tokens_per_s": 15000.0, "staleness_mean": 1.2, "staleness_max": 2,
                 "response_length_mean": 160.0, "trained_vs_generated": 0.99, "groups_dropped_stale": 0,
                 "groups_handed_out": 96, "learner_wait_share": 0.5, "steps": 6}
    entry = bench_async_vs_sync.sweep_entry(bench_async_vs_sync.Run("async", 2), async_run, None)
    assert (entry["samples_per_s"], entry["speedup"], entry["trained_tokens_speedup"], entry["length_ratio"]) == (
        90.0, None, None, None)
    with_sync = bench_async_vs_sync.sweep_entry(bench_async_vs_sync.Run("async", 2), async_run,
                                                {"samples_per_s": 45.0, "trained_tokens_per_s": 6000.0,
                                                 "response_length_mean": 200.0})
    assert (with_sync["speedup"], with_sync["trained_tokens_speedup"], with_sync["length_ratio"]) == (2.0, 2.5, 0.8)
    plain, on_ray = Layout.parse("3:1"), Layout.parse("3:1@ray")
    row = {"sync_samples_per_s": None, "async_vs_sync_speedup": None, "sync_trained_tokens_per_s": None,
           "trained_tokens_speedup": None, "length_ratio": None, "trained_vs_generated": 0.99, "staleness_mean": 1.2,
           "server_pause_ms": 67.0, "sweep": [entry]}
    results = {plain: row | {"async_samples_per_s": 100.0, "async_trained_tokens_per_s": 16000.0},
               on_ray: row | {"async_samples_per_s": 90.0, "async_trained_tokens_per_s": 12000.0}}
    bench_scaling.print_table(results, results[plain])
    lines = capsys.readouterr().out.splitlines()
    # trained tokens first (async, sync, async/sync, vs the first layout), the length columns, then samples/s
    assert lines[1].split()[:10] == ["3s1l", "4", "16000", "-", "-", "1.00x", "-", "0.990", "100.00", "-"]
    assert lines[2].split()[:10] == ["3s1l-ray", "4", "12000", "-", "-", "0.75x", "-", "0.990", "90.00", "-"]
