"""The report's plan: what this project does on a GPU machine, measured in one run of under
9 minutes beside its targets. Its sections run in the runner's process, in order; one that
would start after --budget seconds is skipped, saying so."""

from __future__ import annotations

from dataclasses import dataclass

from benchmarks.gpu_report.plan import Plan, Section
from benchmarks.gpu_report.targets import find, get, ratio, rows, target


@dataclass(frozen=True)
class Shapes:
    """The environment section's attention calls: h heads of d_k; training calls at the
    (rows, length) shapes of `train`, then once each at the new shapes of `sweep`; beam
    search over `sentences` x 4 hypotheses for `steps` steps, a new key length each."""

    heads: int
    d_k: int
    train: tuple[tuple[int, int], ...]
    sweep: tuple[tuple[int, int], ...]
    sentences: int
    steps: int
    reps: int  # timed calls at each representative shape


@dataclass(frozen=True)
class Sizes:
    """What each section measures. A case's device "main" is --device's; "cpu" the CPU's."""

    name: str
    step_cases: tuple[tuple[str, int, str], ...]  # train step: (config, max_tokens, device)
    timed_steps: int
    warmup_steps: int
    loop_cases: tuple[tuple[str, int], ...]  # train loop: (config, updates)
    compile_cases: tuple[tuple[str, int], ...]  # the same under torch.compile, last
    profile_cases: tuple[tuple[str, str, int], ...]  # ("train", config, max_tokens) or
    # ("beam", config, sentences)
    loop_pairs: int  # the synthetic corpus
    loop_max_len: int
    decode_cases: tuple[tuple[str, str, int], ...]  # (config, device, sentences)
    default_sentences: int  # beam search under torch's default kernels (CUDA only)
    overfit: tuple[str, int, int]  # bf16 vs fp32: (config, max_tokens, steps)
    checkpoint: str
    cpu_config: str  # the model of the CPU targets
    shapes: Shapes


WMT_SWEEP = tuple((32768 // n, n) for n in range(40, 104, 8))  # 32k-token batches
GPU = Sizes(
    "gpu",
    step_cases=(("base", 8192, "main"), ("base", 32768, "main"), ("big", 8192, "main"),
                ("big", 32768, "main"), ("smoke", 2048, "cpu")),
    timed_steps=20, warmup_steps=5,
    loop_cases=(("base", 300), ("big", 200)), loop_pairs=100_000, loop_max_len=250,
    compile_cases=(("base compile", 100), ("big compile", 80)),
    profile_cases=(("train", "base", 8192), ("train", "base", 32768), ("beam", "base", 500)),
    decode_cases=(("base", "main", 2000), ("big", "main", 1000), ("smoke", "cpu", 500)),
    default_sentences=128, overfit=("base", 4096, 100), checkpoint="big", cpu_config="smoke",
    shapes=Shapes(8, 64, ((1024, 32), (128, 256)), WMT_SWEEP, 256, 60, 20),
)  # fmt: skip
CPU = Sizes(
    "cpu",
    step_cases=(("smoke", 1024, "main"), ("smoke", 2048, "main")), timed_steps=5, warmup_steps=1,
    loop_cases=(("smoke", 50),), loop_pairs=5000, loop_max_len=100, compile_cases=(),
    profile_cases=(("train", "smoke", 2048), ("beam", "smoke", 100)),
    decode_cases=(("smoke", "main", 200),), default_sentences=32,
    overfit=("smoke", 1024, 30), checkpoint="smoke", cpu_config="smoke",
    shapes=Shapes(4, 32, ((64, 32), (16, 128)), ((48, 40), (40, 48), (32, 56), (28, 64)), 32,
                  20, 3),
)  # fmt: skip
TINY = Sizes(
    "tiny",
    step_cases=(("tiny", 128, "main"), ("tiny", 256, "main")), timed_steps=2, warmup_steps=1,
    loop_cases=(("tiny", 8),), loop_pairs=400, loop_max_len=20, compile_cases=(),
    profile_cases=(("train", "tiny", 256), ("beam", "tiny", 8)),
    decode_cases=(("tiny", "main", 12),), default_sentences=4,
    overfit=("tiny", 128, 5), checkpoint="tiny", cpu_config="tiny",
    shapes=Shapes(2, 16, ((8, 16),), ((6, 20), (5, 24)), 4, 4, 1),
)  # fmt: skip


def targets(sections: dict, device: str, sizes: Sizes) -> list[dict]:
    """The project's targets beside what this run measured; the GPU's judged on one H100."""
    gpu_why = gpu_judgement(device, sizes)
    cpu_why = "--tiny sizes" if sizes is TINY else None
    loop = lambda cfg: find(sections, "train loop", config=cfg)
    beam = lambda cfg, dev, search: find(sections, "decode", config=cfg, device=dev, search=search)
    base_beam = beam("base", "cuda", "beam 4, ours")
    cpu = sizes.cpu_config
    ours_cpu, ct2_cpu = beam(cpu, "cpu", "beam 4, ours"), beam(cpu, "cpu", "beam 4, CTranslate2")
    step = cpu_step_rows(sections, cpu)
    return [
        target(
            "base training, target tokens/s (one H100, the real loop)",
            get(loop("base"), "tgt tok/s"),
            550_000,
            gpu_why,
        ),
        target(
            "big training, target tokens/s (one H100, the real loop)",
            get(loop("big"), "tgt tok/s"),
            250_000,
            gpu_why,
        ),
        target(
            "beam-4 base, sentences/s (one H100, WMT-like lengths)",
            get(base_beam, "sent/s"),
            1500,
            gpu_why,
        ),
        target(
            f"CPU beam 4: ours / CTranslate2 sentences/s ({cpu} model)",
            ratio(ours_cpu, ct2_cpu, "sent/s"),
            0.8,
            cpu_why,
        ),
        target(
            f"CPU training step: ours / torch.nn.Transformer tokens/s ({cpu} model)",
            ratio(step.get("ours"), step.get("torch.nn.Transformer"), "tgt_tok/s"),
            1.2,
            cpu_why,
        ),
    ]


def gpu_judgement(device: str, sizes: Sizes) -> str | None:
    """Why the one-H100 targets are not judged in this run, or None."""
    if sizes is TINY:
        return "--tiny sizes"
    if sizes is CPU:
        return "not on a GPU"
    return None if "H100" in device else f"the targets are for one H100, this is {device}"


def cpu_step_rows(sections: dict, cfg: str) -> dict[str, dict]:
    """The CPU training-step rows of `cfg` at its largest micro-batch, by model."""
    found = [
        r for r in rows(sections, "train step") if r["config"] == cfg and r.get("device") == "cpu"
    ]
    largest = max((r["max_tok"] for r in found), default=None)
    return {r["model"]: r for r in found if r["max_tok"] == largest}


PLAN = Plan(
    "report",
    "GPU report",
    sections=(  # the tests early: what the report's figures rest on gets its time first
        Section("environment", "attention_backends:environment"),
        Section("gpu tests", "gpu_tests:gpu_tests"),
        Section("train step", "train_step:train_step"),
        Section("train loop", "train_loop:train_loop"),
        Section("decode", "decode:decode"),
        Section("bf16 vs fp32", "precision:precision"),
        Section("checkpoint", "checkpoint:checkpoint"),
        Section("profile", "profiling:profile"),
        Section("train loop, compiled", "train_loop:compiled_loop"),
    ),
    sizes={s.name: s for s in (GPU, CPU, TINY)},
    budget=480.0,  # a run of under 9 minutes
    targets=targets,
)
