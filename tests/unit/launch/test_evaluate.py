"""`asyncrl evaluate` around its engines: which snapshots of a run are left to score, how they are dealt out to
several engines, each engine's part of the GPU memory, the runs it refuses to score together (each refusal naming
what is wrong), the order several engines start and close in (vLLM's start breaks when another engine frees
memory meanwhile) and the snapshots --drop-scored deletes, with stand-ins for the engine."""

import json
import threading
from pathlib import Path

import pytest

from asyncrl.config import load_config, save_config
from asyncrl.memory_plan import MemoryPlanRefused
from asyncrl.snapshots import EVALUATION_FILE, INDEX_FILE, SNAPSHOTS_DIR, read_evaluation, snapshot_path
from launch.commands.evaluate import (Place, StartOrder, Work, engine_count, engine_mismatch, engine_places,
                                      memory_part, queues_by_gpu, read_run, score_all, start_in_turn, work_items)

GIB = 2**30
VALIDATED = ["data.val_files=[v.parquet]", "validation.every=2", "validation.after_run=true",
             "learner.mode=synchronous"]


def run_dir(root: Path, name: str, made: list[int], scored: list[int] = (), *overrides: str) -> Path:
    directory = root / name
    save_config(load_config(None, [*VALIDATED, *overrides]), directory)
    (directory / SNAPSHOTS_DIR).mkdir()
    (directory / SNAPSHOTS_DIR / INDEX_FILE).write_text("".join(
        json.dumps({"version": v, "made_at": 100.0 + v}) + "\n" for v in made))
    (directory / EVALUATION_FILE).write_text("".join(json.dumps({"version": v}) + "\n" for v in scored))
    return directory


def test_only_the_snapshots_not_scored_yet_are_left(tmp_path):
    directory = run_dir(tmp_path, "a", made=[0, 2, 4, 5], scored=[0, 2])
    for version in (4, 5):
        snapshot_path(directory, version).write_bytes(b"weights")
    run = read_run(directory)
    assert (run.pending, run.lost) == ([4, 5], [])


def test_a_version_with_no_score_and_no_file_is_lost_not_pending(tmp_path):
    # records restored on another host: versions 0 and 2 scored, 4 and 6 not, and only 6's file came along
    directory = run_dir(tmp_path, "restored", made=[0, 2, 4, 6], scored=[0, 2])
    snapshot_path(directory, 6).write_bytes(b"weights")
    run = read_run(directory)
    assert (run.pending, run.lost) == ([6], [4])
    assert [version for _, version in work_items([run])] == [6]  # no engine tries the file that is gone


def test_a_directory_without_a_config_or_without_snapshots_is_refused_by_name(tmp_path):
    with pytest.raises(SystemExit, match="no config.yaml"):
        read_run(tmp_path)
    with pytest.raises(SystemExit, match="validation.after_run=true"):
        read_run(run_dir(tmp_path, "b", made=[]))


def test_runs_share_one_engine_unless_an_engine_setting_differs(tmp_path):
    first = read_run(run_dir(tmp_path, "sync", made=[0]))
    lowered = read_run(run_dir(tmp_path, "async", [0], [], "rollout.engine.gpu_memory_utilization=0.4"))
    other_model = read_run(run_dir(tmp_path, "other", [0], [], "model.dtype=bfloat16"))
    assert engine_mismatch([first, lowered]) is None  # a memory share a plan lowered: the evaluator runs alone
    problem = engine_mismatch([first, lowered, other_model])
    assert "differ in model" in problem and "other" in problem


