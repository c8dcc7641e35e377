"""The GPU proof: what the speed work changed, measured in one run of at most 8 minutes on
one H100 or H200, beside the project's targets.

    make gpu-baseline    # here, first: the base commit's tree into .baseline/ (carried)
    python benchmarks/gpu_proof.py [--out DIR] [--device cuda|cpu] [--tiny] [--budget S]
        [--phases A,B] [--limit PHASE=S ...] [--best-overrides K=V ...] [--baseline DIR]

Each phase runs in a subprocess of its own under its own time limit (PHASES): one that
overruns is killed, recorded as such with what it had measured, and the next one starts; a
phase with less than half its limit left of --budget is skipped, saying so. After each phase
its record is appended to proof.jsonl and report.md is rewritten, in --out (default
benchmarks/results/<date>-<device>-proof/): a run stopped from outside keeps all it finished.

Phases, in order:
- environment: versions, the device, the host, the commit, nvidia-smi's clocks and power;
- eager-before, eager-after: base and big updates in bf16 on a few fixed batch shapes
  (model_step.wmt_like_batches, the same seed), reused in turn: ms per update, target
  tokens/s, MFU, CUDA kernels and aten ops per update and how busy the GPU is
  (torch.profiler). "before" runs the base commit's own code (--baseline, which `make
  gpu-baseline` writes) through its own model_step; "after", today's;
- compile: the same with each layer compiled (transformer/compiled.py): the first update's
  seconds (compiling), graphs, recompiles and graph breaks, then the rates;
- cuda-graphs: a whole update (forward, loss, backward, gradients to the fp32 masters, Adam
  with capturable=True, the bf16 copies refreshed) captured once per shape class for two
  (B, S, T) classes, then replayed. Off CUDA the same update runs eagerly on the two classes
  (so it cannot rot) and the phase says it is skipped;
- real-loop: `transformer.train`'s own loop on synthetic WMT-like shards
  (benchmarks/train_throughput.py; 100 updates, the first 20 left out), base and big, with
  the params as they are ("today's") and with --best-overrides ("best"; by default
  train.compile=true and train.shape_classes=16, where the params have that key);
- beam: beam 4 on 2,000 WMT-like sentences, base, each search benchmarks/decode.py offers
  ('beam', 'beam-static'); and on the CPU the smoke model's, beside CTranslate2;
then the targets. `--device cpu --tiny` runs the same phases on toy sizes in under a minute
(tests/test_gpu_proof.py), torch.compile there tracing without generating code.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from types import ModuleType

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
BASELINE = ROOT / ".baseline"  # `make gpu-baseline`: the base commit's tree
MARGIN_S = 3.0  # a phase stops starting new work this long before its limit
SHAPE_CLASSES = 16  # the best settings' train.shape_classes (params/base.yaml's comment)
# Off CUDA the compile phase traces (fullgraph, the counts) but generates no code: inductor's
# C++ would take minutes of a CPU rehearsal.
OFF_CUDA_BACKEND = "eager"
GRAPH_LR = 1e-4  # the captured updates' constant learning rate (a graph holds its value)
SMI_FIELDS = (
    "name,driver_version,pstate,clocks.sm,clocks.max.sm,clocks.mem,clocks.max.mem,"
    "power.draw,power.limit,temperature.gpu"
)


@dataclass(frozen=True)
class Plan:
    """What each phase measures: config names of gpu_report.CONFIGS."""

    name: str
    base: str
    big: str
    max_tokens: int  # padded tokens per fixed batch
    fixed: int  # fixed batches, one per update in turn
    warmup: int  # untimed updates (every fixed shape seen: compiled)
    steps: int  # timed updates
    profiled: int  # updates under torch.profiler
    loop_steps: int  # the real loop's updates (the first fifth left out)
    loop_pairs: int
    loop_max_len: int
    beam: tuple[str, int]  # on the proof's device: (config, sentences)
    cpu_beam: tuple[str, int]  # on the CPU, beside CTranslate2
    rounds: int  # decoding rounds on the GPU, the best counts (on the CPU one, as CTranslate2's)

    @property
    def configs(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys((self.base, self.big)))


GPU = Plan(
    "gpu", base="base", big="big", max_tokens=32768, fixed=4, warmup=4, steps=12, profiled=3,
    loop_steps=100, loop_pairs=100_000, loop_max_len=250, beam=("base", 2000),
    cpu_beam=("smoke", 500), rounds=2,
)  # fmt: skip
CPU = Plan(
    "cpu", base="smoke", big="smoke", max_tokens=2048, fixed=4, warmup=4, steps=4, profiled=2,
    loop_steps=50, loop_pairs=5000, loop_max_len=100, beam=("smoke", 200),
    cpu_beam=("smoke", 200), rounds=1,
)  # fmt: skip
TINY = Plan(
    "tiny", base="tiny", big="tiny", max_tokens=256, fixed=2, warmup=2, steps=2, profiled=1,
    loop_steps=10, loop_pairs=400, loop_max_len=20, beam=("tiny", 12), cpu_beam=("tiny", 12),
    rounds=1,
)  # fmt: skip
PLANS = {p.name: p for p in (GPU, CPU, TINY)}


# --------------------------------------------------------------------------- in a phase


@dataclass
class Ctx:
    """A phase's process: the tree's gpu_report (its model_step, its transformer), where the
    phase runs, and what it has measured so far, saved after each addition."""

    g: ModuleType
    device: torch.device
    plan: Plan
    work: Path
    tree: str  # "before: <commit>" or "after: ..."
    best: list[str] | None  # --best-overrides
    result: Path
    deadline: float  # time.time() at which the phase is killed
    tables: dict[str, list[dict]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def left(self) -> float:
        return self.deadline - time.time() - MARGIN_S

    def add(self, table: str, *rows: dict) -> None:
        self.tables.setdefault(table, []).extend(rows)
        self.save()

    def note(self, *lines: str) -> None:
        self.notes.extend(lines)
        self.save()

    def save(self, status: str = "running", trace: str | None = None) -> None:
        found = {"status": status, "tables": self.tables, "notes": self.notes}
        write_atomic(self.result, json.dumps({**found, "traceback": trace}, default=str))


def environment(ctx: Ctx) -> None:
    g = ctx.g
    values = g.versions_table(ctx.device)
    values["triton"] = g.package_version("triton")
    if values["commit"].startswith("unknown") and (ROOT / "COMMIT").is_file():
        values["commit"] = f"{(ROOT / 'COMMIT').read_text().strip()} (COMMIT: no git here)"
    if ctx.cuda:
        props = torch.cuda.get_device_properties(ctx.device)
        values["SMs"] = str(props.multi_processor_count)
    ctx.add("versions", *({"item": k, "value": v} for k, v in values.items()))
    ctx.add("nvidia-smi", *nvidia_smi())


def nvidia_smi() -> list[dict]:
    """One row per GPU: its clocks, power and limit, as nvidia-smi reads them now (the
    fields an earlier report read, where a driver refuses one of the others)."""
    if shutil.which("nvidia-smi") is None:
        return [{"status": "skipped: no nvidia-smi here"}]
    for fields in (SMI_FIELDS, "name,clocks.max.sm,power.limit"):
        cmd = ["nvidia-smi", f"--query-gpu={fields}", "--format=csv"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
        if done.returncode == 0:
            head, *lines = [[c.strip() for c in ln.split(",")] for ln in done.stdout.splitlines()]
            return [dict(zip(head, line, strict=False)) for line in lines if line]
    return [{"status": f"failed: {(done.stdout + done.stderr).strip()[:200]}"}]


def eager(ctx: Ctx) -> None:
    """Ours' update on the fixed batches, as this tree's model_step makes it."""
    bf16_copies = hasattr(ctx.g.model_step, "ComputeWeights")  # the base commit has none
    update = "bf16 copies of the matrix weights" if bf16_copies else "autocast's casts"
    ctx.note(f"{ctx.tree}: ours' update: {update}; code: {sys.modules['transformer'].__file__}")
    for name in ctx.plan.configs:
        ctx.add("", eager_case(ctx, name))
        release()
    ctx.note(rates_note(ctx))


def eager_case(ctx: Ctx, name: str) -> dict:
    params, batches, net = prepare(ctx, name)
    adam = ctx.g.build_optimizer(net, params.train, params.model.d_model)[0]
    step = ctx.g.model_step.make_step(net, adam, ctx.cuda)
    row = {"config": name, "tree": ctx.tree, **batch_shapes(batches)}
    return {**row, **rates(ctx, cycle(step, batches), batches, params)}


def compiled(ctx: Ctx) -> None:
    """As eager-after, with transformer/compiled.py's compile_layers (and the loss's chunks
    compiled); dynamo's counts are this config's (the difference over its updates)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from transformer.compiled import compile_layers, compile_stats

    backend = "inductor" if ctx.cuda else OFF_CUDA_BACKEND
    name = ctx.plan.base  # big compiles in the real loop's best case
    torch._dynamo.reset()
    counters.clear()
    row = compiled_case(ctx, name, compile_layers)
    ctx.add("", {**row, **compile_stats()})
    release()
    ctx.note(
        f"{name} only (big: the real loop's best case compiles it); compile_layers: each "
        f"encoder and decoder layer compiled (fullgraph, symbolic sizes), the loss's chunks "
        f"too; backend {backend}" + ("" if ctx.cuda else " off CUDA (dynamo's tracing alone)"),
        "first update s: its compilation included; warm-up s: the other fixed shapes' "
        "updates (a recompilation only where a shape specialises)",
        rates_note(ctx),
    )


