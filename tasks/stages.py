"""The pipeline's stages, declared once: the table below is the DAG.

Each row names a stage, the params sections whose identity decides its output, the stages
whose outputs it reads, and the library function that does the work. From the table follow
the flow (flows/pipeline.py runs the rows the params ask for, in order), the folder
layout, reuse, and the MLflow child runs (tasks/runner.py). A new stage is one row here and
one library function; a new params section for it, if it needs one, goes in
transformer/config/schema.py.

A stage writes into `<work>/<stage>/<key>`; the key hashes the identity of its params
sections (config.operational keys left out), the fingerprints of its inputs' outputs, and,
for a stage that reads files from outside the work dir, their sha256. A finished stage
leaves `stage.json` in its folder: data (paths, sizes, fingerprints), never a pickle, and
verified against the folder before it is trusted. So two runs that differ only in `train.*`
share download, clean, vocabulary and shards; raising `train.max_steps` resumes the same
training folder; and nothing read back from the work dir can execute code.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from tasks.distill import (
    distill_devices,
    distill_notes,
    distilling,
    gather_teachers,
    teacher_files,
    teacher_models,
    teacher_notes,
    teacher_rows,
    teacher_runs,
    teacher_tags,
)
from tasks.settings import RunParams
from tasks.train import cooldown_runs, launch_training, train_cooldowns, trained, training_request
from transformer.config import fingerprint, identity
from transformer.data.clean import clean_corpus
from transformer.data.shard import encode_and_shard
from transformer.data.sources import input_fingerprints, prepare_source
from transformer.data.vocab import learn_vocab
from transformer.decoding.distill import distill_corpus
from transformer.decoding.evaluate import decode_and_score, reference_fingerprints
from transformer.decoding.export import export_formats
from transformer.files import (
    CLEAN_REPORT,
    MANIFEST,
    MODEL,
    PREPARE_REPORT,
    SCORES,
    SPM_MODEL,
    hypotheses,
)
from transformer.training.average import export_average


@dataclass(frozen=True)
class StageRun:
    """What a stage's function gets: the params, its inputs' output folders and reports by
    stage name, its own output folder, and the pipeline run it belongs to."""

    params: RunParams
    inputs: dict[str, Path]
    reports: dict[str, dict]
    out: Path
    params_file: Path
    tracking: dict[str, str]  # uri, run_id (the pipeline's MLflow run), stage_run_id
    device: str


@dataclass(frozen=True)
class Shown:
    """What of a finished stage the pipeline's MLflow run, its description and the Prefect
    artifact show (tasks/publish.py reads nothing else): each hook takes the stage's report."""

    files: tuple[tuple[str, str], ...] = ()  # (a file or folder of the stage's, folder on the run)
    tags: Callable[[dict], dict[str, str]] | None = None
    scores: Callable[[dict], dict[str, dict]] | None = None  # results rows: {label: {split: ...}}
    notes: Callable[[dict], list[str]] | None = None  # lines of the run's description
    model: str | None = None  # the stage's file that is the run's model: tagged, registered
    step: Callable[[dict], int] | None = None  # the update the run's model was trained to
    paths: tuple[tuple[str, str], ...] = ()  # (label, file of the stage's) for the closing lines


OWN = "model"  # the results row of the run's own model (decode's); its scores are dev/*, test/*


@dataclass(frozen=True)
class Stage:
    name: str
    params: tuple[str, ...]  # dotted params sections whose identity names the output
    inputs: tuple[str, ...]  # the stages whose outputs it reads
    run: Callable[[StageRun], Any]  # the work; may return a JSON-able report
    artifacts: tuple[str, ...] = ()  # files or folders of the output logged to its MLflow run
    # Files read from outside the work dir: their sha256 is part of the key.
    external: Callable[[RunParams], dict[str, str]] | None = None
    # A stage that can be extended (training): is the finished record what the params ask
    # for? If not, the stage runs again in the same folder and continues.
    satisfied: Callable[[RunParams, dict], bool] | None = None
    # What of the stage's report downstream stages depend on (training: the step reached
    # and the snapshots kept), hashed into its fingerprint; None: the key says it all.
    output: Callable[[dict], Any] | None = None
    # Whether the params ask for the stage at all; None: always. One not asked for has no
    # folder, MLflow run or record, and is no part of its readers' keys: a stage that only
    # a later key's non-default value asks for renames no folder made before it existed.
    asked: Callable[[RunParams], bool] | None = None
    # Whole pipeline runs of other params that the stage reads (a distillation's teachers):
    # {label: (params file, overrides)}. The flow runs each first, a subflow reusing what it
    # finds done, and hands its result to the stage as the input `label`.
    runs: Callable[[RunParams, Path], dict[str, tuple[str, list[str]]]] | None = None
    shown: Shown | None = None  # what the pipeline's run shows of it; None: its child run only


