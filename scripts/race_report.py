"""The race to a score's report on the console and as a plot: the modes side by side with async / sync, the
ceiling's lines, held-out score against wall-clock time (`bench_time_to_score.report`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from scripts.race_figures import Curve, ratio
from scripts.run_records import CEILING


def print_table(figures: dict[str, dict[str, Any]], target: float | None, buckets: tuple[int | None, dict]) -> None:
    """The modes side by side, async / sync where both ran, then the buckets at equal steps."""
    labels = list(figures)
    print(f"target held-out score: {'none (a mode did not improve)' if target is None else f'{target:.3f}'}")
    print(f"{'':34}" + "".join(f"{label:>14}" for label in labels) + ("    async/sync" if len(labels) == 2 else ""))
    rows = [("time to target (s)", "time_to_target_s", True), ("version at target", "version_at_target", False),
            ("start-up: launch to version 0 (s)", "start_up_s", False),
            ("launch to the engine's start (s)", "engine_begins_s", False), ("engine start (s)", "engine_start_s", False),
            ("time to target after start-up (s)", "time_to_target_after_start_up_s", True),
            ("seconds a version, scored span", "time_per_version_s", True),
            ("seconds a step, after the warm-up", "time_per_step_s", True),
            ("trained tokens/s", "trained_tokens_per_s", True), ("generated tokens/s", "generated_tokens_per_s", True),
            ("trained length mean", "trained_length_mean", True),
            ("generated length mean", "generated_length_mean", False), ("trained / generated length", "length_ratio", False),
            ("learner share of a step", "learner_share", False),
            ("host CPU busy over the run", "cpu_busy_share", False),
            ("host CPU stolen (hypervisor)", "cpu_steal_share", False), ("start score", "start_score", False),
            ("best score (seeds' mean)", "best_score", False), ("final score", "final_score", False),
            ("final score sd", "final_score_sd", False), ("last step's record (s)", "last_record_s", False),
            ("runs under CUDA MPS", "runs_under_mps", False),
            ("fewest servers at a timed step", "servers_serving", False)]
    for title, key, compared in rows:
        values = [figures[label][key] for label in labels]
        line = f"{title:34}" + "".join(f"{cell(value):>14}" for value in values)
        if compared and len(labels) == 2:
            speedup = ratio(values[0], values[1]) if key.startswith("time_") else ratio(values[1], values[0])
            line += f"{cell(speedup, 'x'):>14}"
        print(line)
    version, pairs = buckets
    if pairs:
        print(f"held-out score per response-length bucket at version {version} (seeds' mean):")
        for name, pair in pairs.items():
            print(f"  {name + ' tokens':32}{pair['sync']:>14.3f}{pair['async']:>14.3f}{cell(ratio(pair['async'], pair['sync']), 'x'):>14}")


def print_ceiling(ceiling: dict[str, Any]) -> None:
    if ceiling["ceiling_tokens_per_s"] is None:
        print(f"ceiling: not measured (--modes {CEILING})")
        return
    print(f"ceiling, the engine kept full: {ceiling['ceiling_tokens_per_s']:.0f} tokens/s = "
          f"{ceiling['ceiling_speedup']:.3f}x sync's trained tokens/s; async reached "
          f"{ceiling['async_share_of_ceiling']:.3f} of it")
    if ceiling["turns_tokens_per_s"] is not None:
        print(f"generation at the ceiling and sync's training taking turns on the one GPU: "
              f"{ceiling['turns_tokens_per_s']:.0f} tokens/s = {ceiling['turns_speedup']:.3f}x sync's; async reached "
              f"{ceiling['async_share_of_turns']:.3f} of it (above 1: it overlapped the two)")


def cell(value: Any, unit: str = "") -> str:
    if value is None:
        return "-"
    return f"{value:.3f}{unit}" if isinstance(value, float) and unit else str(value)


def plot(curves: dict[str, list[Curve]], means: dict[str, Curve], target: float | None, path: Path) -> None:
    """Held-out score against wall-clock time: every seed thin, each mode's mean thick, the target dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(8, 5))
    for (label, runs), color in zip(curves.items(), ("tab:blue", "tab:orange")):
        for curve in runs:
            axes.plot([t for _, t, _ in curve], [s for _, _, s in curve], color=color, alpha=0.35, linewidth=1)
        axes.plot([t for _, t, _ in means[label]], [s for _, _, s in means[label]], color=color, linewidth=2.5,
                  marker="o", label=f"{label} (mean of {len(runs)} seed{'s' * (len(runs) > 1)})")
    if target is not None:
        axes.axhline(target, color="grey", linestyle="--", linewidth=1, label=f"target {target:.3f}")
    axes.set(xlabel="wall-clock seconds since launch (version made)", ylabel="held-out score (val/score/mean)",
             title="Time to a held-out score")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