def test_the_runs_snapshots_are_taken_in_turn_each_once_by_whichever_engine_asks_first(tmp_path):
    sync = run_dir(tmp_path, "sync", made=[0, 2, 4, 6], scored=[0])  # pending 2, 4, 6
    async_ = run_dir(tmp_path, "async", made=[0, 2, 4])  # pending 0, 2, 4
    for directory, version in ((sync, 2), (sync, 4), (sync, 6), (async_, 0), (async_, 2), (async_, 4)):
        snapshot_path(directory, version).write_bytes(b"w" * 10)
    runs = [read_run(sync), read_run(async_)]
    assert [(directory.name, version) for directory, version in work_items(runs)] == [
        ("sync", 2), ("async", 0), ("sync", 4), ("async", 2), ("sync", 6), ("async", 4)]  # the runs side by side
    work = Work.of(runs)
    assert work.snapshot_bytes == 10
    # a slow engine and a fast one (four snapshots while the slow one scores one) share the work: each snapshot is
    # scored once, the fast engine takes more, and both stop once none is left
    taken: dict[str, list[int]] = {"slow": [], "fast": []}
    slow_took_one, slow_may_go_on = threading.Event(), threading.Event()

    def engine(name: str) -> None:
        while (item := work.take()) is not None:
            taken[name].append(item[1])
            if name == "slow":
                slow_took_one.set()
                slow_may_go_on.wait(10)

    slow = threading.Thread(target=engine, args=("slow",))
    slow.start()
    assert slow_took_one.wait(10)
    engine("fast")
    slow_may_go_on.set()
    slow.join(10)
    assert taken == {"slow": [2], "fast": [0, 4, 2, 6, 4]}
    assert work.take() is None
    assert Work.of([read_run(run_dir(tmp_path, "done", made=[0], scored=[0]))]).items == []


def test_engines_sharing_a_gpu_split_its_memory_share_and_a_bad_count_is_refused(tmp_path):
    config = load_config(None, ["rollout.engine.gpu_memory_utilization=0.8"])
    assert memory_part(config, 4).rollout.engine.gpu_memory_utilization == pytest.approx(0.2)
    assert memory_part(config, 4).rollout.engine.max_model_len == config.rollout.engine.max_model_len
    assert config.rollout.engine.gpu_memory_utilization == 0.8  # the run's own config is left as it was
    # on a known card each engine's share leaves room for what it holds beyond it: the four engines, each with 2 GiB
    # beyond (its contexts, the weight buffer it maps), hold together what one engine alone would: 0.8 x 80 + 2 GiB
    part = memory_part(config, 4, held_beyond=2 * GIB, card=80 * GIB).rollout.engine.gpu_memory_utilization
    assert part == pytest.approx(0.2 - 3 * 2 / (4 * 80))
    assert 4 * (part * 80 + 2) == pytest.approx(0.8 * 80 + 2)
    assert memory_part(config, 1, 2 * GIB, 80 * GIB).rollout.engine.gpu_memory_utilization == 0.8  # one: as it was
    with pytest.raises(MemoryPlanRefused, match="40 engines on one GPU of 80.0 GiB.*fewer engines"):
        memory_part(config, 40, 2 * GIB, 80 * GIB)
    assert engine_count("3") == 3
    for bad in ("0", "-1", "two"):
        with pytest.raises(SystemExit, match="--engines"):
            engine_count(bad)


def test_engines_are_dealt_out_over_the_gpus_each_splitting_only_its_own_gpus_memory():
    one_gpu_engines = load_config(None, [])
    assert engine_places(4, [0, 1], one_gpu_engines) == [Place(0, 2), Place(1, 2), Place(0, 2), Place(1, 2)]
    assert engine_places(3, [2, 5], one_gpu_engines) == [Place(2, 2), Place(5, 1), Place(2, 2)]
    assert engine_places(2, [0, 1, 2, 3], one_gpu_engines) == [Place(0, 1), Place(1, 1)]  # no GPU holds two
    everywhere = [Place(None, 3)] * 3  # every engine sees every GPU this command sees, and splits them three ways
    assert engine_places(3, [0], one_gpu_engines) == everywhere
    assert engine_places(3, [], one_gpu_engines) == everywhere  # no GPU (CPU engines)
    assert engine_places(3, [0, 1], load_config(None, ["rollout.engine.tensor_parallel_size=2"])) == everywhere
    assert queues_by_gpu(["e0", "e1", "e2", "e3"], [Place(0, 2), Place(1, 2), Place(0, 2), Place(1, 2)]) == [
        ["e0", "e2"], ["e1", "e3"]]  # each GPU's engines start one after the other, the GPUs side by side
    assert queues_by_gpu(["e0", "e1", "e2"], everywhere) == [["e0", "e1", "e2"]]


def test_each_engine_starts_once_the_one_before_has_started_or_died_and_all_are_told_when_the_last_has():
    events: list[str] = []
    orders = [StartOrder(threading.Event(), threading.Event()) for _ in range(3)]
    all_started = threading.Event()

    def engine(number: int) -> None:
        orders[number].turn.wait()
        events.append(f"turn {number}")
        if number != 1:  # engine 1 dies while it starts: it never says it started
            events.append(f"started {number}")
            orders[number].started.set()

    threads = [threading.Thread(target=engine, args=(number,)) for number in range(3)]
    for thread in threads:
        thread.start()
    start_in_turn([[(thread.is_alive, order) for thread, order in zip(threads, orders)]], all_started)
    assert all_started.is_set()
    assert events == ["turn 0", "started 0", "turn 1", "turn 2", "started 2"]


