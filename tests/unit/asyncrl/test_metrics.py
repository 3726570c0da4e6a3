"""The metrics sink writes jsonl (and wandb offline) and keeps non-finite values out of wandb."""

import math

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
