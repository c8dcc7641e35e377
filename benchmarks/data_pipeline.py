"""Throughput and peak memory of clean -> encode + shard -> batching, projected to WMT14.

The corpus is Multi30k scaled up: pair k joins two random Multi30k pairs ("a. b." on both
sides), which gives WMT14-like lengths (~25 words a side) and pairs that dedup cannot
collapse. The vocabulary (8k BPE) is learned once on Multi30k's training side.

    .venv/bin/python -m benchmarks.data_pipeline --pairs 1000000 --workers 0 --compare

Peak memory is the RSS of this process and its children, summed and sampled every 50 ms.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import itertools
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import psutil
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from transformer.config import CleanConfig, ShardConfig, VocabConfig
from transformer.data.clean import clean_corpus
from transformer.data.dataset import ShardDataset
from transformer.data.sampler import TokenBatchSampler
from transformer.data.shard import encode_and_shard, verify_shards
from transformer.data.vocab import learn_vocab

MULTI30K = Path(__file__).resolve().parents[2] / "shared" / "data" / "multi30k"
WMT14_PAIRS = 4_500_000
SPLITS = {"train": "train", "valid": "val", "test": "test_2016_flickr"}


class TreeMonitor:
    """Samples this process tree in a thread while the block runs: the peak of the summed
    RSS (every 50 ms; counts the pages that forked workers share once per process, so an
    upper bound), the peak of the summed PSS (shared pages split among their sharers, the
    real footprint; every second, as reading smaps costs ~15 ms a process), and the CPU
    seconds the tree used, less the monitor's own (on this shared machine, wall time
    alone does not tell the work from the waiting)."""

    def __init__(self, interval: float = 0.05, pss_every: int = 20):
        self.interval, self.pss_every = interval, pss_every
        self.rss = self.pss = 0
        self._cpu: dict[int, float] = {}
        self._own_cpu = 0.0
        self._stop = threading.Event()

    @property
    def cpu_seconds(self) -> float:
        return sum(self._cpu.values()) - self._own_cpu

    def __enter__(self) -> TreeMonitor:
        me = psutil.Process()
        self._thread = threading.Thread(target=self._run, args=(me,), daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self, me: psutil.Process) -> None:
        start = {me.pid: sum(me.cpu_times()[:2])}
        for tick in itertools.count():
            rss = pss = 0
            for proc in [me, *me.children(recursive=True)]:
                with contextlib.suppress(psutil.Error):  # a worker that just exited
                    rss += proc.memory_info().rss
                    if tick % self.pss_every == 0:
                        pss += proc.memory_full_info().pss
                    cpu = sum(proc.cpu_times()[:2]) - start.get(proc.pid, 0.0)
                    self._cpu[proc.pid] = cpu
            self.rss, self.pss = max(self.rss, rss), max(self.pss, pss)
            self._own_cpu = time.thread_time()
            if self._stop.wait(self.interval):
                return


def read_multi30k(split: str) -> tuple[list[str], list[str]]:
    def lines(lang: str) -> list[str]:
        with gzip.open(MULTI30K / f"{split}.{lang}.gz", "rt", encoding="utf-8") as f:
            return f.read().splitlines()

    return lines("en"), lines("de")


def write_scaled_corpus(raw: Path, pairs: int, seed: int = 0) -> None:
    """`raw/{train,valid,test}.parquet`: train scaled to `pairs`, valid/test as they are."""
    raw.mkdir(parents=True)
    for role, split in SPLITS.items():
        src, tgt = read_multi30k(split)
        if role != "train":
            pq.write_table(pa.table({"src": src, "tgt": tgt}), raw / f"{role}.parquet")
            continue
        src, tgt = pa.array(src), pa.array(tgt)
        rng = np.random.default_rng(seed)
        schema = pa.schema([("src", pa.string()), ("tgt", pa.string())])
        with pq.ParquetWriter(raw / "train.parquet", schema) as writer:
            for start in range(0, pairs, 100_000):  # in pieces: keep generation out of RAM
                n = min(100_000, pairs - start)
                a, b = (
                    pa.array(rng.integers(0, len(src), n)),
                    pa.array(rng.integers(0, len(src), n)),
                )
                writer.write_table(pa.table({"src": _join(src, a, b), "tgt": _join(tgt, a, b)}))


def _join(text: pa.Array, a: pa.Array, b: pa.Array) -> pa.Array:
    return pc.binary_join_element_wise(text.take(a), text.take(b), " ")


@dataclass
class Stage:
    name: str
    pairs: int  # of the generated corpus (WMT14's 4.5M are counted before cleaning too)
    seconds: float
    cpu_seconds: float
    alone_seconds: float  # had it the cores to itself: CPU seconds / processes it runs
    rss: int
    pss: int

    def report(self) -> None:
        wmt14 = WMT14_PAIRS / self.pairs / 60
        print(
            f"{self.name:<30} {self.seconds:7.1f} s {self.pairs / self.seconds:9,.0f} pairs/s  "
            f"cpu {self.cpu_seconds:6.1f} s  peak RSS {self.rss / 2**30:5.2f} GiB "
            f"(PSS {self.pss / 2**30:5.2f})  WMT14 ~{self.seconds * wmt14:5.1f} min "
            f"(uncontended ~{self.alone_seconds * wmt14:4.1f})",
            flush=True,
        )


def timed(name: str, pairs: int, processes: int, fn, stages: list[Stage]):
    with TreeMonitor() as tree:
        start = time.perf_counter()
        out = fn()
        seconds = time.perf_counter() - start
    cpu = tree.cpu_seconds
    stages.append(Stage(name, pairs, seconds, cpu, cpu / processes, tree.rss, tree.pss))
    stages[-1].report()
    return out


def total(stages: list[Stage]) -> Stage:
    return Stage(
        "total",
        stages[0].pairs,
        *(sum(getattr(st, key) for st in stages) for key in ("seconds", "cpu_seconds")),
        sum(st.alone_seconds for st in stages),
        max(st.rss for st in stages),
        max(st.pss for st in stages),
    )


def batching_throughput(shards: Path, max_tokens: int = 4096, n_batches: int = 2000) -> None:
    """Epoch planning and gather+pad speed; padding = padded tensor size / real tokens - 1."""
    ds = ShardDataset(shards, "train")
    start = time.perf_counter()
    batches = TokenBatchSampler.from_dataset(ds, max_tokens, seed=1).epoch_batches(0)
    plan = time.perf_counter() - start
    start = time.perf_counter()
    padded = real = 0
    for indices in batches[:n_batches]:
        batch = ds.batch(indices)
        padded += batch.src.numel() + batch.tgt_out.numel()
        real += batch.n_src_tokens + batch.n_tgt_tokens
    took = time.perf_counter() - start
    n = min(n_batches, len(batches))
    print(
        f"batching: {len(ds):,} pairs -> {len(batches):,} batches of <= {max_tokens} tokens, "
        f"epoch plan {plan:.2f} s; gather+pad {n / took:,.0f} batches/s "
        f"({padded / took / 1e6:.1f}M tokens/s); padding {padded / real - 1:.1%}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=1_000_000)
    parser.add_argument("--workers", type=int, default=0, help="encoding processes; 0 = all")
    parser.add_argument("--vocab-size", type=int, default=8000)
    parser.add_argument(
        "--compare", action="store_true", help="also encode with workers=1 (single process)"
    )
    args = parser.parse_args()
    cores = len(psutil.Process().cpu_affinity())
    print(f"{args.pairs:,} pairs, {cores} cores, load average {psutil.getloadavg()}")

    with tempfile.TemporaryDirectory(prefix="data-bench-") as tmp:
        work, stages = Path(tmp), []
        raw, clean, shards = work / "raw", work / "clean", work / "shards"
        write_scaled_corpus(raw, args.pairs)
        src, tgt = read_multi30k("train")
        pq.write_table(pa.table({"src": src, "tgt": tgt}), work / "multi30k.parquet")
        start = time.perf_counter()
        vocab = VocabConfig(size=args.vocab_size)
        spm_model = learn_vocab(work / "multi30k.parquet", vocab, work / "vocab")
        print(f"vocab: {args.vocab_size} BPE on Multi30k in {time.perf_counter() - start:.1f} s")

        n, workers = args.pairs, args.workers or cores
        clean_cfg = CleanConfig(dedup=True)
        timed("clean (dedup)", n, 1, lambda: clean_corpus(raw, clean_cfg, clean), stages)
        manifest = timed(
            f"encode+shard (workers={workers})",
            n,
            workers,
            lambda: encode_and_shard(clean, spm_model, ShardConfig(workers=workers), shards),
            stages,
        )
        train = manifest["roles"]["train"]
        print(
            f"  {train['rows']:,} pairs kept, {train['src_tokens'] / train['rows']:.1f} + "
            f"{train['tgt_tokens'] / train['rows']:.1f} subwords/pair (EOS included), "
            f"{len(train['files'])} files, fingerprint {manifest['fingerprint']}"
        )
        timed("verify (sha256)", n, 1, lambda: verify_shards(shards), stages)
        total(stages).report()
        if args.compare:
            single = timed(
                "peer: encode+shard workers=1",
                n,
                1,
                lambda: encode_and_shard(clean, spm_model, ShardConfig(workers=1), work / "s1"),
                [],
            )
            print(f"  same fingerprint: {single['fingerprint'] == manifest['fingerprint']}")
        batching_throughput(shards)


if __name__ == "__main__":
    main()
