"""A distillation's teachers, for the stage table's `teachers` and `distill` rows: the
pipeline runs that train them (seeds of a params file, each a run of its own, found done in
the work dir when another student or a plain run made it), or model files: exported ones, or
versions of registered models (`models:/NAME/VERSION`, `models:/NAME@ALIAS`) fetched from
the run's MLflow registry into the work dir; the record that lists them, which the distill
stage reads; what the student's run shows of them.
"""

from __future__ import annotations

import re
from pathlib import Path

import mlflow
import torch

from tasks.settings import RunParams, load_run_params
from tasks.tracking import client_for, store_errors
from transformer.config import ParamsError
from transformer.files import MODEL, atomic_dir, file_sha256

# models:/NAME/VERSION or models:/NAME@ALIAS; a name that is a plain folder name, as the
# fetched file's folder is named by it.
REGISTERED = re.compile(
    r"models:/(?P<name>[A-Za-z0-9][\w.-]*)(?:/(?P<version>\d+)|@(?P<alias>[\w-]+))"
)
FETCHED = "registry"  # the work dir's folder of fetched teachers: registry/NAME/VERSION/model.pt


def distilling(params: RunParams) -> bool:
    return params.distill is not None


def distill_devices(params: RunParams) -> list[str]:
    """Where the distill stage translates, a process each: this machine's GPUs, as many as
    the local launcher's pipeline.nproc_per_node if it names fewer; on a machine without,
    that many CPU processes (1 by default), which share its cores. (A Slurm launcher's
    nproc_per_node counts a cluster node's processes, not this machine's.)"""
    pipeline, gpus = params.pipeline, torch.cuda.device_count()
    asked = pipeline.nproc_per_node if pipeline.launcher == "local" else None
    if gpus:
        return [f"cuda:{i}" for i in range(min(asked or gpus, gpus))]
    return ["cpu"] * (asked or 1)


def teacher_runs(params: RunParams, params_file: Path) -> dict[str, tuple[str, list[str]]]:
    """{label: (params file, overrides)} of the pipeline runs that train the teachers: the
    teachers' params file (relative to `params_file`, as `extends`), once per seed."""
    teachers = params.distill.teachers
    if teachers.params is None:
        return {}
    path = str(Path(params_file).parent / teachers.params)
    return {
        f"teacher-{i}": (path, [*teachers.overrides, f"train.seed={seed}"])
        for i, seed in enumerate(teachers.seeds, 1)
    }


def check_teachers(params: RunParams, params_file: Path) -> None:
    """Before anything runs: each teacher's params load, and none distills in turn (one
    level: a teacher trains on its corpus); each teacher model file is there. ParamsError,
    one line naming the key."""
    if not distilling(params):
        return
    for label, (path, overrides) in teacher_runs(params, params_file).items():
        try:
            teacher = load_run_params(path, overrides)
        except ParamsError as err:
            raise ParamsError(f"distill.teachers ({label}): {err}") from None
        if teacher.distill is not None:
            raise ParamsError(f"distill.teachers.params: {path} distills in turn; a teacher "
                              "trains on its corpus (one level of distillation)")  # fmt: skip
    for model in params.distill.teachers.models:
        if model.startswith("models:/"):
            if not REGISTERED.fullmatch(model):
                raise ParamsError(f"distill.teachers.models: {model}: not models:/NAME/VERSION "
                                  "or models:/NAME@ALIAS (a name of letters, digits, '.', '_', "
                                  "'-')")  # fmt: skip
        elif not Path(model).is_file():
            raise ParamsError(f"distill.teachers.models: {model}: no such model file")


def fetch_registered(params: RunParams, uri: str, work: Path) -> RunParams:
    """The params with each registered teacher replaced by its model file, fetched once
    from the registry at `uri` into work/registry/NAME/VERSION/ (an alias is read once,
    here: the version it names now is the teacher for the whole run). The key stays the
    file's sha256, as for any teacher file."""
    if not distilling(params):
        return params
    teachers = params.distill.teachers
    models = [_fetched(m, uri, work) if REGISTERED.fullmatch(m) else m for m in teachers.models]
    if models == teachers.models:
        return params
    distill = params.distill.model_copy(
        update={"teachers": teachers.model_copy(update={"models": models})}
    )
    return params.model_copy(update={"distill": distill})


