"""The averaged model as an MLflow model: a pyfunc that translates a list, or the first
column of a DataFrame, of raw sentences, with the decoding settings it was trained with.

    model = mlflow.pyfunc.load_model("models:/wmt14-ende-smoke@best")
    model.predict(["The house is small."])

    MLFLOW_TRACKING_URI=sqlite:///work/mlflow.db mlflow models serve \
        -m models:/wmt14-ende-smoke@best --env-manager local -p 5001
    curl -s localhost:5001/invocations -H 'Content-Type: application/json' \
        -d '{"inputs": ["The house is small."]}'

Logged with `loader_module="tasks.serving"` (tasks/registry.py): the model's artifact holds
its weights (the exported model.pt, loaded weights-only), its signature and requirements,
and no code. MLflow imports this module from the installed project and calls
`_load_pyfunc` on the weights, so nothing in a work dir's `mlartifacts` runs when the model
is loaded or served; it loads where the project is installed (`--env-manager local`).
"""

from __future__ import annotations

import torch

from transformer.decoding.translate import load_translator, translate_lines


class Translator:
    def __init__(self, model_path: str):
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.model, self.sp, self.params = load_translator(model_path, self.device)

    def predict(self, model_input, params=None) -> list[str]:
        column = model_input.iloc[:, 0] if hasattr(model_input, "iloc") else model_input
        lines = [str(line) for line in column]
        return translate_lines(self.model, self.sp, lines, self.params.decode, self.device)


def _load_pyfunc(data_path: str) -> Translator:
    """MLflow's loader_module entry point: `data_path` is the artifact's copy of model.pt."""
    return Translator(data_path)
