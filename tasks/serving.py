"""The averaged model as an MLflow model: a pyfunc that translates a list, or the first
column of a DataFrame, of raw sentences, with the decoding settings it was trained with.

    model = mlflow.pyfunc.load_model("models:/wmt14-ende-smoke@best")
    model.predict(["The house is small."])

    MLFLOW_TRACKING_URI=sqlite:///work/mlflow.db mlflow models serve \
        -m models:/wmt14-ende-smoke@best --env-manager local -p 5001
    curl -s localhost:5001/invocations -H 'Content-Type: application/json' \
        -d '{"inputs": ["The house is small."]}'

Logged as a model from code: this file is the model's code (no pickle), the project's
`transformer` package travels with it, and the weights stay the exported model.pt, loaded
weights-only. Like every pyfunc it is code: it runs where someone loads or serves it, never
when the pipeline reads its work dir.
"""

from __future__ import annotations

import mlflow
import torch
from mlflow.pyfunc import PythonModel


class Translator(PythonModel):
    def load_context(self, context) -> None:
        from transformer.decoding.translate import load_translator

        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.model, self.sp, self.params = load_translator(context.artifacts["model"], self.device)

    def predict(self, context, model_input, params=None) -> list[str]:
        from transformer.decoding.translate import translate_lines

        column = model_input.iloc[:, 0] if hasattr(model_input, "iloc") else model_input
        lines = [str(line) for line in column]
        return translate_lines(self.model, self.sp, lines, self.params.decode, self.device)


mlflow.models.set_model(Translator())
