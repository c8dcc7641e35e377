"""Training throughput of the real loop (all of `python -m transformer.train` in one process: data
loading, the step, logging): steady-state target tokens/s, step time, peak memory, and on a
GPU the model FLOP utilisation against a 790 TFLOP/s bf16 peak.

    python -m benchmarks.train_throughput                      # CPU: smoke, 1 vs 2 passes
    python -m benchmarks.train_throughput --steps 200          # GPU: base/big, bf16/fp32, compile
    python -m benchmarks.train_throughput --corpus synthetic   # anywhere: no corpus needed

The corpus goes through the pipeline's own stages once, cached under --work: Multi30k (the
default, ../shared/data/multi30k) through prepare, clean, BPE and shard; `synthetic` is
random words with WMT-like lengths (lognormal, mean ~27, at most 250 per side) and a
word-level vocabulary of the params' vocab.size (37k for base and big: WMT14's output
layer), sharded by the same encode_and_shard. Each case runs in a fresh process, so peak
memory is its own, under transformer.nn.attention's kernels; the first fifth of the steps
(warm-up, allocator growth, compilation) is left out of the rates. A case's result keeps the
run's own log lines about compiling and counts torch's recompilation lines.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import sentencepiece as spm
import torch

from benchmarks.measure import PEAK_TFLOPS, print_columns
from transformer.config import Params, ShardConfig, load_params
from transformer.tokens import BOS, EOS, PAD, UNK

ROOT = Path(__file__).resolve().parents[1]
MULTI30K = ROOT.parent / "shared" / "data" / "multi30k"
# name: (params file, overrides). A peer pair differs in one setting, measured side by side.
CPU_CASES = {
    "smoke 1 pass": ("params/smoke.yaml", ["train.batch_tokens=2048", "train.max_tokens=2048"]),
    "smoke 2 passes": ("params/smoke.yaml", ["train.batch_tokens=2048", "train.max_tokens=1024"]),
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
    gpu = torch.cuda.is_available()
    rows = []
    for name, (params_file, overrides) in (GPU_CASES if gpu else CPU_CASES).items():
        params = load_params(ROOT / params_file, overrides)
        if args.corpus == "synthetic":
            vocab = params.vocab.size
            shards = synthetic_shards(args.work, vocab, args.pairs)
        else:
            vocab = vocab_size(params, gpu)
            shards = prepare_shards(Path(args.corpus), args.work, vocab)
        overrides = [*overrides, f"vocab.size={vocab}"]
        result = measure(name, params_file, overrides, shards, args.steps, args.work, args.threads)
        rows.append({"case": name, **result})
    print_table(rows, args)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", default=str(MULTI30K), help="text files en/de, or synthetic")
    parser.add_argument("--pairs", type=int, default=100_000, help="synthetic corpus size")
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
    from transformer.data.vocab import learn_vocab

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
    prepared, clean = work / f"prepared-{corpus.name}", work / f"clean-{corpus.name}"
    prepare_source(params.data, prepared)
    clean_corpus(prepared, params.clean, clean)
    vocab_dir = work / f"vocab-{corpus.name}-{vocab}"
    encode_and_shard(
        clean, learn_vocab(clean / "train.parquet", params.vocab, vocab_dir), params.shard, out
    )
    return out


def synthetic_shards(work: Path, vocab: int, pairs: int, max_len: int = 250, seed: int = 1):
    """Shards of a random-word corpus (see the module docstring), cached under `work`."""
    from transformer.data.shard import encode_and_shard

    out = Path(work) / f"shards-synthetic-{vocab}-{pairs}-{max_len}"
    if (out / "manifest.json").is_file():
        return out
    clean = Path(work) / f"clean-synthetic-{vocab}-{pairs}-{max_len}"
    synthetic_corpus(clean, vocab, pairs, max_len, seed)
    words = word_vocab(clean / "train.parquet", vocab, clean / "spm.model")
    workers = 1 if pairs < 10_000 else 0  # a pool costs more than it saves on a toy corpus
    encode_and_shard(clean, words, ShardConfig(workers=workers), out)
    return out


def synthetic_corpus(clean: Path, vocab: int, pairs: int, max_len: int, seed: int) -> None:
    """{train,valid,test}.parquet of random words: source lengths lognormal (mean ~27), the
    target/source ratio lognormal around 1, both clipped to [1, max_len]."""
    rng = np.random.default_rng(seed)
    words = np.array([f"w{i}" for i in range(vocab)])  # a few more than the vocab has room for
    clean.mkdir(parents=True, exist_ok=True)
    for role, n in (("train", pairs), ("valid", max(16, pairs // 100)), ("test", 16)):
        src_len = np.clip(np.round(rng.lognormal(3.12, 0.6, n)), 1, max_len).astype(int)
        tgt_len = np.clip(np.round(src_len * rng.lognormal(0.0, 0.15, n)), 1, max_len)
        side = lambda lens: [" ".join(rng.choice(words, int(m))) for m in lens]
        table = pa.table({"src": side(src_len), "tgt": side(tgt_len)})
        pq.write_table(table, clean / f"{role}.parquet")


def word_vocab(train: Path, vocab: int, out: Path) -> Path:
    """A word-level sentencepiece model with the project's special ids: one piece a word,
    so the lengths drawn are the lengths the model sees."""
    table = pq.read_table(train)
    sentences = iter([*table.column("src").to_pylist(), *table.column("tgt").to_pylist()])
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=sentences,
        model_writer=model,
        model_type="word",
        vocab_size=vocab,
        hard_vocab_limit=False,
        pad_id=PAD,
        unk_id=UNK,
        bos_id=BOS,
        eos_id=EOS,
        minloglevel=2,
    )
    out.write_bytes(model.getvalue())
    return out


# --------------------------------------------------------------------------- one case


def measure(
    name: str,
    params_file: str,
    overrides: list[str],
    shards: Path,
    steps: int,
    work: Path,
    threads: int = 0,
    cpu: bool = False,
    timeout: float | None = None,
) -> dict:
    """Run one case in a fresh process (its own peak memory) and read its JSON line;
    `cpu`: hide the GPUs from it; `timeout`: seconds, then the case fails."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    if cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    env.setdefault("TORCH_LOGS", "recompiles")  # torch.compile's, counted on a timeout
    cmd = [sys.executable, "-m", "benchmarks.train_throughput", "--case", name]
    cmd += ["--params", params_file]
    cmd += ["--shards", str(shards), "--work", str(work), "--steps", str(steps)]
    cmd += ["--overrides", *overrides]
    Path(work).mkdir(parents=True, exist_ok=True)
    try:
        done = subprocess.run(
            cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired as err:
        raise RuntimeError(
            f"case {name} did not finish in {timeout:.0f} s: {progress(err.stderr)}"
        ) from None
    if done.returncode != 0:
        raise RuntimeError(
            f"case {name} failed: {cause(done.stderr)}\n{done.stdout[-3000:]}\n"
            f"{done.stderr[-3000:]}"
        )
    return {
        **json.loads(done.stdout.strip().splitlines()[-1]),
        "recompiles_logged": done.stderr.count(RECOMPILE),
    }


def cause(stderr: str) -> str:
    """A failed case's reason in a line: the trainer's "error: ..." line, else the last line
    (a traceback's exception)."""
    lines = stderr.strip().splitlines() or ["no output"]
    return next((x for x in reversed(lines) if x.startswith("error")), lines[-1])[:300]


PROGRESS = "progress:"  # a case's stderr line per logging window: what a timeout leaves
RECOMPILE = "Recompiling function"  # torch's TORCH_LOGS=recompiles line


class Recorder:
    def __init__(self):
        self.train: list[dict[str, float]] = []

    def log(self, metrics: dict[str, float], step: int) -> None:
        if "train/step_time" in metrics:
            self.train.append(metrics)
            print(PROGRESS, step, metrics["train/step_time"], file=sys.stderr, flush=True)

    def close(self) -> None:
        pass


def run_case(args) -> dict:
    from transformer.nn.attention import attention_context
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
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with tempfile.TemporaryDirectory(dir=args.work) as run_dir, attention_context(device):
        argv = [str(ROOT / args.params), "--data", str(args.shards), "--out", run_dir]
        # The run's log (transformer's logging writes to sys.stdout) is kept, not printed:
        # the JSON line must be the last of stdout.
        with contextlib.redirect_stdout(io.StringIO()) as log:
            rc = train_main([*argv, *overrides], logger=recorder)
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
        "compile_log": compile_lines(log.getvalue()),
    }