STAGES: tuple[Stage, ...] = (
    Stage("prepare", ("data",), (),
          lambda r: prepare_source(r.params.data, r.out),
          artifacts=(PREPARE_REPORT,), external=lambda p: input_fingerprints(p.data)),
    Stage("clean", ("clean",), ("prepare",),
          lambda r: clean_corpus(r.inputs["prepare"], r.params.clean, r.out),
          artifacts=(CLEAN_REPORT,)),
    Stage("teachers", (), (), gather_teachers,
          external=teacher_files, asked=distilling, runs=teacher_runs,
          shown=Shown(scores=teacher_rows, tags=teacher_tags, notes=teacher_notes)),
    Stage("distill", ("distill", "score"), ("clean", "teachers"),
          lambda r: distill_corpus(r.inputs["clean"],
                                   teacher_models(r.reports["teachers"], r.out.parents[1]),
                                   r.params.distill, r.params.data, r.params.score, r.out,
                                   distill_devices(r.params)),
          artifacts=(hypotheses("valid"), hypotheses("test")),
          external=lambda p: reference_fingerprints(p.score, p.data), asked=distilling,
          shown=Shown(scores=lambda rep: {"ensemble": rep["scores"]}, notes=distill_notes)),
    Stage("vocab", ("vocab",), ("clean",),
          lambda r: learn_vocab(r.inputs["clean"] / "train.parquet", r.params.vocab, r.out),
          artifacts=(SPM_MODEL,)),
    # A distilled corpus, where the params ask for one, stands in for the cleaned one; the
    # vocabulary stays the cleaned corpus's, the teachers' (a student can join their ensemble).
    Stage("shards", ("shard",), ("clean", "vocab", "distill"),
          lambda r: encode_and_shard(r.inputs.get("distill", r.inputs["clean"]),
                                     r.inputs["vocab"] / SPM_MODEL, r.params.shard, r.out),
          artifacts=(MANIFEST,),
          shown=Shown(files=((MANIFEST, "data"), (SPM_MODEL, "data")),
                      tags=lambda rep: {"data_fingerprint": rep["fingerprint"]})),
    Stage("train", ("model", "train"), ("shards",),
          lambda r: launch_training(r, r.inputs["shards"]),
          satisfied=lambda p, record: record["report"]["request"] == training_request(p),
          output=trained, shown=Shown(step=lambda rep: rep["step"])),
    Stage("cooldowns", ("average.cooldowns",), ("train", "shards"),
          lambda r: train_cooldowns(r, r.inputs["train"], r.inputs["shards"]),
          output=lambda report: {name: trained(run) for name, run in report.items()},
          asked=lambda p: p.average.cooldowns > 1),
    Stage("average", ("average",), ("train", "cooldowns", "shards"),
          lambda r: export_average(r.inputs["train"], r.params.average, r.out / MODEL,
                                   max_step=r.params.train.max_steps,
                                   branches=cooldown_runs(r.inputs.get("cooldowns"),
                                                          r.params.average.cooldowns)),
          artifacts=(MODEL,), shown=Shown(files=((MODEL, "model"),), model=MODEL)),
    Stage("decode", ("decode", "score"), ("average", "clean"),
          lambda r: decode_and_score(r.inputs["average"] / MODEL, r.inputs["clean"],
                                     r.params.data, r.params.decode, r.params.score,
                                     r.out, r.device),
          artifacts=(SCORES, hypotheses("valid"), hypotheses("test"), "attention"),
          external=lambda p: reference_fingerprints(p.score, p.data),
          shown=Shown(files=((hypotheses("valid"), "hypotheses"),
                             (hypotheses("test"), "hypotheses"), ("attention", "attention")),
                      scores=lambda rep: {OWN: rep}, paths=(("hypotheses", hypotheses("test")),))),
    Stage("export", ("export",), ("average",),
          lambda r: export_formats(r.inputs["average"] / MODEL, r.params.export, r.out),
          artifacts=("ctranslate2", "huggingface")),
)  # fmt: skip


def named(name: str) -> Stage:
    """The row of that name, looked up in the table as it is now."""
    return next(stage for stage in STAGES if stage.name == name)


def stage_key(stage: Stage, params: RunParams, inputs: dict[str, str]) -> str:
    """The name of the stage's folder: identity of its params sections, its inputs'
    fingerprints (by stage name), and the sha256 of the files it reads from outside."""
    sections = {name: _identity_at(params, name) for name in stage.params}
    outside = stage.external(params) if stage.external else {}
    return fingerprint(stage.name, sections, inputs, outside)


def _identity_at(params: BaseModel, dotted: str) -> Any:
    node: Any = params
    for part in dotted.split("."):
        node = getattr(node, part)
    return identity(node) if isinstance(node, BaseModel) else node
