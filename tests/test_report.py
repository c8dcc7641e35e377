"""The learning-curve picture's epoch scale (the curve itself is drawn by every flow test)."""

import matplotlib.pyplot as plt
import numpy as np

from tasks.report import add_epoch_axis


def test_the_epoch_axis_follows_the_recorded_step_to_epoch_relation():
    fig, ax = plt.subplots()
    add_epoch_axis(ax, [30, 60, 120], [0.25, 0.5, 1.0])
    (top,) = ax.child_axes
    assert top.get_xlabel() == "epoch"
    to_epoch, to_step = top._functions  # what the tick labels are computed with
    assert np.allclose(to_epoch(np.array([60.0, 90.0])), [0.5, 0.75])
    assert np.allclose(to_step(np.array([1.0])), [120.0])
    plt.close(fig)


def test_no_epoch_axis_without_a_recorded_epoch():
    fig, ax = plt.subplots()
    add_epoch_axis(ax, [], [])
    assert ax.child_axes == []
    plt.close(fig)
