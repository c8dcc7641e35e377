"""Training throughput of the real loop (data loading, DDP-free single process, logging,
all of `transformer.train.main`): steady-state target tokens/s, step time, peak memory, and
on a GPU the model FLOP utilisation against a 790 TFLOP/s bf16 peak.

    python benchmarks/train_throughput.py                   # CPU: smoke, update_freq 1 vs 2
    python benchmarks/train_throughput.py --steps 200       # GPU: base/big, bf16 vs fp32, compile

The corpus (default: Multi30k from ../shared/data/multi30k) goes through the pipeline's own
stages (prepare, clean, learn BPE, shard) once, cached under --work. Each case runs in a
fresh process, so peak memory is its own; the first fifth of the steps (warm-up, allocator
growth, compilation) is left out of the rates.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from transformer.config import Params, load_params  # noqa: E402

PEAK_FLOPS = 790e12  # bf16 dense peak the MFU is measured against
MULTI30K = ROOT.parent / "shared" / "data" / "multi30k"
# name: (params file, overrides). A peer pair differs in one setting, measured side by side.
CPU_CASES = {
    "smoke uf1": ("params/smoke.yaml", ["train.update_freq=1"]),
    "smoke uf2": ("params/smoke.yaml", ["train.update_freq=2"]),
}
GPU_CASES = {
    "base bf16": ("params/base.yaml", ["train.precision=bf16"]),
    "base bf16 compile": ("params/base.yaml", ["train.precision=bf16", "train.compile=true"]),
    "base fp32": ("params/base.yaml", ["train.precision=fp32"]),
    "big bf16": ("params/big.yaml", ["train.precision=bf16"]),
}


def main() -> None:
    args = parse_args()
    if args.case:
        print(json.dumps(run_case(args)))
        return
    cases = GPU_CASES if torch.cuda.is_available() else CPU_CASES
    rows = []
    for name, (params_file, overrides) in cases.items():
        vocab = vocab_size(load_params(ROOT / params_file), torch.cuda.is_available())
        shards = prepare_shards(args.corpus, args.work, vocab)
        rows.append({"case": name, **measure(args, name, params_file, overrides, shards, vocab)})
    print_table(rows, args)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", type=Path, default=MULTI30K, help="text files, en/de")
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "bench")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's)")
    parser.add_argument("--case", help=argparse.SUPPRESS)  # internal: one case, JSON out
    parser.add_argument("--params", help=argparse.SUPPRESS)
    parser.add_argument("--shards", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--overrides", nargs="*", default=[], help=argparse.SUPPRESS)
    return parser.parse_args()


def vocab_size(params: Params, gpu: bool) -> int:
    # Multi30k has ~20k word types: too few for the paper's 37k BPE merges; 8k stands in
    # on GPU (the output layer is then ~5x cheaper than WMT14's), smoke's own size on CPU.
    return min(params.vocab.size, 8000) if gpu else params.vocab.size


# --------------------------------------------------------------------------- data


def prepare_shards(corpus: Path, work: Path, vocab: int) -> Path:
    """corpus -> parquet -> cleaned -> BPE -> shards with the pipeline's functions, cached."""
    from transformer.data.clean import clean_corpus
    from transformer.data.shard import encode_and_shard
    from transformer.data.sources import prepare_source
    from transformer.vocab import learn_vocab

    out = work / f"shards-{corpus.name}-{vocab}"
    if (out / "manifest.json").is_file():
        return out
    params = load_params(
        ROOT / "params/smoke.yaml",
        [
            f"data.source.path={corpus}",
            "data.splits.valid=val",
            "data.splits.test=test_2016_flickr",
            f"vocab.size={vocab}",
        ],
    )
    prepare_source(params.data, work / f"prepared-{corpus.name}")
    clean_corpus(work / f"prepared-{corpus.name}", params.data.clean, work / f"clean-{corpus.name}")
    spm = learn_vocab(
        work / f"clean-{corpus.name}" / "train.parquet",
        params.vocab,
        work / f"vocab-{corpus.name}-{vocab}",
    )
    encode_and_shard(work / f"clean-{corpus.name}", spm, params.shard, out)
    return out


# --------------------------------------------------------------------------- one case


