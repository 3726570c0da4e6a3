"""PNG plots of a run's metrics.jsonl: reward, staleness, importance weights, throughput, weight-sync time, and
per-task rewards and sampling weights.

Each figure is a list of panels, each panel a list of metric series against the learner step. A series
the run did not log is skipped and named in the report, so a partial run (or one without validation)
still gets every plot it has data for. matplotlib draws through its Agg canvas: no display needed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from asyncrl.metrics import METRICS_FILE, read_metrics

PLOTS_DIR = "plots"  # under the run directory
STEP_KEY = "step"  # x axis of every series unless it names its own
FIGURE_WIDTH_IN = 8.0
PANEL_HEIGHT_IN = 3.0
DPI = 110
MARKER_MAX_POINTS = 40  # series with fewer points get markers, so sparse ones (validation) stay visible


class NoMetricsError(FileNotFoundError):
    """The run directory has no metrics.jsonl, or one with no records."""


@dataclass(frozen=True)
class Series:
    key: str  # metric name in metrics.jsonl
    label: str  # legend entry
    x_key: str = STEP_KEY  # metric giving the x position; records without it fall back to the step


@dataclass(frozen=True)
class SeriesPattern:
    regex: str  # every logged metric whose name matches is a series, labelled by its name
    x_key: str = STEP_KEY  # as Series.x_key


@dataclass(frozen=True)
class Panel:
    ylabel: str
    series: tuple[Series, ...] = ()
    patterns: tuple[SeriesPattern, ...] = ()  # series whose names vary by run (e.g. pass@k for the run's k)


@dataclass(frozen=True)
class FigureSpec:
    filename: str  # PNG written under <run>/plots/
    title: str
    panels: tuple[Panel, ...]


FIGURES = (
    FigureSpec("reward.png", "Reward", (
        Panel("mean reward", (Series("critic/score/mean", "train (batch)"),
                              Series("val/score/mean", "validation", x_key="val/version"))),
        Panel("pass@k (validation)", patterns=(SeriesPattern(r"^val/pass@\d+$", x_key="val/version"),)),
        Panel("mean reward by response tokens (validation)",
              patterns=(SeriesPattern(r"^val/score/bucket/", x_key="val/version"),)),
    )),
    FigureSpec("tasks.png", "Tasks: reward and sampling weight per data source", (
        Panel("mean reward (train batch)", patterns=(SeriesPattern(r"^critic/[^/]+/score/mean$"),)),
        Panel("mean reward (validation)", patterns=(SeriesPattern(r"^val/[^/]+/score/mean$", x_key="val/version"),)),
        Panel("sampling weight", patterns=(SeriesPattern(r"^tasks/[^/]+/weight$"),)),
    )),
    FigureSpec("staleness.png", "Staleness of trained samples (learner version − oldest token version)", (
        Panel("versions", (Series("staleness/mean", "mean"), Series("staleness/max", "max"),
                           Series("staleness/max_staleness", "bound K (buffer.max_staleness)"))),
    )),
    FigureSpec("importance_weights.png", "Off-policy correction", (
        Panel("mean IS weight", (Series("rollout_corr/is_weight_mean", "is_weight_mean"),)),
        Panel("share of tokens clipped", (Series("rollout_corr/is_clip_frac", "is_clip_frac"),)),
        Panel("KL(behaviour ‖ learner)", (Series("rollout_corr/mismatch_kl", "mismatch_kl"),)),
    )),
    FigureSpec("throughput.png", "Throughput per role", (
        Panel("tokens/s", (Series("rollout/tokens_per_s", "rollout servers (generated)"),
                           Series("learner/tokens_per_s", "learner (trained)"))),
        Panel("groups/s", (Series("buffer/ingest_groups_per_s", "buffer ingest"),)),
    )),
    FigureSpec("weight_sync.png", "Weight sync", (
        Panel("seconds", (Series("weight_sync/seconds", "round (learner)"),
                          Series("weight_sync/transfer_seconds", "broadcast"),
                          Series("weight_sync/server_pause_seconds", "longest server pause"))),
    )),
)


@dataclass
class PlotReport:
    written: list[Path] = field(default_factory=list)  # PNG files
    missing: list[str] = field(default_factory=list)  # metrics named by a figure but absent from the run


def plot_run(run_dir: str | Path, figures: Sequence[FigureSpec] = FIGURES) -> PlotReport:
    """Render every figure that has data into `<run_dir>/plots/`."""
    records = load_records(Path(run_dir))
    out_dir = Path(run_dir) / PLOTS_DIR
    out_dir.mkdir(exist_ok=True)
    logged = {key for record in records for key, value in record.items() if value is not None}
    report = PlotReport()
    for spec in figures:
        panels = [(panel, found) for panel in spec.panels if (found := _present_series(panel, logged, report))]
        if panels:
            report.written.append(_render(spec, panels, records, out_dir / spec.filename))
    return report


def load_records(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / METRICS_FILE
    if not path.is_file():
        raise NoMetricsError(f"no {METRICS_FILE} in {run_dir}: is it a run directory (see `RUN_DIR` printed by asyncrl run)?")
    records = read_metrics(run_dir)
    if not records:
        raise NoMetricsError(f"{path} holds no records yet: the learner logs one per step")
    return records


def points(records: Sequence[dict[str, Any]], series: Series) -> tuple[list[float], list[float]]:
    """(x, y) of every record that logged the series with a finite value."""
    xs, ys = [], []
    for record in records:
        value = record.get(series.key)
        if value is None:
            continue
        x = record.get(series.x_key)
        xs.append(x if x is not None else record[STEP_KEY])
        ys.append(value)
    return xs, ys


def _present_series(panel: Panel, logged: set[str], report: PlotReport) -> list[Series]:
    """The panel's series the run logged; the absent fixed ones are added to the report."""
    present = [series for series in panel.series if series.key in logged]
    report.missing += [series.key for series in panel.series if series.key not in logged]
    for pattern in panel.patterns:
        present += [Series(key, key, pattern.x_key) for key in sorted(logged) if re.match(pattern.regex, key)]
    return present


def _render(spec: FigureSpec, panels: list[tuple[Panel, list[Series]]], records: Sequence[dict[str, Any]], path: Path) -> Path:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(FIGURE_WIDTH_IN, PANEL_HEIGHT_IN * len(panels)), dpi=DPI, layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
    for ax, (panel, present) in zip(axes, panels):
        for series in present:
            xs, ys = points(records, series)
            ax.plot(xs, ys, label=series.label, marker="o" if len(xs) < MARKER_MAX_POINTS else None, markersize=3)
        ax.set_ylabel(panel.ylabel)
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize="small")
    axes[-1].set_xlabel("learner step (policy version)")
    figure.suptitle(spec.title)
    figure.savefig(path)
    return path
