"""Pictures of a run, drawn from what MLflow recorded (so any finished run can be redrawn)."""

from __future__ import annotations

from pathlib import Path

import matplotlib
import numpy as np

matplotlib.use("Agg")  # no display on servers and CI
import matplotlib.pyplot as plt
from mlflow.tracking import MlflowClient

from transformer.cli import ArgumentParser

PANELS = (
    ("loss", ("train/loss", "valid/loss")),
    ("learning rate", ("train/lr",)),
    ("valid BLEU", ("valid/bleu",)),
)


def history(client: MlflowClient, run_ids: list[str], key: str) -> tuple[list[int], list[float]]:
    """Steps and values of a metric over one run or several (a training extended by a later
    run: raising train.max_steps resumes it); a step logged twice keeps its last value."""
    metrics = [m for run_id in run_ids for m in client.get_metric_history(run_id, key)]
    by_step = {m.step: m.value for m in sorted(metrics, key=lambda m: m.timestamp)}
    steps = sorted(by_step)
    return steps, [by_step[s] for s in steps]


def add_epoch_axis(ax, steps: list[int], epochs: list[float]) -> None:
    """An epoch scale on top (the step-to-epoch relation the run recorded), if any."""
    if len(steps) < 2:
        return
    # Extended linearly past both ends: np.interp clamps, and would put the labels of epochs
    # the run never reached (60 for a 50.8-epoch run) on its last step, over the last label.
    far = 1e9 * (steps[-1] - steps[0])
    rate = (epochs[-1] - epochs[0]) / (steps[-1] - steps[0])
    s = [steps[0] - far, *steps, steps[-1] + far]
    e = [epochs[0] - far * rate, *epochs, epochs[-1] + far * rate]
    top = ax.secondary_xaxis(
        "top", functions=(lambda x: np.interp(x, s, e), lambda y: np.interp(y, e, s))
    )
    top.set_xlabel("epoch")


def plot_training_curve(client: MlflowClient, run_ids: list[str], out: Path) -> Path:
    """Loss (train and valid), lr and, when recorded, valid BLEU against the step (and the
    epoch, on top), from one run or the runs that trained one model in turn."""
    curves = {k: history(client, run_ids, k) for _, keys in PANELS for k in keys}
    panels = [(title, keys) for title, keys in PANELS if any(curves[k][0] for k in keys)]
    fig, _axes = plt.subplots(1, max(len(panels), 1), figsize=(5 * max(len(panels), 1), 3.6))
    for ax, (title, keys) in zip(list(fig.axes), panels, strict=False):
        for key in keys:
            steps, values = curves[key]
            if steps:
                ax.plot(steps, values, marker="o" if len(steps) < 30 else None, label=key)
        ax.set_xlabel("step")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
        add_epoch_axis(ax, *history(client, run_ids, "train/epoch"))
    names = (f"{client.get_run(run_id).info.run_name} ({run_id[:8]})" for run_id in run_ids)
    fig.suptitle(" + ".join(names))
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> None:
    """python -m tasks.report RUN_ID [RUN_ID ...] --tracking-uri URI --out curve.png"""

    parser = ArgumentParser(description="Draw a run's learning curves from MLflow.")
    parser.add_argument("run_ids", nargs="+", metavar="RUN_ID", help="one run, or several in turn")
    parser.add_argument("--tracking-uri", default="sqlite:///work/mlflow.db")
    parser.add_argument("--out", type=Path, default=Path("curve.png"))
    args = parser.parse_args(argv)
    print(plot_training_curve(MlflowClient(args.tracking_uri), args.run_ids, args.out))


if __name__ == "__main__":
    main()