def compiled_case(ctx: Ctx, name: str, compile_layers: Callable) -> dict:
    params, batches, net = prepare(ctx, name)
    adam = ctx.g.build_optimizer(net, params.train, params.model.d_model)[0]
    with contextlib.nullcontext() if ctx.cuda else compiler_backend(OFF_CUDA_BACKEND):
        step = ctx.g.model_step.make_step(net, adam, ctx.cuda, compile_layers=compile_layers)
    measured = rates(ctx, cycle(step, batches), batches, params, progress=name)
    return {"config": name, **batch_shapes(batches), **measured}


@contextlib.contextmanager
def compiler_backend(backend: str):
    """torch.compile calls made inside use `backend`."""
    real = torch.compile

    def patched(*args, **kwargs):
        return real(*args, **{**kwargs, "backend": backend})

    torch.compile = patched
    try:
        yield
    finally:
        torch.compile = real


def cuda_graphs(ctx: Ctx) -> None:
    """The whole update captured per shape class, replayed in turn."""
    for name in ctx.plan.configs:
        ctx.add("", graph_case(ctx, name))
        release()
    ctx.note(
        "each class's update captured once (after two eager updates per class on a side "
        "stream), the classes' graphs sharing one memory pool, each replay on its class's one "
        f"batch; Adam fused and capturable, its learning rate a constant {GRAPH_LR:g}; loss: "
        "per target token, the first class's, before the timed updates and after them",
        rates_note(ctx),
    )
    if not ctx.cuda:
        raise ctx.g.Skipped(
            "CUDA graphs need a GPU (the rows: the same update run eagerly on the two classes)"
        )


