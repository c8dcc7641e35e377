"""Average the last checkpoints into one exported model, then decode and score."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import torch
from prefect import task

from tasks.data import data_fingerprint
from tasks.stages import fresh, output_key
from tasks.tracking import client_for, executing, log_metrics
from transformer.average import export_average
from transformer.config import load_params
from transformer.data import atomic_dir
from transformer.data.shard import MANIFEST, SPM_NAME
from transformer.evaluate import score
from transformer.translate import load_translator, translate_lines

MODEL = "model.pt"


@task(name="average", cache_key_fn=output_key, persist_result=True)
def average(
    params_file: str, train_dir: str, out_dir: str, tracking: dict, refresh: bool = False
) -> str:
    if fresh(out_dir, refresh):
        with executing("average", params_file, tracking) as (params, client, run_id):
            with atomic_dir(out_dir) as tmp:
                export_average(Path(train_dir), params.average.last_n, tmp / MODEL)
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
        with executing("decode-score", params_file, tracking) as (params, client, run_id):
            device = "cuda" if torch.cuda.is_available() else "cpu"
            model, sp, _ = load_translator(Path(model_dir) / MODEL, device)
            with atomic_dir(out_dir) as tmp:
                scores = {}
                for role in ("valid", "test"):
                    table = pq.read_table(Path(cleaned) / f"{role}.parquet")
                    sources, refs = table["src"].to_pylist(), table["tgt"].to_pylist()
                    hyps = translate_lines(model, sp, sources, params.decode, device)
                    text = "".join(h + "\n" for h in hyps)
                    (tmp / f"{role}.hyp").write_text(text, encoding="utf-8")
                    scores[role] = _scores(hyps, refs)
                (tmp / "scores.json").write_text(json.dumps(scores, indent=2))
            client.log_artifacts(run_id, out_dir)
    return out_dir


def _scores(hyps: list[str], refs: list[str]) -> dict:
    """sacreBLEU cased (the standard), lowercased (how Multi30k results are quoted), chrF,
    and the paper's tokenized compound-split BLEU, with signatures."""
    lower = score(hyps, refs, lowercase=True)
    return score(hyps, refs) | {
        "bleu_lc": lower["bleu"],
        "bleu_lc_signature": lower["bleu_signature"],
    }


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
        for name in ("bleu", "bleu_lc", "chrf", "bleu_tok_compound")
    }
    log_metrics(client, run_id, metrics, step=params.train.max_steps)
    client.set_tag(run_id, "sacrebleu_signature", scores["test"]["bleu_signature"])
    client.set_tag(run_id, "chrf_signature", scores["test"]["chrf_signature"])
    client.set_tag(run_id, "sacrebleu_lc_signature", scores["test"]["bleu_lc_signature"])
    client.set_tag(run_id, "data_fingerprint", data_fingerprint(shards))
    # Small files every time (they say what this run used); the model, which can weigh
    # gigabytes, once per run.
    uploaded = {a.path for a in client.list_artifacts(run_id, "model")}
    for path, folder in (
        (Path(shards) / MANIFEST, "data"),
        (Path(shards) / SPM_NAME, "data"),
        (Path(decode_dir) / "valid.hyp", "hypotheses"),
        (Path(decode_dir) / "test.hyp", "hypotheses"),
        (Path(model_dir) / MODEL, "model"),
    ):
        if f"{folder}/{path.name}" not in uploaded:
            client.log_artifact(run_id, str(path), folder)
    return scores
