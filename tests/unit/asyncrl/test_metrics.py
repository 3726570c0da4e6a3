"""The metrics sink writes jsonl (and wandb offline) and keeps non-finite values out of wandb."""

import json
import math
import struct

from asyncrl.config.sections import MetricsConfig
from asyncrl.metrics import MetricsLogger, read_metrics, step_records


def test_records_land_in_jsonl_in_order(tmp_path):
    logger = MetricsLogger(tmp_path, MetricsConfig(wandb_mode="disabled"))
    logger.log(1, {"actor/pg_loss": 0.5, "critic/score/mean": 0.25})
    logger.log(2, {"actor/pg_loss": math.nan})
    logger.close()
    records = read_metrics(tmp_path)
    assert [(r["step"], r["actor/pg_loss"]) for r in records] == [(1, 0.5), (2, None)]
    assert records[0]["critic/score/mean"] == 0.25


def test_step_records_leave_out_the_records_of_extra_validation_passes(tmp_path):
    logger = MetricsLogger(tmp_path, MetricsConfig(wandb_mode="disabled"))
    logger.log(1, {"timing_s/step": 2.0})
    logger.log(2, {"val/score/mean": 0.4, "val/version": 0.0})  # an older pass that arrived with step 2's
    logger.log(2, {"timing_s/step": math.inf, "val/score/mean": 0.5, "val/version": 2.0})
    logger.close()
    records = read_metrics(tmp_path)
    assert [(r["step"], r.get("val/version")) for r in step_records(records)] == [(1, None), (2, 2.0)]
    assert [r["val/version"] for r in records if "val/version" in r] == [0.0, 2.0]


def test_torn_last_line_is_ignored(tmp_path):
    logger = MetricsLogger(tmp_path, MetricsConfig(wandb_mode="disabled"))
    logger.log(1, {"a": 1.0})
    logger.close()
    with (tmp_path / "metrics.jsonl").open("a") as handle:
        handle.write('{"step": 2, "a"')
    assert [r["step"] for r in read_metrics(tmp_path)] == [1]


def test_wandb_runs_offline_without_api_key(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    logger = MetricsLogger(tmp_path, MetricsConfig(wandb_mode="auto"), {"run": {"seed": 1}})
    logger.log(1, {"a": 1.0, "b": math.inf})
    logger.close()
    assert list(tmp_path.glob("wandb/offline-run-*"))


def test_wandb_keeps_every_validation_pass_on_its_version(tmp_path):
    logger = MetricsLogger(tmp_path, MetricsConfig(wandb_mode="offline"))
    logger.log(1, {"timing_s/step": 2.0, "actor/pg_loss": 0.5, "b": math.inf})
    logger.log(2, {"val/score/mean": 0.4, "val/version": 0.0})  # an older pass that arrived with step 2's
    logger.log(2, {"timing_s/step": 1.0, "val/score/mean": 0.5, "val/version": 2.0})
    logger.close()
    rows, axes = _offline_history_and_axes(tmp_path)
    assert [(row["step"], row.get("val/version"), row.get("val/score/mean")) for row in rows] == [
        (1, None, None), (2, 0, 0.4), (2, 2, 0.5)]
    assert "b" not in rows[0]
    assert axes == {"timing_s/step": "step", "actor/pg_loss": "step", "val/score/mean": "val/version"}


def _offline_history_and_axes(run_dir):
    """The history rows and each defined metric's step metric, read from the offline run's transaction log: a 7-byte
    file header, then records in 32 KiB blocks, each cut into chunks with a header (crc32, length, type) of 7 bytes."""
    from wandb.proto import wandb_internal_pb2

    (log_path,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    data = log_path.read_bytes()
    block, position, payload = 32768, 7, b""
    rows, axes = [], {}
    while position + 7 <= len(data):
        if block - position % block < 7:  # a block's tail too short for a chunk header is padding
            position += block - position % block
            continue
        _, length, chunk_type = struct.unpack("<IHB", data[position:position + 7])
        payload += data[position + 7:position + 7 + length]
        position += 7 + length
        if chunk_type in (1, 4):  # a whole record, or the last chunk of one
            record = wandb_internal_pb2.Record.FromString(payload)
            payload = b""
            if record.HasField("history"):
                items = {item.key or ".".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item}
                rows.append({key: value for key, value in items.items() if not key.startswith("_")})
            if record.HasField("metric"):
                axes[record.metric.name] = record.metric.step_metric
    return rows, axes