def _fetched(model: str, uri: str, work: Path) -> str:
    match = REGISTERED.fullmatch(model)
    name, alias = match["name"], match["alias"]
    with store_errors(uri):
        client = client_for(uri)
        try:
            version = (client.get_model_version_by_alias(name, alias) if alias
                       else client.get_model_version(name, match["version"])).version  # fmt: skip
        except mlflow.exceptions.MlflowException:
            raise ParamsError(f"distill.teachers.models: {model}: no such registered model "
                              "version in the run's MLflow registry") from None  # fmt: skip
        path = work / FETCHED / name / str(version) / MODEL
        if not path.is_file():
            source = client.get_model_version_download_uri(name, version).rstrip("/")
            with atomic_dir(path.parent) as folder:  # a model.pt whole, or none
                # The pyfunc's data: the one model file it was logged with (tasks/registry.py).
                data = mlflow.artifacts.download_artifacts(
                    f"{source}/data", dst_path=str(folder), tracking_uri=uri
                )
                files = list(Path(data).iterdir())
                if len(files) != 1 or not files[0].is_file():
                    raise ParamsError(
                        f"distill.teachers.models: {model}: version {version} is not a model "
                        "this pipeline registered (one model file)"
                    )
                files[0].rename(folder / path.name)
                Path(data).rmdir()
    return str(path)


def teacher_files(params: RunParams) -> dict[str, str]:
    """sha256 of the teacher model files the params name, by position (none for teachers
    trained here: their fingerprints come with their runs). Not by path: a file moved, or
    a work dir copied with the teachers fetched into it, is the same teacher."""
    models = params.distill.teachers.models
    return {f"teacher-{i}": file_sha256(m) for i, m in enumerate(models, 1)}


def gather_teachers(r) -> dict:
    """The teachers stage: one list of the teachers, from the pipeline runs the flow handed
    in (`r.reports`, by label) or the model files; paths inside the work dir relative to
    it, so a moved work dir still finds them. `r`: a tasks.stages.StageRun."""
    work = r.out.parents[1]
    teachers = [
        {
            "label": label,
            "model": _relative(Path(run["model"]), work),
            "fingerprint": run["model_fingerprint"],
            "run_id": run["run_id"],
            "registered": run["registered"],
            "scores": run["scores"],
        }
        for label, run in r.reports.items()
    ]
    for i, model in enumerate(r.params.distill.teachers.models, len(teachers) + 1):
        path = Path(model).resolve()
        fingerprint = file_sha256(path)[:16]
        teachers.append({"label": f"teacher-{i}", "model": _relative(path, work),
                         "fingerprint": fingerprint, **_registered(path, work)})  # fmt: skip
    return {"teachers": teachers}


def _registered(path: Path, work: Path) -> dict[str, str]:
    """{"registered": models:/NAME/VERSION} of a teacher fetched from the registry."""
    if not path.is_relative_to(work / FETCHED):
        return {}
    name, version = path.relative_to(work / FETCHED).parts[:2]
    return {"registered": f"models:/{name}/{version}"}


def teacher_models(report: dict, work: Path) -> list[Path]:
    """The teachers' model files, from the teachers stage's report."""
    return [work / t["model"] for t in report["teachers"]]


def _relative(path: Path, work: Path) -> str:
    return str(path.relative_to(work)) if path.is_relative_to(work) else str(path)


# ----------------------------------------------------------- what the student's run shows


def teacher_rows(report: dict) -> dict[str, dict]:
    """The teachers' own scores (those trained here), a results row each."""
    return {t["label"]: t["scores"] for t in report["teachers"] if t.get("scores")}


def teacher_tags(report: dict) -> dict[str, str]:
    return {
        "distill.teacher_models": ", ".join(_name(t) for t in report["teachers"]),
        "distill.teacher_runs": ", ".join(t["run_id"] for t in report["teachers"] if "run_id" in t),
    }


def teacher_notes(report: dict) -> list[str]:
    lines = [f"Distilled from {len(report['teachers'])} teachers:"]
    for t in report["teachers"]:
        run = f", MLflow run `{t['run_id']}`" if "run_id" in t else ""
        lines.append(f"- {t['label']}: `{_name(t)}`{run}")
    return lines


def distill_notes(report: dict) -> list[str]:
    side = report["replace"]
    return [
        f"Trained on {report['pairs']:,} pairs: {report['distilled']:,} with the {side} side "
        f"translated by the teachers' ensemble, {report['originals']:,} original."
    ]


def _name(teacher: dict) -> str:
    return teacher.get("registered") or teacher["model"]
