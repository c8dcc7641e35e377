"""The end of a run: its results on the pipeline's MLflow run (metrics, tags, a description
with the scores, the training curve and the attention maps), in the flow's log, and as a
Prefect artifact (a table, with links to the MLflow run and model), however the run was
started (command line, deployment, schedule)."""

from __future__ import annotations

import tempfile
from pathlib import Path

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact

from tasks.registry import register
from tasks.report import plot_training_curve
from tasks.runner import user_failure
from tasks.tracking import client_for, log_metrics, numbers, redact, store_errors
from transformer.files import MANIFEST, MODEL, SPM_MODEL, hypotheses

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
    scores = records["decode"]["report"]
    step = records["train"]["report"]["step"]
    metrics = {f"{ROLES[role]}/{k}": v for role, s in scores.items() for k, v in numbers(s).items()}
    log_metrics(client, run_id, metrics, step=step)
    test = scores["test"]
    tags = {
        "sacrebleu_signature": test["bleu_signature"],
        "sacrebleu_lc_signature": test["bleu_lc_signature"],
        "chrf_signature": test["chrf_signature"],
        "data_fingerprint": records["shards"]["report"]["fingerprint"],
        "model_path": str(Path(records["average"]["path"]) / MODEL),
    }
    for key, value in tags.items():
        client.set_tag(run_id, key, value)
    _upload(client, run_id, records)
    model = Path(records["average"]["path"]) / MODEL
    version = register(run, model, scores, records["average"]["fingerprint"])
    with tempfile.TemporaryDirectory() as tmp:  # redrawn from MLflow: every logged point
        client.log_artifact(
            run_id, str(plot_training_curve(client, [run_id], Path(tmp) / "curve.png"))
        )
    summary = {
        "run_id": run_id,
        "tracking_uri": redact(run["uri"]),
        "run_url": run_url(run["uri"], run.get("experiment_id"), run_id),
        "model": tags["model_path"],
        "registered": f"models:/{run['registered_model']}/{version}",
        "hypotheses": str(Path(records["decode"]["path"]) / hypotheses("test")),
        "step": step,
        "scores": scores,
    }
    client.set_tag(run_id, "mlflow.note.content", description(summary))  # the run's description
    get_run_logger().info("\n".join(summary_lines(summary)))
    create_markdown_artifact(
        key="wmt14-ende-results",
        markdown=artifact_markdown(summary, run.get("experiment_id"), run["registered_model"]),
        description=f"MLflow run {run_id}",
    )
    return summary


def scores_table(scores: dict) -> list[str]:
    """A markdown table of the averaged model's beam-search scores, a row per split."""
    columns = [(k, label) for k, label in COLUMNS if any(k in s for s in scores.values())]
    lines = [
        "| split | " + " | ".join(label for _, label in columns) + " |",
        "|---" * (len(columns) + 1) + "|",
    ]
    for split, s in scores.items():
        cells = [f"{s[k]:.2f}" if k in s else "" for k, _ in columns]
        lines.append(f"| {split} | " + " | ".join(cells) + " |")
    test = scores["test"]
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
        *scores_table(summary["scores"]),
        "",
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
        f"- Hypotheses: `{summary['hypotheses']}`",
    ]
    if not _is_server(uri):
        links.append(f"- The links need `mlflow ui --backend-store-uri {uri}` running first")
    return "\n".join(["# Results", "", *scores_table(summary["scores"]), "", *links])


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
        f"hypotheses   {summary['hypotheses']}",
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


def _upload(client, run_id: str, records: dict[str, dict]) -> None:
    """Small files every time (they say what this run used); the model, which can weigh
    gigabytes, once per run."""
    uploaded = {a.path for a in client.list_artifacts(run_id, "model")}
    attention = Path(records["decode"]["path"]) / "attention"  # also on the decode child run
    top = {a.path for a in client.list_artifacts(run_id)}
    if attention.is_dir() and "attention" not in top:
        client.log_artifacts(run_id, str(attention), "attention")
    files = (
        (Path(records["shards"]["path"]) / MANIFEST, "data"),
        (Path(records["shards"]["path"]) / SPM_MODEL, "data"),
        (Path(records["decode"]["path"]) / hypotheses("valid"), "hypotheses"),
        (Path(records["decode"]["path"]) / hypotheses("test"), "hypotheses"),
        (Path(records["average"]["path"]) / MODEL, "model"),
    )
    for path, folder in files:
        if f"{folder}/{path.name}" not in uploaded:
            client.log_artifact(run_id, str(path), folder)