def test_engines_on_gpus_of_their_own_start_at_once_and_all_are_told_only_when_every_queue_has_started():
    orders = {name: StartOrder(threading.Event(), threading.Event()) for name in ("a0", "a1", "b0")}
    all_started = threading.Event()
    queues = [[(lambda: True, orders["a0"]), (lambda: True, orders["a1"])], [(lambda: True, orders["b0"])]]
    starting = threading.Thread(target=start_in_turn, args=(queues, all_started))
    starting.start()
    assert orders["a0"].turn.wait(5) and orders["b0"].turn.wait(5)  # each queue's first at once
    assert not orders["a1"].turn.is_set()  # behind a0, on its GPU
    orders["b0"].started.set()
    orders["a0"].started.set()
    assert orders["a1"].turn.wait(5) and not all_started.is_set()  # a1 still starting
    orders["a1"].started.set()
    starting.join(timeout=10)
    assert all_started.is_set()


def test_an_engine_closes_only_once_every_engine_has_started_after_its_share_or_an_error(tmp_path, monkeypatch):
    from rollout_servers import reference_sampler, validation

    events: list[str] = []

    class StandInSampler:
        tokenizer = None

        @classmethod
        def start(cls, config, gpus, backend):
            events.append("started")
            return cls()

        def close(self):
            events.append("closed")

    def prompts_missing(config, tokenizer):
        raise FileNotFoundError("v.parquet")

    monkeypatch.setattr(reference_sampler, "ReferenceSampler", StandInSampler)
    monkeypatch.setattr(validation, "load_validation_prompts", prompts_missing)
    directory = run_dir(tmp_path, "sync", made=[0, 2])
    for version in (0, 2):
        snapshot_path(directory, version).write_bytes(b"weights")
    runs = [read_run(directory)]
    all_started = threading.Event()
    scoring = threading.Thread(target=lambda: pytest.raises(FileNotFoundError, score_all, runs, 2,
                                                            lambda: events.append("told"), all_started.wait))
    scoring.start()
    scoring.join(timeout=2)
    assert scoring.is_alive() and events == ["started", "told"]  # failed, and holds its engine (and its memory)
    all_started.set()
    scoring.join(timeout=10)
    assert not scoring.is_alive() and events == ["started", "told", "closed"]


@pytest.mark.parametrize("drop_scored", [False, True])
def test_drop_scored_deletes_each_snapshot_once_its_score_is_written(tmp_path, monkeypatch, drop_scored):
    import torch

    from rollout_servers import reference_sampler, validation

    directory = run_dir(tmp_path, "sync", made=[0, 2, 4], scored=[0])  # version 0 scored by an earlier call
    for version in (0, 2, 4):
        torch.save([("w", torch.full((2,), float(version)))], snapshot_path(directory, version))
    loaded = []

    class StandInSampler:
        tokenizer = None

        @classmethod
        def start(cls, config, gpus, backend):
            return cls()

        def load_weights(self, version, weights):
            loaded.append(float(weights[0][1][0]))

        def score(self, validator):
            scored_before = [v for v in (2, 4) if v in read_evaluation(directory)]
            # the snapshot scored before this one is gone by now when dropping; this one's file is still there
            assert all(snapshot_path(directory, v).exists() != drop_scored for v in scored_before)
            return {"val/score/mean": loaded[-1] / 10}

        def close(self):
            pass

    monkeypatch.setattr(reference_sampler, "ReferenceSampler", StandInSampler)
    monkeypatch.setattr(validation, "load_validation_prompts", lambda config, tokenizer: [])
    score_all([read_run(directory)], drop_scored=drop_scored)
    assert loaded == [2.0, 4.0]  # the pending versions only
    assert {v: r.get("val/score/mean") for v, r in read_evaluation(directory).items()} == {0: None, 2: 0.2, 4: 0.4}
    assert [snapshot_path(directory, v).exists() for v in (0, 2, 4)] == [True, not drop_scored, not drop_scored]
    assert read_run(directory).pending == []  # a dropped version counts as scored, never as missing
