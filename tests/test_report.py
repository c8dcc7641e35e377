"""The learning-curve picture's epoch scale and its history over runs (the curve itself is
drawn by every flow test)."""

import matplotlib.pyplot as plt
import numpy as np
from mlflow.tracking import MlflowClient

from tasks.report import add_epoch_axis, history, main


def test_the_epoch_axis_follows_the_recorded_step_to_epoch_relation():
    fig, ax = plt.subplots()
    add_epoch_axis(ax, [30, 60, 120], [0.25, 0.5, 1.0])
    (top,) = ax.child_axes
    assert top.get_xlabel() == "epoch"
    to_epoch, to_step = top._functions  # what the tick labels are computed with
    assert np.allclose(to_epoch(np.array([60.0, 90.0])), [0.5, 0.75])
    assert np.allclose(to_step(np.array([1.0])), [120.0])
    # past the run's last epoch, a tick lands past its last step (not on it, over its label)
    assert np.allclose(to_step(np.array([2.0])), [240.0])
    assert np.allclose(to_epoch(np.array([0.0])), [0.0])
    plt.close(fig)


def test_no_epoch_axis_without_a_recorded_epoch():
    fig, ax = plt.subplots()
    add_epoch_axis(ax, [], [])
    assert ax.child_axes == []
    plt.close(fig)


def test_a_training_extended_by_a_later_run_is_one_curve(tmp_path):
    """Raising train.max_steps resumes the training in a new MLflow run: the curve joins
    them, and a step both logged keeps the later value."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    experiment = client.create_experiment("e")
    first, second = (client.create_run(experiment).info.run_id for _ in range(2))
    for step, value in ((10, 3.0), (20, 2.0)):
        client.log_metric(first, "train/loss", value, step=step, timestamp=step)
    for step, value in ((20, 1.9), (30, 1.5)):
        client.log_metric(second, "train/loss", value, step=step, timestamp=100 + step)
    assert history(client, [first, second], "train/loss") == ([10, 20, 30], [3.0, 1.9, 1.5])
    main([first, second, "--tracking-uri", uri, "--out", str(tmp_path / "curve.png")])
    assert (tmp_path / "curve.png").stat().st_size > 0
