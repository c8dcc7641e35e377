"""The end of a run: its results on the pipeline's MLflow run (metrics, tags, a description
with the scores, the training curve and the attention maps), in the flow's log, and as a
Prefect artifact (a table, with links to the MLflow run and model), however the run was
started (command line, deployment, schedule)."""

from __future__ import annotations

import tempfile
from pathlib import Path

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact

from tasks.credentials import redact
from tasks.registry import register
from tasks.report import plot_training_curve
from tasks.runner import user_failure
from tasks.stages import OWN, named
from tasks.tracking import client_for, log_metrics, numbers, store_errors

# Final scores of the averaged model with beam search: the valid split as dev/*, the test
# split as test/*. During training, valid/* is the curve of validations (greedy by default).
ROLES = {"valid": "dev", "test": "test"}
# The scores of a results table: (key in a split's scores, column), the last two where the
# params ask for them.
COLUMNS = (
    ("bleu", "BLEU"),
    ("bleu_lc", "BLEU lowercased"),
    ("chrf", "chrF"),
    ("bleu_tok_lc", "BLEU lc+tok (as published)"),
    ("bleu_tok_compound", "BLEU tok+compound-split (the paper's)"),
)
LOCAL_UI = "http://127.0.0.1:5000"  # where `mlflow ui` serves a local store by default
# MLflow 3.17's UI takes its view (GenAI or model training) from the browser's last choice,
# GenAI at first, before the experiment's kind: links ask for the training view.
TRAINING_VIEW = "?workflowType=machine_learning"


@task(name="publish", persist_result=False)
def publish(run: dict, records: dict[str, dict]):
    """The summary, or a Failed state with one line if the store fails (runner.ONE_LINE)."""
    try:
        with store_errors(run["uri"]):
            return _publish(run, records)
    except Exception as err:
        return user_failure("publish", err)


def _publish(run: dict, records: dict[str, dict]) -> dict:
    client, run_id = client_for(run["uri"]), run["run_id"]
    shown = Showing(records)
    scores = shown.rows[OWN]
    log_metrics(client, run_id, score_metrics(shown.rows), step=shown.step)
    test = scores["test"]
    tags = {
        "sacrebleu_signature": test["bleu_signature"],
        "sacrebleu_lc_signature": test["bleu_lc_signature"],
        "chrf_signature": test["chrf_signature"],
        "model_path": str(shown.model),
        **shown.tags,
    }
    for key, value in tags.items():
        client.set_tag(run_id, key, value)
    _upload(client, run_id, shown.files)
    version = register(run, shown.model, scores, shown.model_fingerprint, shown.tags)
    with tempfile.TemporaryDirectory() as tmp:  # redrawn from MLflow: every logged point
        client.log_artifact(
            run_id, str(plot_training_curve(client, [run_id], Path(tmp) / "curve.png"))
        )
    summary = {
        "run_id": run_id,
        "tracking_uri": redact(run["uri"]),
        "run_url": run_url(run["uri"], run.get("experiment_id"), run_id),
        "model": str(shown.model),
        "model_fingerprint": shown.model_fingerprint,
        "registered": f"models:/{run['registered_model']}/{version}",
        "paths": shown.paths,
        "step": shown.step,
        "scores": scores,
        "rows": shown.rows,
        "notes": shown.notes,
    }
    client.set_tag(run_id, "mlflow.note.content", description(summary))  # the run's description
    get_run_logger().info("\n".join(summary_lines(summary)))
    create_markdown_artifact(
        key="wmt14-ende-results",
        markdown=artifact_markdown(summary, run.get("experiment_id"), run["registered_model"]),
        description=f"MLflow run {run_id}",
    )
    return summary


class Showing:
    """What the finished stages' rows say the run shows (tasks.stages.Shown), gathered."""

    def __init__(self, records: dict[str, dict]):
        self.rows: dict[str, dict] = {}
        self.tags: dict[str, str] = {}
        self.notes: list[str] = []
        self.files: list[tuple[Path, str]] = []
        self.paths: dict[str, str] = {}
        for name, record in records.items():
            shown, report, folder = named(name).shown, record["report"], Path(record["path"])
            if shown is None:
                continue
            self.rows |= shown.scores(report) if shown.scores else {}
            self.tags |= shown.tags(report) if shown.tags else {}
            self.notes += shown.notes(report) if shown.notes else []
            self.files += [(folder / file, on_run) for file, on_run in shown.files]
            self.paths |= {label: str(folder / file) for label, file in shown.paths}
            if shown.step:
                self.step = shown.step(report)
            if shown.model:
                self.model, self.model_fingerprint = folder / shown.model, record["fingerprint"]


def score_metrics(rows: dict[str, dict]) -> dict[str, float]:
    """The run's own model's scores as dev/* and test/*, another row's under its label
    (ensemble/test/bleu)."""
    metrics = {}
    for label, scores in rows.items():
        prefix = "" if label == OWN else f"{label}/"
        for role, s in scores.items():
            metrics |= {f"{prefix}{ROLES[role]}/{k}": v for k, v in numbers(s).items()}
    return metrics


