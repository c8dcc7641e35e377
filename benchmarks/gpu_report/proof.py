"""The proof's plan (issue #47): what the speed work changed, measured in one run of at most
8 minutes on one H100 or H200, beside the project's targets. Each section runs in a process
of its own under its time limit: one that overruns is killed, recorded as such with what it
had measured, and the next one starts; one with less than half its limit left of --budget
is skipped, saying so."""

from __future__ import annotations

from dataclasses import dataclass

from benchmarks.gpu_report.plan import Plan, Section
from benchmarks.gpu_report.targets import best_of, get, ratio, rows, target


@dataclass(frozen=True)
class Sizes:
    """What each section measures: config names of plan.CONFIGS."""

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


GPU = Sizes(
    "gpu", base="base", big="big", max_tokens=32768, fixed=4, warmup=4, steps=12, profiled=3,
    loop_steps=100, loop_pairs=100_000, loop_max_len=250, beam=("base", 2000),
    cpu_beam=("smoke", 500), rounds=2,
)  # fmt: skip
CPU = Sizes(
    "cpu", base="smoke", big="smoke", max_tokens=2048, fixed=4, warmup=4, steps=4, profiled=2,
    loop_steps=50, loop_pairs=5000, loop_max_len=100, beam=("smoke", 200),
    cpu_beam=("smoke", 200), rounds=1,
)  # fmt: skip
TINY = Sizes(
    "tiny", base="tiny", big="tiny", max_tokens=256, fixed=2, warmup=2, steps=2, profiled=1,
    loop_steps=10, loop_pairs=400, loop_max_len=20, beam=("tiny", 12), cpu_beam=("tiny", 12),
    rounds=1,
)  # fmt: skip


def targets(sections: dict, device: str, sizes: Sizes) -> list[dict]:
    """The project's targets beside this run's best figures, and which GPU measured them."""
    gpu_why = "--tiny sizes" if sizes is TINY else None if sizes is GPU else "not on a GPU"
    on = device + (": H200, not an H100" if "H200" in device else "")
    loop = lambda name: best_of(
        [r for r in rows(sections, "real-loop") if r["config"] == name], "tgt tok/s"
    )
    beams = [r for r in rows(sections, "beam") if "ours" in r["search"]]
    gpu_beam = best_of(
        [r for r in beams if r["device"] == "cuda" and r["config"] == sizes.beam[0]], "sent/s"
    )
    cpu = lambda r: r["device"] == "cpu" and r["config"] == sizes.cpu_beam[0]
    cpu_ours = best_of([r for r in beams if cpu(r)], "sent/s")
    ct2 = next((r for r in rows(sections, "beam") if cpu(r) and "CTranslate2" in r["search"]), None)
    found = [
        (f"{sizes.base} real loop, target tokens/s", loop(sizes.base), "tgt tok/s", 550_000),
        (f"{sizes.big} real loop, target tokens/s", loop(sizes.big), "tgt tok/s", 250_000),
        (f"beam 4 {sizes.beam[0]}, sentences/s", gpu_beam, "sent/s", 1500),
    ]
    made = [
        {**target(name, get(row, key), least, gpu_why), "measured by": by_what(row), "on": on}
        for name, row, key, least in found
    ]
    cpu_why = "--tiny sizes" if sizes is TINY else None
    cpu_name = f"CPU beam 4 {sizes.cpu_beam[0]}: ours / CTranslate2 sentences/s"
    cpu_target = target(cpu_name, ratio(cpu_ours, ct2, "sent/s"), 1.0, cpu_why)
    return [*made, {**cpu_target, "measured by": by_what(cpu_ours), "on": "the host's CPU"}]


def by_what(row: dict | None) -> str | None:
    if row is None:
        return None
    return f"{row['settings']} settings" if "settings" in row else row.get("search")


def summary(sections: dict, sizes: Sizes) -> dict[str, list[dict]]:
    """Per config, target tokens/s on the fixed shapes: eager before, after, compiled, graphs."""
    labels = {
        "eager-before": "before",
        "eager-after": "after",
        "compile": "compiled",
        "cuda-graphs": "CUDA graphs",
    }
    made = []
    for name in sizes.configs:
        row = {"config": name}
        for title, label in labels.items():
            found = config_row(sections, title, name)
            row[f"{label} tgt tok/s"] = found.get("tgt tok/s")
            row[f"{label} kernels/update"] = found.get("kernels/update")
        before, after = row["before tgt tok/s"], row["after tgt tok/s"]
        row["after / before"] = after / before if before and after else None
        # The graphs run on two of the batches: their gain is against eager on those two.
        graphs = config_row(sections, "cuda-graphs", name)
        row["CUDA graphs / eager, their batches"] = graphs.get("graphs / eager")
        made.append(row)
    return {"Fixed shapes, target tokens/s": made}


def config_row(sections: dict, title: str, name: str) -> dict:
    """Section `title`'s row of config `name`, or {}."""
    return next((r for r in rows(sections, title) if r["config"] == name), {})


PLAN = Plan(
    "proof",
    "GPU proof",
    sections=(  # 470 s together: under 8 minutes with the start and the reports
        Section("environment", "machine:environment", 15),
        Section("eager-before", "fixed_shapes:eager", 40, before=True),
        Section("eager-after", "fixed_shapes:eager", 40),
        Section("compile", "compiled:compiled", 55),
        Section("cuda-graphs", "cuda_graphs:cuda_graphs", 40),
        Section("real-loop", "train_loop:real_loop", 210),
        Section("beam", "decode:beam", 70),
    ),
    sizes={s.name: s for s in (GPU, CPU, TINY)},
    budget=470.0,  # the run under 8 minutes
    targets=targets,
    summary=summary,
)
