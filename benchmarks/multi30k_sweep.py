"""Multi30k EN-DE sweep on one GPU: N runs of params/multi30k.yaml side by side (the flow's
shards), each then averaged (best 5) and decoded/scored as the flow does. Re-runnable: a
second call resumes unfinished runs (SIGTERM saves them) and scores finished ones.
On the device it was copied into .m30k/ (beside the shards, the references and the wheels)
and run from the repository root as
    python3 .m30k/sweep.py OUT WINDOW_S [adapt]
by the commands of benchmarks/results/2026-11-27-h200-multi30k/NOTES.md (arms A-E) and
benchmarks/rdrop_sweep.sh (arms R-T, 2026-11-27-h200-rdrop/).
(Formatted for the linter after the runs; otherwise as run.)"""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

OUT, WINDOW = Path(sys.argv[1]), float(sys.argv[2])  # WINDOW: seconds this call may train
ADAPT = sys.argv[3:4] == ["adapt"]  # drop low-priority runs if all cannot finish in BUDGET_S
BUDGET_S = float(os.environ.get("BUDGET_S", "0"))  # training seconds left over both calls
ROOT = Path(".m30k")
RUNS = ROOT / "runs"
DEV = os.environ.get("DEV", "cuda")
STEPS = int(os.environ.get("STEPS", "6000"))
ARMS = {
    "A": [],
    "B": ["train.label_smoothing=0.2"],
    "C": ["model.dropout=0.4"],
    "D": ["model.dropout=0.25"],
    "E": ["train.label_smoothing=0.05"],
    "R": ["train.rdrop_alpha=5"],  # added for the R-Drop sweep (2026-11-27-h200-rdrop)
    "S": ["train.rdrop_alpha=2"],
    "T": ["train.rdrop_alpha=1"],
}
ORDER = os.environ.get("ORDER", "A1 B1 A2 B2 A3 B3 C1 C2 A4 B4 C3 C4").split()
COMMON = [
    "train.precision=fp32",
    f"train.max_steps={STEPS}",
    "score.tokenized_refs=.m30k/tok",
    *os.environ.get("EXTRA", "").split(),
]
t0 = time.monotonic()
OUT.mkdir(parents=True, exist_ok=True)
RUNS.mkdir(exist_ok=True)
dropped = set((ROOT / "dropped").read_text().split()) if (ROOT / "dropped").exists() else set()


def say(*a):
    line = f"[{time.monotonic() - t0:6.0f}s] " + " ".join(str(x) for x in a)
    print(line, flush=True)
    with open(OUT / "sweep.log", "a") as f:
        f.write(line + "\n")


def overrides(name):
    return ARMS[name[0]] + [f"train.seed={name[1:]}"] + COMMON


def step_of(name):
    log = RUNS / f"{name}.log"
    found = re.findall(r"step (\d+)/", log.read_text()) if log.exists() else []
    return int(found[-1]) if found else 0


def finished(name):
    return (RUNS / name / "checkpoints" / f"model-{STEPS:07d}.pt").exists()


def launch(name):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [
        sys.executable,
        "-m",
        "transformer.train",
        "params/multi30k.yaml",
        *overrides(name),
        "--data",
        str(ROOT / "shards"),
        "--out",
        str(RUNS / name),
    ]
    log = open(RUNS / f"{name}.log", "a")  # noqa: SIM115 (the child writes it while it runs)
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)


def score_main(name):
    """Average the 5 best snapshots, decode val and test with the params' beam, score."""
    import pyarrow.parquet as pq

    from transformer.config import load_params
    from transformer.decoding.evaluate import score_split, tokenized_refs
    from transformer.decoding.translate import load_translator, translate_lines

    model = RUNS / f"{name}-avg.pt"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "transformer.average",
            str(RUNS / name),
            "--best",
            "5",
            "--out",
            str(model),
        ],
        check=True,
    )
    p = load_params("params/multi30k.yaml", overrides(name))
    net, sp, _ = load_translator(model, DEV)
    row = {"run": name, "overrides": overrides(name)}
    for role in ("valid", "test"):
        table = pq.read_table(ROOT / "clean" / f"{role}.parquet")
        hyps = translate_lines(net, sp, table["src"].to_pylist(), p.decode, DEV)
        (RUNS / f"{name}-{role}.hyp").write_text("".join(h + "\n" for h in hyps))
        s = score_split(
            hyps,
            table["tgt"].to_pylist(),
            p.score,
            p.data.tgt_lang,
            tokenized_refs(p.score, p.data, role),
        )
        row.update({f"{role}_{k}": v for k, v in s.items() if isinstance(v, (int, float))})
    (OUT / f"{name}.json").write_text(json.dumps(row))
    say("SCORED", json.dumps(row))


scorers = []


def score(name):
    if not (OUT / f"{name}.json").exists():
        scorers.append(
            subprocess.Popen([sys.executable, sys.argv[0], str(OUT), "0", "--score", name])
        )


if sys.argv[3:4] == ["--score"]:
    score_main(sys.argv[4])
    sys.exit(0)

todo = [n for n in ORDER if n not in dropped and not finished(n)]
procs = {n: launch(n) for n in todo}
say("launched", " ".join(todo), "steps now", {n: step_of(n) for n in todo})
for n in ORDER:
    if n not in dropped and finished(n):
        score(n)
first = {n: (time.monotonic(), step_of(n)) for n in procs}
adapted = not ADAPT
while procs and time.monotonic() - t0 < WINDOW:
    time.sleep(15)
    for n, p in list(procs.items()):
        if p.poll() is not None:
            del procs[n]
            say(n, "exited", p.returncode, "step", step_of(n))
            if finished(n):
                score(n)
    el = time.monotonic() - t0
    if el < 60:  # rates from t=60 s: past the start-up of all the processes at once
        first = {n: (time.monotonic(), step_of(n)) for n in procs}
    rates = {n: (step_of(n) - first[n][1]) / (time.monotonic() - first[n][0]) for n in procs}
    say(
        "steps", {n: step_of(n) for n in procs}, "upd/s", {n: round(r, 2) for n, r in rates.items()}
    )
    if not adapted and el > 150:
        # project: all procs share the GPU; dropping runs speeds the others roughly in proportion
        while procs:
            slow = min(rates[n] for n in procs)
            need = max((STEPS - step_of(n)) for n in procs) / max(slow, 1e-6)
            left = BUDGET_S - el
            if need <= left:
                break
            victim = [n for n in ORDER if n in procs][-1]
            procs.pop(victim).kill()
            dropped.add(victim)
            (ROOT / "dropped").write_text(" ".join(sorted(dropped)))
            k = len(procs)
            for n in procs:
                rates[n] *= (k + 1) / k if k else 1
            say("DROP", victim, f"need {need:.0f}s > left {left:.0f}s")
        adapted = True
for p in procs.values():
    p.send_signal(signal.SIGTERM)
for n, p in procs.items():
    p.wait()
    say(n, "stopped at step", step_of(n))
    if finished(n):
        score(n)
for p in scorers:
    p.wait()
say("done")
