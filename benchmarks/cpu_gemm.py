"""fp32 linear layers on the CPU: torch's default path (F.linear -> its BLAS, MKL in the
PyPI wheels) beside oneDNN (the library torch also ships, and CTranslate2 uses on AMD
CPUs), on the shapes that this project's small models run, in the same process.

    python -m benchmarks.cpu_gemm --threads 1

MKL picks its kernels by CPU vendor; on an AMD CPU it may not run its AVX-512 ones, while
oneDNN does. oneDNN is called here as torch.compile's CPU backend calls it (a weight packed
once by `mkldnn._reorder_linear_weight`, dense input and output). The report gives GFLOP/s
of each and the largest difference between their outputs.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

# (rows, in, out): rows = tokens of a step. Smoke decoding (117 sentences x beam 4: 468
# rows; d_model 128, d_ff 512, vocab 1,000); Multi30k training (2,048 tokens a rank;
# d_model 128, d_ff 256, vocab 8,000).
SHAPES = [
    ("smoke decode, FFN in", 468, 128, 512),
    ("smoke decode, FFN out", 468, 512, 128),
    ("smoke decode, QKV", 468, 128, 384),
    ("smoke decode, vocab", 468, 128, 1000),
    ("multi30k train, FFN in", 2048, 128, 256),
    ("multi30k train, QKV", 2048, 128, 384),
    ("multi30k train, vocab", 2048, 128, 8000),
]


def seconds(fn, budget: float) -> float:
    fn()
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < budget:
        fn()
        n += 1
    return (time.perf_counter() - start) / n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--threads", type=int, help="CPU threads (default: torch's)")
    p.add_argument("--seconds", type=float, default=0.3, help="time spent on each measurement")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if not torch.backends.mkldnn.is_available():
        raise SystemExit("this torch has no oneDNN (mkldnn): nothing to compare")
    blas = "MKL" if torch.backends.mkl.is_available() else "torch's BLAS"
    print(f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads, fp32")
    print(f"{'shape':<24}{'rows x in -> out':>20}{blas + ' GFLOP/s':>16}{'oneDNN GFLOP/s':>16}"
          f"{'ratio':>7}{'max diff':>10}")  # fmt: skip
    g = torch.Generator().manual_seed(0)
    for name, rows, d_in, d_out in SHAPES:
        t_blas, t_dnnl, diff = compare(rows, d_in, d_out, g, args.seconds)
        flops = 2 * rows * d_in * d_out
        print(f"{name:<24}{f'{rows} x {d_in} -> {d_out}':>20}{flops / t_blas / 1e9:>16.0f}"
              f"{flops / t_dnnl / 1e9:>16.0f}{t_blas / t_dnnl:>7.2f}{diff:>10.1e}")  # fmt: skip


def compare(rows: int, d_in: int, d_out: int, g: torch.Generator, budget: float):
    """Seconds of F.linear and of oneDNN's packed linear, and their largest difference."""
    x = torch.randn(rows, d_in, generator=g)
    w, b = torch.randn(d_out, d_in, generator=g) / d_in**0.5, torch.randn(d_out, generator=g)
    packed = torch.ops.mkldnn._reorder_linear_weight(w, rows)
    default = lambda: F.linear(x, w, b)
    dnnl = lambda: torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [], "")
    diff = (default() - dnnl()).abs().max().item()
    return seconds(default, budget), seconds(dnnl, budget), diff


if __name__ == "__main__":
    main()