def scores_table(rows: dict[str, dict]) -> list[str]:
    """A markdown table of beam-search scores, a row per split, of the run's own model and,
    where the run has more (a distillation's teachers and their ensemble), of each."""
    splits = [s for scores in rows.values() for s in scores.values()]
    columns = [(k, label) for k, label in COLUMNS if any(k in s for s in splits)]
    many = len(rows) > 1
    head = (["model"] if many else []) + ["split"] + [label for _, label in columns]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for who, scores in rows.items():
        for split, s in scores.items():
            cells = ([who] if many else []) + [split] + [f"{s[k]:.2f}" if k in s else ""
                                                          for k, _ in columns]  # fmt: skip
            lines.append("| " + " | ".join(cells) + " |")
    test = rows[OWN]["test"]
    return [
        *lines,
        "",
        f"sacreBLEU `{test['bleu_signature']}`, chrF `{test['chrf_signature']}`",
    ]


def description(summary: dict) -> str:
    """The MLflow parent run's description: what a person opening the run wants first."""
    return "\n".join([
        f"Averaged model at step {summary['step']}, beam search:",
        "",
        *scores_table(summary["rows"]),
        "",
        *[line for line in summary["notes"]],
        *([""] if summary["notes"] else []),
        f"Registered as `{summary['registered']}` (alias `@best`: the version of highest "
        "validation BLEU). Artifacts: `curve.png` (loss, learning rate and validation BLEU "
        "against the step), `attention/sentence-N/` (each layer's attention on the first test "
        "sentences, a panel per head), `model/`, `hypotheses/`, `data/`, `params.yaml`; "
        "a child run per stage.",
    ])  # fmt: skip


def artifact_markdown(summary: dict, experiment_id: str | None, registered_model: str) -> str:
    """The Prefect artifact: the scores as a table, then links to the MLflow run and model
    (on a local store, the address `mlflow ui` serves it at once started)."""
    uri = summary["tracking_uri"]
    version = summary["registered"].rsplit("/", 1)[-1]
    links = [
        f"- MLflow run: [{summary['run_id']}]({run_url(uri, experiment_id, summary['run_id'])})",
        f"- Model: [{summary['registered']}]({_ui(uri)}/#/models/{registered_model}/versions/"
        f"{version}{TRAINING_VIEW}) (alias `@best`), file `{summary['model']}`",
        *[f"- {label.capitalize()}: `{path}`" for label, path in summary["paths"].items()],
    ]
    if not _is_server(uri):
        links.append(f"- The links need `mlflow ui --backend-store-uri {uri}` running first")
    notes = [*summary["notes"], ""] if summary["notes"] else []
    return "\n".join(["# Results", "", *scores_table(summary["rows"]), "", *notes, *links])


def summary_lines(summary: dict) -> list[str]:
    """What a person wants at the end of a run, in the order they want it."""
    test = summary["scores"]["test"]
    extra = [
        f"{label} {test[key]:.2f}"
        for key, label in (
            ("bleu_tok_lc", "BLEU lc+tok (Moses, as published)"),
            ("bleu_tok_compound", "BLEU tok+compound-split (the paper's)"),
        )
        if key in test
    ]
    uri, url = summary["tracking_uri"], summary["run_url"]
    local = not _is_server(uri)
    return [
        f"test BLEU {test['bleu']:.2f}  lowercased {test['bleu_lc']:.2f}  chrF {test['chrf']:.2f}"
        + (f"  ({'; '.join(extra)})" if extra else ""),
        f"  {test['bleu_signature']}",
        f"MLflow run   {summary['run_id']}",
        *([f"  {url}"] if url and not local else []),
        f"model        {summary['model']}",
        f"registered   {summary['registered']} (alias @best: the highest validation BLEU)",
        *[f"{label:<12} {path}" for label, path in summary["paths"].items()],
        f"browse runs  mlflow ui --backend-store-uri {uri}",
        *([f"  then open {url}"] if url and local else []),
    ]


def run_url(uri: str, experiment_id: str | None, run_id: str) -> str | None:
    """A link to the run in MLflow's training view: on the tracking server, or for a local
    store where `mlflow ui` serves it once started."""
    if experiment_id is None:
        return None
    return f"{_ui(uri)}/#/experiments/{experiment_id}/runs/{run_id}{TRAINING_VIEW}"


def _ui(uri: str) -> str:
    return uri.rstrip("/") if _is_server(uri) else LOCAL_UI


def _is_server(uri: str) -> bool:
    return uri.startswith(("http://", "https://"))


def _upload(client, run_id: str, files: list[tuple[Path, str]]) -> None:
    """What the stages show, each file or folder once: a rerun finds it uploaded (a model
    can weigh gigabytes)."""
    listed = {folder: {a.path for a in client.list_artifacts(run_id, folder)}
              for folder in {folder for _, folder in files}}  # fmt: skip
    for path, folder in files:
        if path.is_dir() and not listed[folder]:
            client.log_artifacts(run_id, str(path), folder)
        elif path.is_file() and f"{folder}/{path.name}" not in listed[folder]:
            client.log_artifact(run_id, str(path), folder)
