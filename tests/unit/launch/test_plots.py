"""`asyncrl plot` on synthetic metrics.jsonl files: PNGs written, absent metrics skipped and named."""

import math

import pytest
from matplotlib.image import imread

from launch import cli
from asyncrl.config.sections import MetricsConfig
from asyncrl.metrics import MetricsLogger
from launch.plots import FIGURES, PLOTS_DIR, NoMetricsError, Series, plot_run, points

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
STEPS = 30
VAL_EVERY = 10


def full_record(step: int) -> dict[str, float]:
    return {
        "critic/score/mean": 0.3 + 0.02 * step,
        "staleness/mean": 0.5 + 0.5 * math.sin(step), "staleness/max": 2.0, "staleness/max_staleness": 1.0 + step // 10,
        "rollout_corr/is_weight_mean": 0.98, "rollout_corr/is_clip_frac": 0.01 * (step % 3),
        "rollout_corr/mismatch_kl": 1e-3 * step,
        "rollout/tokens_per_s": 900.0 + step, "learner/tokens_per_s": 1500.0, "buffer/ingest_groups_per_s": 12.0,
        "weight_sync/seconds": 0.2, "weight_sync/transfer_seconds": 0.05, "weight_sync/server_pause_seconds": 0.1,
        "critic/a/score/mean": 0.9, "critic/b/score/mean": 0.01 * step,
        "tasks/a/weight": max(0.1, 0.5 - 0.02 * step), "tasks/b/weight": min(0.9, 0.5 + 0.02 * step),
    }


def write_run(run_dir, records: dict[int, dict[str, float]]) -> None:
    logger = MetricsLogger(run_dir, MetricsConfig(wandb_mode="disabled"))
    for step, values in records.items():
        logger.log(step, values)
    logger.close()


def test_every_figure_is_a_readable_png(tmp_path):
    records = {step: full_record(step) for step in range(1, STEPS + 1)}
    for step in range(VAL_EVERY, STEPS + 1, VAL_EVERY):  # validation arrives a step after its version
        records[step] |= {"val/score/mean": 0.4, "val/pass@4": 0.7, "val/version": float(step - 1),
                          "val/a/score/mean": 0.9, "val/b/score/mean": 0.2}
    write_run(tmp_path, records)
    report = plot_run(tmp_path)
    assert report.missing == []
    assert sorted(p.name for p in report.written) == sorted(spec.filename for spec in FIGURES)
    for path in report.written:
        assert path.parent == tmp_path / PLOTS_DIR
        assert path.read_bytes()[: len(PNG_SIGNATURE)] == PNG_SIGNATURE
        height, width, _ = imread(path).shape
        assert width > 500 and height > 200


def test_validation_points_sit_at_their_policy_version():
    records = [{"step": 11, "val/score/mean": 0.5, "val/version": 10.0}, {"step": 12, "critic/score/mean": 0.1},
               {"step": 13, "val/score/mean": None}, {"step": 20, "val/score/mean": 0.6}]
    assert points(records, Series("val/score/mean", "val", x_key="val/version")) == ([10.0, 20], [0.5, 0.6])


def test_absent_metrics_are_skipped_and_named(tmp_path):
    write_run(tmp_path, {step: {"critic/score/mean": 0.5, "staleness/mean": 1.0, "actor/pg_loss": math.nan}
                         for step in range(1, 4)})
    report = plot_run(tmp_path)
    assert sorted(p.name for p in report.written) == ["reward.png", "staleness.png"]
    assert "val/score/mean" in report.missing and "staleness/max" in report.missing
    assert "rollout_corr/mismatch_kl" in report.missing and "weight_sync/seconds" in report.missing
    assert "critic/score/mean" not in report.missing


def test_missing_or_empty_metrics_file_is_a_clear_error(tmp_path):
    with pytest.raises(NoMetricsError, match="no metrics.jsonl"):
        plot_run(tmp_path)
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(NoMetricsError, match="no records"):
        plot_run(tmp_path)


def test_cli_plot_prints_the_files_and_fails_cleanly(tmp_path, capsys):
    write_run(tmp_path / "run", {1: full_record(1), 2: full_record(2)})
    assert cli.main(["plot", str(tmp_path / "run")]) == 0
    printed = capsys.readouterr()
    assert len(printed.out.split()) == len(FIGURES)
    assert "val/score/mean" in printed.err
    assert cli.main(["plot", str(tmp_path / "nowhere")]) == 1
    assert "no metrics.jsonl" in capsys.readouterr().err
