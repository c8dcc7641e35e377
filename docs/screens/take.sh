#!/usr/bin/env bash
# The screens of docs/guides/team.md, in headless Chromium (apt-get install chromium).
# Usage: bash docs/screens/take.sh MLFLOW_UI EXPERIMENT_ID RUN_ID PREFECT_UI ARTIFACT_ID
# e.g.   bash docs/screens/take.sh http://127.0.0.1:5000 1 5f46294b... http://127.0.0.1:4200 e93271fc-...
# after a demo run against a Prefect server (PREFECT_API_URL set) and `mlflow ui` on its store.
set -euo pipefail
mlflow=$1 experiment=$2 run=$3 prefect=$4 artifact=$5
out=$(dirname "$0")
view="?workflowType=machine_learning"  # MLflow 3.17 opens on GenAI until a browser chose
shot() {
    chromium --headless=new --no-sandbox --disable-gpu --hide-scrollbars --window-size="$3" \
        --virtual-time-budget=15000 --screenshot="$out/$2" "$1"
}
shot "$mlflow/#/experiments/$experiment" mlflow-experiment-first-visit.png 1400,800
shot "$mlflow/#/experiments/$experiment$view" mlflow-experiment.png 1400,800
shot "$mlflow/#/experiments/$experiment/runs/$run$view" mlflow-run.png 1400,1100
shot "$prefect/artifacts/artifact/$artifact" prefect-artifact.png 1400,900
