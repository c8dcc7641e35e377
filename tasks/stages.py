"""The pipeline's stages, declared once: the table below is the DAG.

Each row names a stage, the params sections whose identity decides its output, the stages
whose outputs it reads, and the library function that does the work. From the table follow
the flow (flows/wmt14_ende.py runs the rows the params ask for, in order), the folder
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

from tasks.settings import RunParams
from tasks.train import cooldown_runs, launch_training, train_cooldowns, trained, training_request
from transformer.config import fingerprint, identity
from transformer.data.clean import clean_corpus
from transformer.data.shard import encode_and_shard
from transformer.data.sources import input_fingerprints, prepare_source
from transformer.data.vocab import learn_vocab
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
    """What a stage's function gets: the params, its inputs' output folders by stage name,
    its own output folder, and the pipeline run it belongs to."""

    params: RunParams
    inputs: dict[str, Path]
    out: Path
    params_file: Path
    tracking: dict[str, str]  # uri, run_id (the pipeline's MLflow run), stage_run_id
    device: str


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


STAGES: tuple[Stage, ...] = (
    Stage("prepare", ("data",), (),
          lambda r: prepare_source(r.params.data, r.out),
          artifacts=(PREPARE_REPORT,), external=lambda p: input_fingerprints(p.data)),
    Stage("clean", ("clean",), ("prepare",),
          lambda r: clean_corpus(r.inputs["prepare"], r.params.clean, r.out),
          artifacts=(CLEAN_REPORT,)),
    Stage("vocab", ("vocab",), ("clean",),
          lambda r: learn_vocab(r.inputs["clean"] / "train.parquet", r.params.vocab, r.out),
          artifacts=(SPM_MODEL,)),
    Stage("shards", ("shard",), ("clean", "vocab"),
          lambda r: encode_and_shard(r.inputs["clean"], r.inputs["vocab"] / SPM_MODEL,
                                     r.params.shard, r.out),
          artifacts=(MANIFEST,)),
    Stage("train", ("model", "train"), ("shards",), launch_training,
          satisfied=lambda p, record: record["report"]["request"] == training_request(p),
          output=trained),
    Stage("cooldowns", ("average.cooldowns",), ("train", "shards"), train_cooldowns,
          output=lambda report: {name: trained(run) for name, run in report.items()},
          asked=lambda p: p.average.cooldowns > 1),
    Stage("average", ("average",), ("train", "cooldowns", "shards"),
          lambda r: export_average(r.inputs["train"], r.params.average, r.out / MODEL,
                                   max_step=r.params.train.max_steps,
                                   branches=cooldown_runs(r.inputs.get("cooldowns"),
                                                          r.params.average.cooldowns)),
          artifacts=(MODEL,)),
    Stage("decode", ("decode", "score"), ("average", "clean"),
          lambda r: decode_and_score(r.inputs["average"] / MODEL, r.inputs["clean"],
                                     r.params.data, r.params.decode, r.params.score,
                                     r.out, r.device),
          artifacts=(SCORES, hypotheses("valid"), hypotheses("test"), "attention"),
          external=lambda p: reference_fingerprints(p.score, p.data)),
    Stage("export", ("export",), ("average",),
          lambda r: export_formats(r.inputs["average"] / MODEL, r.params.export, r.out),
          artifacts=("ctranslate2", "huggingface")),
)  # fmt: skip
BY_NAME = {stage.name: stage for stage in STAGES}


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