def graph_case(ctx: Ctx, name: str) -> dict:
    params, batches, net = prepare(ctx, name)
    train = params.train
    adam = torch.optim.Adam(
        net.parameters(),
        lr=GRAPH_LR,
        betas=tuple(train.adam_betas),
        eps=train.adam_eps,
        fused=ctx.cuda,
        capturable=ctx.cuda,
    )
    step = ctx.g.model_step.make_step(net, adam, ctx.cuda)
    ordered = sorted(batches, key=lambda b: (b[1].size(1), b[0].size(1)))
    classes = [ordered[0], ordered[-1]]  # the shortest and the longest
    start = time.perf_counter()
    with ctx.g.attention.attention_context(ctx.device):
        update = captured(step, classes) if ctx.cuda else cycle(step, classes)
    row = {"config": name, **batch_shapes(classes)}
    row["capture s"] = time.perf_counter() - start if ctx.cuda else None
    loss = lambda: update(0).item() / classes[0][3].numel()
    row["loss at start"] = loss()
    row.update(rates(ctx, update, classes, params))
    row["loss at end"] = loss()
    return row


def captured(step: Callable, classes: list) -> Callable[[int], torch.Tensor]:
    """update(i): the graph of classes[i % n] replayed; its loss (the graph's output)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # Adam's state, the kernels' choices, the allocator's pools
        for batch in classes * 2:
            step(batch)
    torch.cuda.current_stream().wait_stream(side)
    graphs, pool = [], None
    for batch in classes:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            loss = step(batch)
        graphs.append((graph, loss))
        pool = graph.pool()

    def update(i: int) -> torch.Tensor:
        graph, loss = graphs[i % len(graphs)]
        graph.replay()
        return loss

    return update


def real_loop(ctx: Ctx) -> None:
    g, plan = ctx.g, ctx.plan
    best, why = best_settings(ctx)
    shards = {  # before any case starts: a case's share of the time is its own
        name: g.train_throughput.synthetic_shards(
            ctx.work, g.config(name).vocab.size, plan.loop_pairs, plan.loop_max_len
        )
        for name in plan.configs
    }
    # Today's settings first (their time is known), the best ones sharing what is left.
    cases = [(name, "today's", []) for name in plan.configs]
    cases += [(name, "best", best) for name in plan.configs]
    for i, (name, settings, extra) in enumerate(cases):
        timeout = max(10.0, ctx.left() / (len(cases) - i))  # an overrun leaves the rest time
        row = {"config": name, "settings": settings, "overrides": " ".join(extra) or "-"}
        ctx.add("", g.peer(row, partial(loop_case, ctx, name, extra, shards[name], timeout)))
    ctx.note(
        *why,
        f"python -m transformer.train's loop (benchmarks/train_throughput.py) in a process per "
        f"case, {plan.loop_steps} updates, the first fifth left out, on {plan.loop_pairs:,} "
        f"synthetic pairs (WMT-like lengths <= {plan.loop_max_len}); each case's time limit "
        "is its share of what the phase has left",
    )


def loop_case(ctx: Ctx, name: str, extra: list[str], shards: Path, timeout: float) -> dict:
    g = ctx.g
    path, overrides = g.CONFIGS[name]
    threads = 1 if ctx.plan is TINY else 0
    r = g.train_throughput.measure(
        name,
        path,
        [*overrides, *extra],
        shards,
        ctx.plan.loop_steps,
        ctx.work,
        threads,
        cpu=not ctx.cuda,
        timeout=timeout,
    )
    tflops = r["tokens_per_s"] * r["flops_per_token"] / 1e12
    return {
        "device": r["device"],
        "tgt tok/update": r["tokens_per_update"],
        "s/update": r["step_time"],
        "tgt tok/s": r["tokens_per_s"],
        "TFLOP/s": tflops,
        "MFU": tflops / g.PEAK_TFLOPS if ctx.cuda else None,
        "peak mem GiB": r["peak_mem_gb"],
        "recompiles logged": r.get("recompiles_logged"),
        "compile log": " / ".join(r.get("compile_log", [])) or None,
    }


def best_settings(ctx: Ctx) -> tuple[list[str], list[str]]:
    """(the "best" overrides, notes): --best-overrides, else the layers compiled on static
    batch shapes (not compiled at --tiny sizes: the CPU's compiler would take all the time)."""
    if ctx.best is not None:
        return ctx.best, ["best: --best-overrides"]
    best = [f"train.shape_classes={SHAPE_CLASSES}"]
    if ctx.plan is not TINY:
        best.insert(0, "train.compile=true")
    return best, [f"best: {' '.join(best)}"]


def beam(ctx: Ctx) -> None:
    """Each of ours' searches that decode.py offers, on the GPU and on the CPU; on the CPU
    also CTranslate2, on the same weights and sources."""
    g = ctx.g
    if ctx.cuda:
        beam_case(ctx, ctx.device, *ctx.plan.beam)
    beam_case(ctx, torch.device("cpu"), *ctx.plan.cpu_beam)
    ctx.note(
        f"ours: each mode of benchmarks/decode.py's run() (its MODES: "
        f"{', '.join(g.decode_bench.MODES)}); after a warm-up on 16 sentences, on the GPU the best "
        f"of {ctx.plan.rounds} round(s), the first round's rate beside it; on the CPU one round, "
        "as CTranslate2's",
        " ".join(g.decode_bench.DIFFERENCES.split()),
    )


def beam_case(ctx: Ctx, device: torch.device, name: str, n: int) -> None:
    g = ctx.g
    params = g.config(name)
    cfg, vocab = params.decode, params.vocab.size
    torch.manual_seed(0)
    model = g.Transformer(params.model, vocab, pad_id=g.PAD).to(device).eval()
    sources = g.decode_sources(params, n, cfg.max_tokens)
    searcher = g.decode_bench.EndsWithSource(model)
    row = {"config": name, "device": device.type, "sentences": n}
    for mode in ("beam", "beam-static"):
        found = {**row, "search": f"beam {cfg.beam_size}, ours ({mode})"}
        ctx.add("", g.peer(found, partial(ours_rate, ctx, searcher, sources, cfg, mode, device)))
    if device.type == "cpu":
        pieces = ["<pad>", "<unk>", "<s>", "</s>", *(f"w{i}" for i in range(4, vocab))]
        go = partial(g.ctranslate2_rate, model, sources, pieces, cfg, "cpu")
        ctx.add("", g.peer({**row, "search": f"beam {cfg.beam_size}, CTranslate2"}, go))


def ours_rate(ctx: Ctx, searcher, sources: list, cfg, mode: str, device) -> dict:
    g = ctx.g
    if mode not in g.decode_bench.MODES:
        raise g.Skipped(f"benchmarks/decode.py has no '{mode}' mode in this tree")
    go = lambda some: g.decode_bench.run(searcher, some, cfg, mode, device.type)
    with g.attention.attention_context(device):
        n = ctx.plan.rounds if device.type == "cuda" else 1
        rounds = [g.rate(go, sources, warm_up=i == 0) for i in range(n)]
    best = max(rounds, key=lambda r: r["sent/s"])
    return {**best, "first round sent/s": rounds[0]["sent/s"]}


# --------------------------------------------------------------------------- measuring


def prepare(ctx: Ctx, name: str):
    """(params, the fixed batches on the device, ours built there)."""
    g = ctx.g
    params = g.config(name)
    made = g.model_step.wmt_like_batches(ctx.plan.fixed, ctx.plan.max_tokens, params.vocab.size, 1)
    batches = [tuple(x.to(ctx.device) for x in b) for b in made]
    return params, batches, g.model_step.build("ours", params, ctx.device, seed=1)


def cycle(step: Callable, batches: list) -> Callable[[int], torch.Tensor]:
    """update(i): the step on batches[i % n]."""
    return lambda i: step(batches[i % len(batches)])


def batch_shapes(batches: list) -> dict:
    shapes = [f"{b[0].size(0)}x{b[0].size(1)}x{b[1].size(1)}" for b in batches]
    return {"B x S x T": " ".join(shapes)}


def rates(ctx: Ctx, update: Callable, batches: list, params, progress: str = "") -> dict:
    """The first update alone, the rest of the warm-up, then plan.steps timed updates and
    plan.profiled profiled ones; update(i) runs on batches[i % n]. `progress`: a name under
    which the warm-up's times are noted as they come (a phase killed then keeps them)."""
    g, plan, dev = ctx.g, ctx.plan, ctx.device
    run = lambda first, n: [update(i) for i in range(first, first + n)]
    with g.attention.attention_context(dev):
        first = g.timed(lambda: run(0, 1), dev)
        if progress:
            ctx.note(f"{progress}: the first update took {first:.1f} s")
        warm = g.timed(lambda: run(1, plan.warmup - 1), dev)
        if progress:
            ctx.note(f"{progress}: {plan.warmup - 1} more warm-up updates took {warm:.1f} s")
        seconds = g.timed(lambda: run(plan.warmup, plan.steps), dev)
    summary = g.profiled(dev, lambda: None, lambda: run(0, plan.profiled), "")[0]
    timed = [batches[i % len(batches)] for i in range(plan.warmup, plan.warmup + plan.steps)]
    with torch.device("meta"):  # shapes only, for the FLOP count
        shape = g.Transformer(params.model, params.vocab.size)
    flops = sum(g.model_step.step_flops(shape, b) for b in timed)
    tokens = sum(b[3].numel() for b in timed)
    per = lambda key: None if summary[key] is None else summary[key] / plan.profiled
    return {
        "first update s": first,
        "warm-up s": warm,
        "ms/update": 1000 * seconds / plan.steps,
        "tgt tok/update": tokens / plan.steps,
        "tgt tok/s": tokens / seconds,
        "TFLOP/s": flops / seconds / 1e12,
        "MFU": flops / seconds / 1e12 / g.PEAK_TFLOPS if ctx.cuda else None,
        "kernels/update": per("kernels"),
        "GPU busy": summary["GPU busy"],
        "aten ops/update": per("aten ops"),
    }


def rates_note(ctx: Ctx) -> str:
    p = ctx.plan
    precision = "bf16 autocast" if ctx.cuda else "fp32"
    return (
        f"{p.fixed} fixed WMT-like batches of <= {p.max_tokens:,} padded tokens "
        f"(model_step.wmt_like_batches, seed 1), one per update in turn: {p.warmup} updates "
        f"untimed, {p.steps} timed, {p.profiled} under torch.profiler (kernels, aten ops, GPU "
        f"busy: the kernels' time over the wall time); {precision}; MFU against "
        f"{ctx.g.PEAK_TFLOPS:.0f} TFLOP/s (model_step.PEAK_TFLOPS)"
    )


def release() -> None:
    """The last config's memory back to the device, before the next one's."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def child(job_file: Path) -> int:
    """One phase, in this process: its result file says how far it got, at every row."""
    job = json.loads(job_file.read_text())
    tree = Path(job["tree"])
    sys.path.insert(0, str(tree / "benchmarks"))  # that tree's gpu_report puts its root first
    import gpu_report

    plan = PLANS[job["plan"]]
    if plan is TINY:  # toy models gain nothing from threads
        torch.set_num_threads(1)
    ctx = Ctx(
        gpu_report,
        torch.device(job["device"]),
        plan,
        Path(job["work"]),
        job["label"],
        job["best"],
        Path(job["result"]),
        job["deadline"],
    )
    status, trace = "ok", None
    try:
        PHASE_FNS[job["phase"]](ctx)
    except gpu_report.Skipped as why:
        status = f"skipped: {why}"
    except ImportError as err:  # an API this tree lacks
        status = f"skipped: {type(err).__name__}: {err}"
    except Exception as err:  # the record says so; the next phase runs
        status, trace = gpu_report.model_step.failure(err)[:320], traceback.format_exc()
    ctx.save(status, trace)
    return 0


# --------------------------------------------------------------------------- the run


@dataclass(frozen=True)
class Phase:
    name: str
    run: Callable[[Ctx], None]
    limit: float  # seconds; then killed
    before: bool = False  # runs the base commit's tree (--baseline), not today's


PHASES = (  # 470 s together: under 8 minutes with the start and the reports
    Phase("environment", environment, 15),
    Phase("eager-before", eager, 40, before=True),
    Phase("eager-after", eager, 40),
    Phase("compile", compiled, 55),
    Phase("cuda-graphs", cuda_graphs, 40),
    Phase("real-loop", real_loop, 210),
    Phase("beam", beam, 70),
)
PHASE_FNS = {p.name: p.run for p in PHASES}


def run_phase(phase: Phase, args: argparse.Namespace, work: Path, left: float) -> dict:
    """The phase's record: its status, seconds, limit, tables and notes (a killed phase's
    rows are those it had measured), the end of its output where it did not finish."""
    limit = args.limit.get(phase.name, phase.limit)
    tree = args.baseline if phase.before else ROOT
    record = {"phase": phase.name, "tree": tree_label(phase.before, args), "limit_s": limit}
    skip = None
    if left < limit / 2:
        skip = f"the time budget is spent ({left:.0f} s of --budget {args.budget:.0f} left)"
    elif not (tree / "benchmarks" / "gpu_report.py").is_file():
        skip = f"no baseline tree in {tree}: run `make gpu-baseline` first (and carry it)"
    if skip:
        return {**record, "status": f"skipped: {skip}", "seconds": 0.0}
    result, log = work / f"{phase.name}.json", work / f"{phase.name}.log"
    job = {
        "phase": phase.name,
        "tree": str(tree),
        "label": record["tree"],
        "work": str(work),
        "device": args.device,
        "plan": plan_of(args).name,
        "best": args.best_overrides,
        "result": str(result),
        "seconds": min(limit, left),
    }
    job["deadline"] = time.time() + job["seconds"]  # the clock the phase's process can read
    (work / f"{phase.name}.job").write_text(json.dumps(job))
    rc, seconds = spawn(
        [sys.executable, __file__, "--child", str(work / f"{phase.name}.job")], log, job["seconds"]
    )
    found = json.loads(result.read_text()) if result.is_file() else {}
    record.update(seconds=seconds, tables=found.get("tables", {}), notes=found.get("notes", []))
    if rc is None:
        record["status"] = f"killed: over its time limit of {job['seconds']:.3g} s"
    elif rc != 0 or not found:
        record["status"] = f"failed: exit code {rc}" + ("" if found else ", no result written")
    else:
        record["status"] = found["status"]
    if found.get("traceback"):
        record["traceback"] = found["traceback"]
    if rc != 0 or not found or found["status"] == "running":
        record["log tail"] = log.read_text(errors="replace")[-2000:]
    return record


def spawn(cmd: list[str], log: Path, timeout: float) -> tuple[int | None, float]:
    """(exit code, or None if killed at `timeout`; seconds). The command and all it started
    (its own process group) are killed at the limit."""
    start = time.monotonic()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with log.open("w") as out:
        # A process group of its own (not a session: the machine's end of a command ends it)
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, process_group=0
        )
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = None
    return rc, time.monotonic() - start


def tree_label(before: bool, args: argparse.Namespace) -> str:
    if not before:
        return "after: today's tree"
    commit = args.baseline / "COMMIT"
    return f"before: {commit.read_text().strip() if commit.is_file() else args.baseline}"


def plan_of(args: argparse.Namespace) -> Plan:
    return TINY if args.tiny else GPU if args.device == "cuda" else CPU


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        return child(Path(argv[1]))
    args = parse_args(argv)
    import gpu_report  # today's: the report's tables, targets and folder name

    plan, start = plan_of(args), time.monotonic()
    device = torch.device(args.device)
    out = args.out or default_folder(gpu_report.device_name(device), args.tiny)
    out.mkdir(parents=True, exist_ok=True)
    jsonl = out / "proof.jsonl"
    jsonl.write_text("")  # this run's records only
    meta = {
        "command": shlex.join(["python", "benchmarks/gpu_proof.py", *argv]),
        "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "device": gpu_report.device_name(device),
        "plan": plan.name,
    }
    records: list[dict] = []
    work = Path(tempfile.mkdtemp(prefix="gpu-proof-"))
    try:
        for phase in PHASES:
            if args.phases and phase.name not in args.phases:
                continue
            left = args.budget - (time.monotonic() - start)
            record = run_phase(phase, args, work, left)
            records.append(record)
            with jsonl.open("a") as f:  # one line a phase, as it ends
                f.write(json.dumps(record, default=str) + "\n")
            report = {**meta, "wall_s": time.monotonic() - start, "complete": False}
            write_atomic(out / "report.md", markdown(report, records, plan))
            print(f"{phase.name}: {record['status']} ({record['seconds']:.1f} s)", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report = {**meta, "wall_s": time.monotonic() - start, "complete": True}
    write_atomic(out / "report.md", markdown(report, records, plan))
    for t in targets(records, meta["device"], plan):
        print(
            f"target: {t['target']}: {gpu_report.cell('', t['measured'])} "
            f"(at least {t['at least']:,}): {t['result']}"
        )
    print(out)
    return 0


def parse_args(argv: list[str]) -> argparse.Namespace:
    cuda = torch.cuda.is_available()
    names = [p.name for p in PHASES]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if cuda else "cpu")
    p.add_argument("--tiny", action="store_true", help="toy sizes: every phase, in a minute")
    p.add_argument(
        "--phases", type=lambda s: s.split(","), help=f"a comma-separated subset of {names}"
    )
    p.add_argument("--out", type=Path, help="default: benchmarks/results/<date>-<device>-proof")
    p.add_argument(
        "--budget",
        type=float,
        default=470.0,
        help="seconds for all phases (default 470: the run under 8 minutes)",
    )
    p.add_argument(
        "--limit",
        action="append",
        default=[],
        metavar="PHASE=S",
        help="a phase's time limit in seconds instead of PHASES' (repeatable)",
    )
    p.add_argument(
        "--best-overrides",
        nargs="*",
        metavar="KEY=VALUE",
        help="the real loop's 'best' settings (default: train.compile=true and the "
        "shape-classes setting, where the params have one)",
    )
    p.add_argument(
        "--baseline",
        type=Path,
        default=BASELINE,
        help="the base commit's tree (default .baseline: `make gpu-baseline`)",
    )
    args = p.parse_args(argv)
    if args.device == "cuda" and not cuda:
        p.error(f"--device cuda: no CUDA device (torch {torch.__version__})")
    if unknown := set(args.phases or []) - set(names):
        p.error(f"--phases: unknown {sorted(unknown)}; the phases are {names}")
    try:
        args.limit = {k: float(v) for k, v in (item.split("=", 1) for item in args.limit)}
    except ValueError:
        p.error(f"--limit: PHASE=SECONDS, got {args.limit}")
    if unknown := set(args.limit) - set(names):
        p.error(f"--limit: unknown phases {sorted(unknown)}; the phases are {names}")
    args.baseline = args.baseline.resolve()
    return args


def default_folder(device_name: str, tiny: bool) -> Path:
    slug = re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-")
    slug = "cpu" if device_name.startswith("CPU") else slug
    return HERE / "results" / f"{datetime.date.today().isoformat()}-{slug}{'-tiny' * tiny}-proof"


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


# --------------------------------------------------------------------------- the report


def rows(records: list[dict], phase: str) -> list[dict]:
    found = next((r for r in records if r["phase"] == phase), {})
    return found.get("tables", {}).get("", [])


def best_of(found: list[dict], key: str) -> dict | None:
    return max((r for r in found if r.get(key)), key=lambda r: r[key], default=None)


def targets(records: list[dict], device: str, plan: Plan) -> list[dict]:
    """The project's targets beside this run's best figures, and which GPU measured them."""
    import gpu_report as g

    gpu_why = "--tiny sizes" if plan is TINY else None if plan is GPU else "not on a GPU"
    on = device + (": H200, not an H100" if "H200" in device else "")
    loop = lambda name: best_of(
        [r for r in rows(records, "real-loop") if r["config"] == name], "tgt tok/s"
    )
    beams = [r for r in rows(records, "beam") if "ours" in r["search"]]
    gpu_beam = best_of(
        [r for r in beams if r["device"] == "cuda" and r["config"] == plan.beam[0]], "sent/s"
    )
    cpu = lambda r: r["device"] == "cpu" and r["config"] == plan.cpu_beam[0]
    cpu_ours = best_of([r for r in beams if cpu(r)], "sent/s")
    ct2 = next((r for r in rows(records, "beam") if cpu(r) and "CTranslate2" in r["search"]), None)
    found = [
        (f"{plan.base} real loop, target tokens/s", loop(plan.base), "tgt tok/s", 550_000, on),
        (f"{plan.big} real loop, target tokens/s", loop(plan.big), "tgt tok/s", 250_000, on),
        (f"beam 4 {plan.beam[0]}, sentences/s", gpu_beam, "sent/s", 1500, on),
    ]
    made = [
        {
            **g.target(name, g.get(row, key), least, gpu_why),
            "measured by": by_what(row),
            "on": where,
        }
        for name, row, key, least, where in found
    ]
    ratio = g.ratio(cpu_ours, ct2, "sent/s")
    cpu_why = "--tiny sizes" if plan is TINY else None
    made.append(
        {
            **g.target(
                f"CPU beam 4 {plan.cpu_beam[0]}: ours / CTranslate2 sentences/s",
                ratio,
                1.0,
                cpu_why,
            ),
            "measured by": by_what(cpu_ours),
            "on": "the host's CPU",
        }
    )
    return made


def by_what(row: dict | None) -> str | None:
    if row is None:
        return None
    return f"{row['settings']} settings" if "settings" in row else row.get("search")


def summary(records: list[dict], plan: Plan) -> list[dict]:
    """Per config, target tokens/s on the fixed shapes: eager before, after, compiled, graphs."""
    phases = {
        "eager-before": "before",
        "eager-after": "after",
        "compile": "compiled",
        "cuda-graphs": "CUDA graphs",
    }
    made = []
    for name in plan.configs:
        row = {"config": name}
        for phase, label in phases.items():
            found = next((r for r in rows(records, phase) if r["config"] == name), {})
            row[f"{label} tgt tok/s"] = found.get("tgt tok/s")
            row[f"{label} kernels/update"] = found.get("kernels/update")
        before, after = row["before tgt tok/s"], row["after tgt tok/s"]
        row["after / before"] = after / before if before and after else None
        made.append(row)
    return made


def markdown(report: dict, records: list[dict], plan: Plan) -> str:
    """gpu_report's layout: the targets, the fixed-shape summary, then a section a phase."""
    import gpu_report as g

    sections = {}
    for r in records:
        notes = [f"{r['tree']}; time limit {r['limit_s']:.0f} s", *r.get("notes", [])]
        trace = "\n".join(filter(None, (r.get("traceback"), r.get("log tail")))) or None
        sections[r["phase"]] = {**r, "notes": notes, "traceback": trace}
    whole = {**report, "targets": targets(records, report["device"], plan), "sections": sections}
    text = g.markdown(whole).replace("# GPU report:", "# GPU proof:", 1)
    if not records:
        return text
    first = f"\n## {records[0]['phase']}\n"  # the fixed shapes' summary before it
    table = "\n".join(g.md_table(summary(records, plan)))
    return text.replace(first, f"\n## Fixed shapes, target tokens/s\n\n{table}\n{first}", 1)


if __name__ == "__main__":
    sys.exit(main())
