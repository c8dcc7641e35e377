"""Data stages: download/prepare -> clean -> learn BPE -> encode + shard.

Each task: load the resolved params, skip if its output folder is there, else call one
library function inside a nested MLflow run, and return the output folder.
"""

from __future__ import annotations

from pathlib import Path

from prefect import task

from tasks.stages import fresh, output_key
from tasks.tracking import executing, log_metrics
from transformer.data.clean import clean_corpus
from transformer.data.shard import MANIFEST, SPM_NAME, encode_and_shard, load_manifest
from transformer.data.sources import prepare_source
from transformer.vocab import learn_vocab

STAGE = dict(cache_key_fn=output_key, persist_result=True)


# No task-level retries: the hub loader retries its own network calls, and a local path
# that is wrong stays wrong.
@task(name="download", **STAGE)
def download(params_file: str, out_dir: str, tracking: dict, refresh: bool = False) -> str:
    if fresh(out_dir, refresh):
        with executing("download", params_file, tracking) as (params, client, run_id):
            report = prepare_source(params.data, Path(out_dir))
            log_metrics(client, run_id, _counts("rows", report.get("counts", {})))
    return out_dir


@task(name="clean", **STAGE)
def clean(
    params_file: str, prepared: str, out_dir: str, tracking: dict, refresh: bool = False
) -> str:
    if fresh(out_dir, refresh):
        with executing("clean", params_file, tracking) as (params, client, run_id):
            report = clean_corpus(Path(prepared), params.data.clean, Path(out_dir))
            log_metrics(client, run_id, _counts("clean", report))
            client.log_artifact(run_id, str(Path(out_dir) / "clean.json"))
    return out_dir


@task(name="learn-bpe", **STAGE)
def learn_bpe(
    params_file: str, cleaned: str, out_dir: str, tracking: dict, refresh: bool = False
) -> str:
    if fresh(out_dir, refresh):
        with executing("learn-bpe", params_file, tracking) as (params, client, run_id):
            model = learn_vocab(Path(cleaned) / "train.parquet", params.vocab, Path(out_dir))
            client.log_artifact(run_id, str(model))
    return out_dir


@task(name="encode-shard", **STAGE)
def encode_shard(
    params_file: str, cleaned: str, vocab: str, out_dir: str, tracking: dict, refresh: bool = False
) -> str:
    if fresh(out_dir, refresh):
        with executing("encode-shard", params_file, tracking) as (params, client, run_id):
            spm_model = Path(vocab) / SPM_NAME
            manifest = encode_and_shard(Path(cleaned), spm_model, params.shard, Path(out_dir))
            client.set_tag(run_id, "data_fingerprint", manifest["fingerprint"])
            client.log_artifact(run_id, str(Path(out_dir) / MANIFEST))
    return out_dir


def data_fingerprint(shards: str) -> str:
    return load_manifest(Path(shards))["fingerprint"]


def _counts(prefix: str, report: dict) -> dict[str, float]:
    """{'train': {'kept': 9}} -> {'clean/train/kept': 9}: numbers only, for MLflow."""
    flat = {}
    for role, counts in report.items():
        if isinstance(counts, dict):
            flat.update(
                {f"{prefix}/{role}/{k}": v for k, v in counts.items() if isinstance(v, int | float)}
            )
    return flat
