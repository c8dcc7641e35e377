"""The end of a run: its results on the pipeline's MLflow run, in the flow's log, and as a
Prefect artifact, however the run was started (command line, deployment, schedule)."""

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
    text = summary_lines(summary)
    get_run_logger().info("\n".join(text))
    markdown = "\n".join(["# Results", "", *(f"    {line}" for line in text)])
    create_markdown_artifact(
        key="wmt14-ende-results", markdown=markdown, description=f"MLflow run {run_id}"
    )
    return summary


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
    lines = [
        f"test BLEU {test['bleu']:.2f}  lowercased {test['bleu_lc']:.2f}  chrF {test['chrf']:.2f}"
        + (f"  ({'; '.join(extra)})" if extra else ""),
        f"  {test['bleu_signature']}",
        f"MLflow run   {summary['run_id']}",
    ]
    if summary["run_url"]:
        lines.append(f"  {summary['run_url']}")
    return [
        *lines,
        f"model        {summary['model']}",
        f"registered   {summary['registered']} (alias @best: the highest validation BLEU)",
        f"hypotheses   {summary['hypotheses']}",
        f"browse runs  mlflow ui --backend-store-uri {summary['tracking_uri']}",
    ]


def run_url(uri: str, experiment_id: str | None, run_id: str) -> str | None:
    """A link to the run where a tracking server is known (none for a local file store)."""
    if not uri.startswith(("http://", "https://")) or experiment_id is None:
        return None
    return f"{uri.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}"


def _upload(client, run_id: str, records: dict[str, dict]) -> None:
    """Small files every time (they say what this run used); the model, which can weigh
    gigabytes, once per run."""
    uploaded = {a.path for a in client.list_artifacts(run_id, "model")}
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