def compile_lines(log: str, most: int = 10) -> list[str]:
    """The run's own log lines about compiling (torch.compile's time, say), at most `most`."""
    return [line.strip()[:300] for line in log.splitlines() if "compil" in line.lower()][:most]


def progress(stderr: str | bytes | None) -> str:
    """What a case killed by its timeout had done: updates, the time of the first logging
    window (compilation included) and of the last, torch.compile's recompilations."""
    text = stderr.decode(errors="replace") if isinstance(stderr, bytes) else stderr or ""
    windows = [line.split()[1:] for line in text.splitlines() if line.startswith(PROGRESS)]
    recompiles = text.count(RECOMPILE)
    if not windows:
        return f"no logging window ended; {recompiles} recompilation(s) logged"
    (_, first), (step, last) = windows[0], windows[-1]
    return (
        f"{int(step)} updates done, {float(first):.2f} s per update in the first logging "
        f"window, {float(last):.3f} s in the last; {recompiles} recompilation(s) logged"
    )


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
    manifest = json.loads((Path(shards) / "manifest.json").read_text())["roles"]["train"]
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
    lines = []
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
                f"{tflops / PEAK_TFLOPS:.1%}" if gpu else "-",
                f"{r['peak_mem_gb']:.2f} GB" + ("" if gpu else " RSS"),
            ]
        )
    corpus = Path(args.corpus).name
    print(f"\n{args.steps} steps per case, the first fifth left out; corpus {corpus}")
    print_columns(head, lines)


if __name__ == "__main__":
    main()
