"""The golden curve holds: the demo's first 200 updates, trained by the library's trainer in a
process of its own, each loss within the tolerance of tests/assets/losses/smoke.txt, and the
validations at updates 100 and 200 too (tests/golden.py; docs/results/golden.md)."""

import golden


def test_the_demo_curve_holds(golden_run):
    problem = golden.report(golden.read_curve(golden_run / "curve.txt"),
                            golden.read_curve(golden.GOLDEN))  # fmt: skip
    assert not problem, problem


def test_a_moved_step_is_named_with_the_way_to_update():
    """What a failure says: which step moved, by how much, against which tolerance, and the
    command that rewrites the file."""
    want = golden.read_curve(golden.GOLDEN)
    got = dict(want)
    got[37, "train/loss"] *= 1 + 2 * golden.tolerance(37, "train/loss")
    got[200, "valid/bleu"] -= golden.BLEU_TOLERANCE + 1
    problem = golden.report(got, want)
    assert "at 2 step(s)" in problem
    assert "step 37 train/loss" in problem and "relative > tolerance" in problem
    assert "step 200 valid/bleu" in problem and "points > tolerance" in problem
    assert "python -m tests.golden --update" in problem
    assert golden.report(want, want) == ""