def measure(args, name: str, params_file: str, overrides: list[str], shards: Path, vocab: int):
    """Run one case in a fresh process (its own peak memory) and read its JSON line."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    cmd = [
        sys.executable,
        __file__,
        "--case",
        name,
        "--params",
        params_file,
        "--shards",
        str(shards),
        "--work",
        str(args.work),
        "--steps",
        str(args.steps),
        "--overrides",
        *overrides,
        f"vocab.size={vocab}",
    ]
    done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"case {name} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


class Recorder:
    def __init__(self):
        self.train: list[dict[str, float]] = []

    def log(self, metrics: dict[str, float], step: int) -> None:
        if "train/step_time" in metrics:
            self.train.append(metrics)

    def close(self) -> None:
        pass


def run_case(args) -> dict:
    from transformer.train import main as train_main

    steps, window = args.steps, max(1, args.steps // 10)
    overrides = [
        *args.overrides,
        f"train.max_steps={steps}",
        f"train.log_every={window}",
        f"train.valid_every={steps}",
        f"train.save_every={steps}",
        "train.keep_last=5",
        "average.last_n=1",
        "train.valid_bleu=false",
    ]
    recorder = Recorder()
    with tempfile.TemporaryDirectory(dir=args.work) as run_dir:
        argv = [str(ROOT / args.params), "--data", str(args.shards), "--out", run_dir]
        with open(os.devnull, "w") as quiet:  # the JSON line must be the last of stdout
            stdout, sys.stdout = sys.stdout, quiet
            try:
                rc = train_main([*argv, *overrides], logger=recorder)
            finally:
                sys.stdout = stdout
    if rc != 0:
        raise SystemExit(f"training exited with {rc}")
    steady = recorder.train[len(recorder.train) // 5 :] or recorder.train
    tokens = sum(m["train/tokens_per_update"] for m in steady)
    seconds = sum(m["train/step_time"] for m in steady)
    params = load_params(ROOT / args.params, args.overrides)
    return {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "threads": torch.get_num_threads(),
        "params_m": n_params(params, vocab=params.vocab.size) / 1e6,
        "tokens_per_update": tokens / len(steady),
        "step_time": seconds / len(steady),
        "tokens_per_s": tokens / seconds,
        "flops_per_token": flops_per_target_token(params, args.shards),
        "peak_mem_gb": peak_memory_gb(),
    }


def peak_memory_gb() -> float:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux: RSS


# --------------------------------------------------------------------------- FLOPs


def n_params(params: Params, vocab: int) -> int:
    d, f, n = params.model.d_model, params.model.d_ff, params.model.n_layers
    enc = n * (4 * d * d + 2 * d * f)  # attention in/out projections + FFN (biases left out)
    dec = n * (8 * d * d + 2 * d * f)
    return enc + dec + vocab * d  # one shared embedding matrix


def flops_per_target_token(params: Params, shards: Path) -> float:
    """Training FLOPs (3 x forward matmuls, real tokens only, padding not counted) per
    target token, from the corpus' average lengths: the model's work, not the kernels'."""
    manifest = json.loads((shards / "manifest.json").read_text())["roles"]["train"]
    rows, src, tgt = manifest["rows"], manifest["src_tokens"], manifest["tgt_tokens"]
    ls, lt, ratio = src / rows, tgt / rows, src / tgt
    d, f, n, v = (params.model.d_model, params.model.d_ff, params.model.n_layers, params.vocab.size)
    per_src = n * (2 * (4 * d * d + 2 * d * f) + 4 * ls * d + 2 * 2 * d * d)  # + cross K, V
    per_tgt = n * (2 * (6 * d * d + 2 * d * f) + 4 * lt * d + 4 * ls * d) + 2 * d * v
    return 3.0 * (per_tgt + ratio * per_src)


# --------------------------------------------------------------------------- report


def print_table(rows: list[dict], args) -> None:
    gpu = torch.cuda.is_available()
    head = [
        "case",
        "device",
        "thr",
        "params",
        "tok/update",
        "step s",
        "tgt tok/s",
        "TFLOP/s",
        "MFU",
        "peak mem",
    ]
    lines = [head]
    for r in rows:
        tflops = r["tokens_per_s"] * r["flops_per_token"] / 1e12
        lines.append(
            [
                r["case"],
                r["device"],
                str(r["threads"]),
                f"{r['params_m']:.1f}M",
                f"{r['tokens_per_update']:.0f}",
                f"{r['step_time']:.4f}",
                f"{r['tokens_per_s']:,.0f}",
                f"{tflops:.3f}",
                f"{tflops * 1e12 / PEAK_FLOPS:.1%}" if gpu else "-",
                f"{r['peak_mem_gb']:.2f} GB" + ("" if gpu else " RSS"),
            ]
        )
    widths = [max(len(row[i]) for row in lines) for i in range(len(head))]
    print(f"\n{args.steps} steps per case, the first fifth left out; corpus {args.corpus.name}")
    for row in lines:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)))


if __name__ == "__main__":
    main()
