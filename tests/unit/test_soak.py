"""The chaos soak's accounting: acknowledged prompts missing from the buffer's log, records logged or trained
twice, memory growth per role, and the processes left behind."""

import json
import subprocess

import psutil
import pytest

from asyncrl.messages import encode
from demo.synthetic import synthetic_group
from buffer.log import SegmentLog
from scripts.soak import MemoryTrace, SeenProcesses, buffer_check, trained_twice
from waiting import wait_until

SEGMENT_BYTES = 1 << 20


def write_log(run_dir, record_ids):
    log = SegmentLog(run_dir / "buffer", SEGMENT_BYTES, "none")
    log.append([encode(synthetic_group(record_id)) for record_id in record_ids])
    log.close()


def test_an_acknowledged_prompt_missing_from_the_log_is_lost_and_a_record_logged_twice_is_duplicated(tmp_path):
    write_log(tmp_path, ["server-0-prompt-0", "server-0-prompt-1", "server-0-prompt-3", "server-0-prompt-3"])
    (tmp_path / "rollout").mkdir()
    # acknowledged: everything below the watermark (0, 1, 2) and 3; drawn but not acknowledged: 4
    state = {"watermark": 3, "acknowledged": [3], "drawn": 5}
    (tmp_path / "rollout" / "server-0.prompts.json").write_text(json.dumps(state))
    assert buffer_check(tmp_path, SEGMENT_BYTES) == (1, 1)  # prompt 2 lost; prompt 3 logged twice


def test_records_trained_twice_are_counted_from_the_steps_that_survived_a_restart(tmp_path):
    records = [{"step": 1, "batch/samples": 8, "buffer/dropped_stale_in_batch": 0},
               {"step": 2, "batch/samples": 8, "buffer/dropped_stale_in_batch": 1},  # rolled back by the restart
               {"step": 2, "batch/samples": 8, "buffer/dropped_stale_in_batch": 0},
               {"step": 3, "batch/samples": 8, "buffer/dropped_stale_in_batch": 0}]  # after the last checkpoint
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
    checkpoint = tmp_path / "checkpoints" / "step_00000002"
    checkpoint.mkdir(parents=True)
    meta = {"step": 2, "buffer_offset": 3, "buffer_ahead": [5]}  # 4 groups of 4 samples consumed
    (checkpoint / "meta.json").write_text(json.dumps(meta))
    assert trained_twice(tmp_path, samples_per_group=4) == 0
    meta["buffer_ahead"] = []  # the position says 3 were consumed, the surviving steps took 4
    (checkpoint / "meta.json").write_text(json.dumps(meta))
    assert trained_twice(tmp_path, samples_per_group=4) == 1


def test_memory_growth_is_the_steepest_slope_of_a_long_enough_life():
    trace = MemoryTrace()
    mb = 2**20
    trace.samples[("server", 1)] = [(0.0, 100 * mb), (1800.0, 110 * mb), (3600.0, 120 * mb)]  # 20 MB/h
    trace.samples[("server", 2)] = [(0.0, 100 * mb), (3600.0, 105 * mb)]  # 5 MB/h
    trace.samples[("buffer", 3)] = [(0.0, 50 * mb), (10.0, 90 * mb)]  # too short a life to tell
    assert trace.growth_mb_per_h(min_life_s=60) == {"server": pytest.approx(20.0)}
    trace.samples[("learner_rank", 4)] = [(0.0, 10 * mb), (60.0, 500 * mb), (3660.0, 501 * mb)]  # loads, then flat
    assert trace.growth_mb_per_h(min_life_s=60, warmup_s=60)["learner_rank"] == pytest.approx(1.0)


def test_a_process_once_seen_below_a_command_is_found_after_its_parent_died():
    # a shell whose child outlives it, as a vLLM engine core without a parent-death signal did (its environment,
    # overwritten by its title, no longer carries the soak's marker)
    command = subprocess.Popen(["bash", "-c", "sleep 600 & echo started; wait"], stdout=subprocess.PIPE, text=True)
    seen = SeenProcesses()
    try:
        assert command.stdout.readline().strip() == "started"
        seen.add_below([command])
        (child,) = psutil.Process(command.pid).children()
        command.kill()
        command.wait()
        assert [process.pid for process in seen.alive()] == [child.pid]
        child.kill()
        wait_until(lambda: not seen.alive(), 10, "the orphan's end")
    finally:
        for process in seen.alive():
            process.kill()
