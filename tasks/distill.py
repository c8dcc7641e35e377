"""A distillation's teachers, for the stage table's `teachers` and `distill` rows: the
pipeline runs that train them (seeds of a params file, each a run of its own, found done in
the work dir when another student or a plain run made it), or exported model files; the
record that lists them, which the distill stage reads; what the student's run shows of them.
"""

from __future__ import annotations

from pathlib import Path

from tasks.settings import RunParams, load_run_params
from transformer.config import ParamsError
from transformer.files import file_sha256


def distilling(params: RunParams) -> bool:
    return params.distill is not None


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
        if not Path(model).is_file():
            raise ParamsError(f"distill.teachers.models: {model}: no such model file")


def teacher_files(params: RunParams) -> dict[str, str]:
    """sha256 of the teacher model files the params name (none for teachers trained here:
    their fingerprints come with their runs)."""
    return {str(Path(m).resolve()): file_sha256(m) for m in params.distill.teachers.models}


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
        teachers.append({"label": f"teacher-{i}", "model": str(path),
                         "fingerprint": file_sha256(path)[:16]})  # fmt: skip
    return {"teachers": teachers}


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
