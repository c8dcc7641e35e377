"""Average the last checkpoints into one exported model, then decode and score."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import torch
from prefect import task

from tasks.data import data_fingerprint
from tasks.stages import fresh, output_key
from tasks.tracking import client_for, log_metrics, stage_run
from transformer.average import export_average
from transformer.config import load_params
from transformer.evaluate import score
from transformer.translate import load_translator, translate_lines

MODEL = "model.pt"


@task(name="average", cache_key_fn=output_key, persist_result=True)
def average(
    params_file: str, train_dir: str, out_dir: str, tracking: dict, refresh: bool = False
) -> str:
    if fresh(out_dir, refresh):
        params = load_params(params_file)
        client = client_for(tracking["uri"])
        with stage_run(client, tracking["run_id"], "average") as run_id:
            tmp = Path(out_dir + ".tmp")
            tmp.mkdir(parents=True, exist_ok=True)
            export_average(Path(train_dir), params.average.last_n, tmp / MODEL)
            tmp.rename(out_dir)
            client.log_artifact(run_id, str(Path(out_dir) / MODEL))
    return out_dir


@task(name="decode-score", cache_key_fn=output_key, persist_result=True)
def decode_score(
    params_file: str,
    model_dir: str,
    cleaned: str,
    out_dir: str,
    tracking: dict,
    refresh: bool = False,
) -> str:
    """Translate valid and test with beam search; BLEU/chrF against the raw references."""
    if fresh(out_dir, refresh):
        params = load_params(params_file)
        client = client_for(tracking["uri"])
        with stage_run(client, tracking["run_id"], "decode-score") as run_id:
            device = "cuda" if torch.cuda.is_available() else "cpu"
            model, sp, _ = load_translator(Path(model_dir) / MODEL, device)
            tmp = Path(out_dir + ".tmp")
            tmp.mkdir(parents=True, exist_ok=True)
            scores = {}
            for role in ("valid", "test"):
                table = pq.read_table(Path(cleaned) / f"{role}.parquet")
                hyps = translate_lines(model, sp, table["src"].to_pylist(), params.decode, device)
                (tmp / f"{role}.hyp").write_text("".join(h + "\n" for h in hyps), encoding="utf-8")
                scores[role] = score(hyps, table["tgt"].to_pylist())
            (tmp / "scores.json").write_text(json.dumps(scores, indent=2))
            tmp.rename(out_dir)
            client.log_artifacts(run_id, out_dir)
    return out_dir


@task(name="publish")
def publish(params_file: str, shards: str, model_dir: str, decode_dir: str, tracking: dict) -> dict:
    """The run's results on the pipeline's MLflow run: scores with sacreBLEU's signatures,
    and the artifacts a reader needs (data manifest, BPE model, averaged model, hypotheses)."""
    params = load_params(params_file)
    scores = json.loads((Path(decode_dir) / "scores.json").read_text())
    client = client_for(tracking["uri"])
    run_id = tracking["run_id"]
    metrics = {
        f"{role}/{name}": s[name]
        for role, s in scores.items()
        for name in ("bleu", "chrf", "bleu_tok_compound")
    }
    log_metrics(client, run_id, metrics, step=params.train.max_steps)
    client.set_tag(run_id, "sacrebleu_signature", scores["test"]["bleu_signature"])
    client.set_tag(run_id, "chrf_signature", scores["test"]["chrf_signature"])
    client.set_tag(run_id, "data_fingerprint", data_fingerprint(shards))
    for path, folder in (
        (Path(shards) / "manifest.json", "data"),
        (Path(shards) / "spm.model", "data"),
        (Path(model_dir) / MODEL, "model"),
        (Path(decode_dir) / "valid.hyp", "hypotheses"),
        (Path(decode_dir) / "test.hyp", "hypotheses"),
    ):
        client.log_artifact(run_id, str(path), folder)
    return scores
