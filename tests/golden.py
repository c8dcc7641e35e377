"""The golden curve: the demo's first 200 updates (params/smoke.yaml cut short, every update
logged) and its validations at updates 100 and 200, on the CPU's fp32 path, against the checked-in
curve tests/assets/losses/smoke.txt, step by step, within LOSS_TOLERANCE and
BLEU_TOLERANCE (tests/test_golden.py; how they were chosen: docs/results/golden.md).

    python -m tests.golden            # train, compare with the file: the steps that moved
    python -m tests.golden --update   # train, rewrite the file

A change that moves the curve beyond the tolerance updates the file in the same commit, and
the commit says why. The trainer is the library's own (transformer.train.main, in this
process); the figures are what it hands its metrics logger, the one MLflow gets in the
pipeline.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "assets" / "losses" / "smoke.txt"
PARAMS = ROOT / "params" / "smoke.yaml"
# The demo's config cut short: its schedule has no cooldown, so nothing depends on max_steps
# and these 200 updates are the demo's first 200; the demo validates at 200 too. A second
# validation, at 100, changes no update (it draws nothing) and holds what only a validation
# after training steps shows (a packed weight kept from the first read stale weights).
OVERRIDES = ["train.max_steps=200", "train.log_every=1", "train.valid_every=100"]
KEYS = ("train/loss", "valid/loss", "valid/bleu")
# How far a loss may be from the file's, relative, up to each step: other kernels (another
# CPU's instruction set, another thread count) round differently, and the curves part more
# the longer they run. The validation BLEU in points. How these were chosen:
# docs/results/golden.md.
LOSS_TOLERANCE = ((25, 1e-4), (50, 1e-3), (75, 1e-2), (200, 1e-1))
BLEU_TOLERANCE = 5.0
# One intra-op thread: the same reductions whatever the machine's cores (2 threads round
# otherwise), and no thread spinning while it waits on a shared machine.
THREADS = 1
UPDATE = "python -m tests.golden --update"


class Recorder:
    """The trainer's metrics-logger protocol: keeps the golden keys by step."""

    def __init__(self):
        self.curve: dict[tuple[int, str], float] = {}

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.curve.update({(step, k): v for k, v in metrics.items() if k in KEYS})

    def close(self) -> None:
        pass


def train_curve(work: Path) -> dict[tuple[int, str], float]:
    """Prepare the smoke corpus and train the golden config in `work`; its curve."""
    from transformer.config import load_params
    from transformer.data.clean import clean_corpus
    from transformer.data.shard import encode_and_shard
    from transformer.data.sources import prepare_source
    from transformer.data.vocab import learn_vocab
    from transformer.train import main as train_main

    overrides = [f"data.source.path={ROOT / 'data' / 'smoke'}", *OVERRIDES]
    params = load_params(PARAMS, overrides)
    prepare_source(params.data, work / "prepare")
    clean_corpus(work / "prepare", params.clean, work / "clean")
    spm_model = learn_vocab(work / "clean" / "train.parquet", params.vocab, work / "vocab")
    encode_and_shard(work / "clean", spm_model, params.shard, work / "shards")
    recorder = Recorder()
    argv = [str(PARAMS), *overrides, "--data", str(work / "shards"), "--out", str(work / "run")]
    if train_main(argv, logger=recorder) != 0:
        raise SystemExit("the golden config did not train to its end (the log above says why)")
    return recorder.curve


def read_curve(path: Path) -> dict[tuple[int, str], float]:
    curve = {}
    for line in path.read_text().splitlines():
        if line and not line.startswith("#"):
            step, key, value = line.split()
            curve[int(step), key] = float(value)
    return curve


def write_curve(curve: dict[tuple[int, str], float], path: Path) -> None:
    lines = [
        f"# step key value: params/smoke.yaml {' '.join(OVERRIDES)} (tests/golden.py)",
        f"# regenerate with `{UPDATE}`, in the commit that moves it, saying why",
        *(f"{step} {key} {value!r}" for (step, key), value in sorted(curve.items())),
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")


def tolerance(step: int, key: str) -> float:
    if key == "valid/bleu":
        return BLEU_TOLERANCE
    return next(tol for last, tol in LOSS_TOLERANCE if step <= last)


def deviation(key: str, got: float, want: float) -> float:
    """How far `got` is from `want`, in the tolerance's unit for `key`."""
    return abs(got - want) if key == "valid/bleu" else abs(got - want) / abs(want)


def moved(got: dict, want: dict) -> list[str]:
    """One line per step and key that moved beyond the tolerance (or is missing)."""
    lines = []
    for (step, key), value in sorted(want.items()):
        new = got.get((step, key))
        if new is None:
            lines.append(f"step {step} {key}: missing (golden {value:.6g})")
        elif not deviation(key, new, value) <= tolerance(step, key):
            unit = "points" if key == "valid/bleu" else "relative"
            lines.append(
                f"step {step} {key}: {new:.6g}, golden {value:.6g} ({new - value:+.3g}, "
                f"{deviation(key, new, value):.2g} {unit} > tolerance {tolerance(step, key):g})"
            )
    lines += [f"step {s} {k}: not in the golden file" for s, k in sorted(got.keys() - want.keys())]
    return lines


def report(got: dict, want: dict) -> str:
    """'' if `got` holds; else the steps that moved and what to do."""
    lines = moved(got, want)
    if not lines:
        return ""
    shown = [*lines[:20], *([f"... and {len(lines) - 20} more"] if len(lines) > 20 else [])]
    return "\n".join([
        f"the golden curve moved ({GOLDEN.relative_to(ROOT)}), at {len(lines)} step(s):",
        *shown,
        f"A change meant to move it: `{UPDATE}`, and commit the file with the change, saying "
        "why (docs/results/golden.md: how the tolerance was chosen).",
    ])  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.golden", description=__doc__)
    parser.add_argument("--update", action="store_true", help="rewrite the golden file")
    parser.add_argument("--work", type=Path, help="work folder (default: a temporary one)")
    parser.add_argument("--out", type=Path, help="also write this run's curve here")
    parser.add_argument("--threads", type=int, default=THREADS, help="torch's intra-op threads")
    parser.add_argument(
        "--onednn",
        action="store_true",
        help="the products a CPU with AVX-512 runs (oneDNN's; cpu_decoding's for few rows), "
        "here: one of the variants the tolerance was measured over",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.onednn:
        from transformer.nn import kernels

        kernels.ONEDNN = True
    with tempfile.TemporaryDirectory(prefix="golden-") as tmp:
        curve = train_curve(args.work or Path(tmp))
    if args.out:
        write_curve(curve, args.out)
    if args.update:
        write_curve(curve, GOLDEN)
        print(f"wrote {GOLDEN.relative_to(ROOT)}: {len(curve)} values")
        return 0
    problem = report(curve, read_curve(GOLDEN))
    print(problem or f"the golden curve holds: {len(curve)} values within the tolerance")
    return 1 if problem else 0


if __name__ == "__main__":
    sys.exit(main())
