"""The runner of both plans: their sections in order, each here or in a process of its own
under its time limit (process.py), report.json and report.md rewritten after each, so that a
run stopped from outside keeps all it finished."""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import re
import shlex
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.gpu_report import process, proof, report, section, tree
from benchmarks.gpu_report.machine import device_name
from benchmarks.gpu_report.markdown import cell, markdown
from benchmarks.gpu_report.plan import ROOT, Plan, Section
from benchmarks.gpu_report.section import Ctx, write_atomic

PLANS = {p.name: p for p in (report.PLAN, proof.PLAN)}
BASELINE = ROOT / ".baseline"  # `make gpu-baseline`: the base commit's tree


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:  # process.py's: one section
        return process.child(Path(argv[1]), PLANS)
    args = parse_args(argv)
    plan, device = PLANS[args.plan], torch.device(args.device)
    sizes = plan.sizes["tiny" if args.tiny else "gpu" if device.type == "cuda" else "cpu"]
    out = args.out or default_folder(plan, device, args.tiny)
    out.mkdir(parents=True, exist_ok=True)
    process.quiet(args.tiny)
    head = header(plan, sizes, device, argv)
    start, deadline, done = time.monotonic(), time.time() + args.budget, {}
    whole = lambda complete: whole_report(head, plan, sizes, done, start, complete)
    with tempfile.TemporaryDirectory(dir=out, prefix=".work-") as work:
        for sec in plan.sections:
            if args.only and sec.title not in args.only:
                continue
            ctx = Ctx(device, sizes, Path(work), deadline, ROOT, tree.TODAY, args.best)
            record = done[sec.title] = run(sec, ctx, args, plan)
            write_report(out, whole(complete=False))
            print(f"{sec.title}: {record['status']} ({record['seconds']:.1f} s)", flush=True)
    final = whole(complete=True)
    write_report(out, final)
    for t in final["targets"]:
        measured, least = cell("", t["measured"]), f"{t['at least']:,}"
        print(f"target: {t['target']}: {measured} (at least {least}): {t['result']}")
    print(out)
    return 0


def run(sec: Section, ctx: Ctx, args: argparse.Namespace, plan: Plan) -> dict:
    """The section's record: run here, in a process of its own, or skipped saying why."""
    limit = args.limit.get(sec.title, sec.limit)
    left = ctx.deadline - time.time()
    if left <= (limit or 0) / 2:
        why = f"the time budget is spent ({left:.0f} s of --budget {args.budget:.0f} left)"
        return {"status": f"skipped: {why}", "seconds": 0.0}
    if sec.before:
        ctx.tree_root, ctx.tree_label = args.baseline, tree.label(args.baseline)
        if not (args.baseline / "benchmarks" / "model_step.py").is_file():
            why = f"no baseline tree in {args.baseline}: `make gpu-baseline` writes it, carry it"
            return {"status": f"skipped: {why}", "seconds": 0.0}
    if limit is None and not sec.before:
        return here(sec, ctx)
    return process.run(sec, ctx, plan, limit)


def here(sec: Section, ctx: Ctx) -> dict:
    start = time.perf_counter()
    status, trace = section.execute(sec.function(), ctx)
    gc.collect()
    with contextlib.suppress(Exception):  # after a sticky CUDA error it raises too: the
        torch.cuda.empty_cache()  # next sections then fail one by one, each saying so
    record = {"status": status, "seconds": time.perf_counter() - start}
    record.update(tables=ctx.tables, notes=ctx.notes)
    return {**record, "traceback": trace} if trace else record


def header(plan: Plan, sizes, device: torch.device, argv: list[str]) -> dict:
    """What the report says of itself, beside its figures."""
    return {
        "title": plan.title,
        "command": shlex.join(["python", "-m", "benchmarks.gpu_report", *argv]),
        "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "device": device_name(device),
        "plan": plan.name,
        "sizes": sizes.name,
    }


def whole_report(head: dict, plan: Plan, sizes, done: dict, start: float, complete: bool):
    found = {**head, "wall_s": time.monotonic() - start, "complete": complete}
    found["targets"] = plan.targets(done, head["device"], sizes)
    if plan.summary is not None:
        found["summary"] = plan.summary(done, sizes)
    return {**found, "sections": done}


def write_report(out: Path, found: dict) -> None:
    """report.json and report.md, each replaced whole (never half-written)."""
    write_atomic(out / "report.json", json.dumps(found, indent=2, default=str) + "\n")
    write_atomic(out / "report.md", markdown(found))


def default_folder(plan: Plan, device: torch.device, tiny: bool) -> Path:
    """benchmarks/results/<date>-<GPU, or cpu>[-tiny][-<plan> but the report]."""
    name = device_name(device) if device.type == "cuda" else "cpu"
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    suffix = ("-tiny" if tiny else "") + ("" if plan is report.PLAN else f"-{plan.name}")
    return ROOT / "benchmarks" / "results" / f"{datetime.date.today().isoformat()}-{slug}{suffix}"


def parse_args(argv: list[str]) -> argparse.Namespace:
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.gpu_report",
        description="The GPU report, or the GPU proof (--plan proof): benchmarks/gpu_report/.",
    )
    p.add_argument("--plan", choices=list(PLANS), default="report", help="default: report")
    p.add_argument("--out", type=Path, help="default: benchmarks/results/<date>-<device>")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if cuda else "cpu")
    p.add_argument("--tiny", action="store_true", help="toy sizes: every section, in a minute")
    p.add_argument(
        "--budget",
        type=float,
        help="seconds after which no section starts (default: the report's 480, a run of "
        "under 9 minutes; the proof's 470, under 8)",
    )
    p.add_argument(
        "--only",
        action="append",
        metavar="SECTION",
        help="run this section alone (repeatable; quote titles with spaces): one a short "
        "machine lease could not reach, with the whole budget. Default: all, in order",
    )
    p.add_argument(
        "--limit",
        action="append",
        default=[],
        metavar="SECTION=S",
        help="seconds for the section, in a process of its own killed after them, instead "
        "of the plan's limit (repeatable)",
    )
    p.add_argument(
        "--best-overrides",
        dest="best",
        nargs="*",
        metavar="KEY=VALUE",
        help="the proof's real loop's 'best' settings (default: train.compile=true and "
        "train.shape_classes=16)",
    )
    p.add_argument(
        "--baseline",
        type=Path,
        default=BASELINE,
        help="the proof's base commit's tree (default .baseline: `make gpu-baseline`)",
    )
    return checked(p, p.parse_args(argv), cuda)


def checked(p: argparse.ArgumentParser, args: argparse.Namespace, cuda: bool):
    """The arguments, with --limit as {section: seconds}, or a usage error naming the one
    that does not fit the plan."""
    plan = PLANS[args.plan]
    titles = [s.title for s in plan.sections]
    if args.device == "cuda" and not cuda:
        p.error(
            f"--device cuda: no CUDA device (torch {torch.__version__}, built for CUDA "
            f"{torch.version.cuda})"
        )
    try:
        args.limit = {k: float(v) for k, v in (item.rsplit("=", 1) for item in args.limit)}
    except ValueError:
        p.error(f"--limit: SECTION=SECONDS, got {args.limit}")
    for option, names in (("--only", args.only or []), ("--limit", args.limit)):
        if unknown := [n for n in names if n not in titles]:
            p.error(f"{option}: no section {unknown[0]!r} in the {plan.name} plan: {titles}")
    args.budget = plan.budget if args.budget is None else args.budget
    args.baseline = args.baseline.resolve()
    return args
