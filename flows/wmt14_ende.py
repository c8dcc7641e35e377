"""The `wmt14-ende` flow: download -> clean -> learn BPE -> encode + shard -> train (torchrun)
-> average -> decode + score, every stage tracked in MLflow.

    python -m flows.wmt14_ende params/smoke.yaml [dotted.key=value ...] [--work-dir DIR]

runs it with no server (Prefect's temporary local API) and prints where the results are.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

# The temporary local API gets 20 s to start by default: too little on a busy 2-core box.
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

from prefect import flow, task
from prefect.filesystems import LocalFileSystem

from tasks.data import clean, download, encode_shard, learn_bpe
from tasks.evaluate import average, decode_score, publish
from tasks.stages import plan, refresh_needed, write_params
from tasks.tracking import (
    client_for,
    experiment_id,
    finish_run,
    mark_failed,
    open_parent_run,
    tracking_uri,
)
from tasks.train import DONE, train
from transformer.config import ParamsError, fingerprint, load_params, params_hash


@task(name="open-run")
def open_run(params_path: str, overrides: list[str], params_file: str, work_dir: str) -> dict:
    """Write the resolved params down and open (or resume) the MLflow run of their hash."""
    params = load_params(params_path, overrides)
    write_params(params, Path(params_file))
    uri = tracking_uri(params, work_dir)
    client = client_for(uri)
    exp = experiment_id(client, params.tracking, work_dir)
    name = f"{Path(params_path).stem}-{params_hash(params)[:8]}"
    run_id = open_parent_run(client, exp, params, Path(params_file), name)
    return {"uri": uri, "run_id": run_id, "experiment_id": exp}


def results_store(work_dir: Path) -> LocalFileSystem:
    """Prefect needs result storage as a saved block; one per work dir, named after it."""
    store = LocalFileSystem(basepath=str(work_dir / "prefect-results"))
    store.save(f"wmt14-results-{fingerprint(str(work_dir))}", overwrite=True)
    return store


@flow(name="wmt14-ende", log_prints=True)
def wmt14_ende(
    params: str = "params/smoke.yaml",
    overrides: list[str] | None = None,
    work_dir: str = "work",
    refresh: bool = False,
) -> dict:
    """The whole pipeline for one params file. `refresh` recomputes every stage (scheduled
    retraining); otherwise finished stages are reused, and a killed training resumes."""
    overrides = list(overrides or [])
    layout = plan(load_params(params, overrides), work_dir)
    # Prefect's results and cache records live with the outputs they point at.
    store = results_store(layout.work_dir)

    def stage(task, done: Path):
        return task.with_options(result_storage=store, refresh_cache=refresh_needed(done, refresh))

    tracking = open_run(params, overrides, str(layout.params_file), str(layout.work_dir))
    try:
        p, r = str(layout.params_file), refresh
        prepared = stage(download, layout.prepare)(p, str(layout.prepare), tracking, r)
        cleaned = stage(clean, layout.clean)(p, prepared, str(layout.clean), tracking, r)
        vocab = stage(learn_bpe, layout.vocab)(p, cleaned, str(layout.vocab), tracking, r)
        shards = stage(encode_shard, layout.shards)(
            p, cleaned, vocab, str(layout.shards), tracking, r
        )
        # A training folder without DONE was killed: never take its cache record, resume.
        run_dir = stage(train, layout.train / DONE)(p, shards, str(layout.train), tracking, r)
        model = stage(average, layout.average)(p, run_dir, str(layout.average), tracking, r)
        decoded = stage(decode_score, layout.decode)(
            p, model, cleaned, str(layout.decode), tracking, r
        )
        scores = publish(p, shards, model, decoded, tracking)
    except BaseException:
        mark_failed(tracking)
        raise
    finish_run(client_for(tracking["uri"]), tracking["run_id"])
    return {
        "run_id": tracking["run_id"],
        "tracking_uri": tracking["uri"],
        "model": str(Path(model) / "model.pt"),
        "hypotheses": str(Path(decoded) / "test.hyp"),
        "scores": scores,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("params", help="params file, e.g. params/smoke.yaml")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value")
    parser.add_argument("--work-dir", default="work", help="stage outputs and MLflow store")
    parser.add_argument("--refresh", action="store_true", help="recompute every stage")
    args = parser.parse_args(argv)
    try:  # fail fast, before Prefect starts, with the one-line params error
        load_params(args.params, args.overrides)
    except ParamsError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    result = wmt14_ende(args.params, args.overrides, args.work_dir, args.refresh)
    test = result["scores"]["test"]
    print(
        f"\ntest BLEU {test['bleu']:.2f}  lowercased {test['bleu_lc']:.2f}  "
        f"chrF {test['chrf']:.2f}  (tokenized+compound-split BLEU "
        f"{test['bleu_tok_compound']:.2f})\n"
        f"  {test['bleu_signature']}\n"
        f"MLflow run   {result['run_id']}\n"
        f"model        {result['model']}\n"
        f"hypotheses   {result['hypotheses']}\n"
        f"browse runs  mlflow ui --backend-store-uri {result['tracking_uri']}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
