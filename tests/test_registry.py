"""The registry's alias `best`, in a real MLflow store: it follows validation BLEU, never test."""

from __future__ import annotations

from mlflow import MlflowClient

from tasks.registry import BEST, promote_if_best

NAME = "wmt14-ende-smoke"
SOURCE = "file:///nonexistent/model"  # the alias reads tags only: no model files needed


def _version(client: MlflowClient, valid: float, test: float) -> str:
    # As register() leaves a version before promoting it: its scores are tags.
    version = client.create_model_version(NAME, source=SOURCE).version
    client.set_model_version_tag(NAME, version, "valid_bleu", str(valid))
    client.set_model_version_tag(NAME, version, "test_bleu", str(test))
    promote_if_best(client, NAME, version, valid)
    return version


def test_best_follows_validation_bleu_and_a_higher_test_score_does_not_move_it(tmp_path):
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    client.create_registered_model(NAME)
    first = _version(client, valid=30.0, test=20.0)
    assert client.get_model_version_by_alias(NAME, BEST).version == first
    _version(client, valid=29.0, test=35.0)  # better on test, worse on val: not chosen
    assert client.get_model_version_by_alias(NAME, BEST).version == first
    third = _version(client, valid=31.0, test=10.0)
    assert client.get_model_version_by_alias(NAME, BEST).version == third


def test_a_holder_without_a_validation_score_yields_to_a_version_with_one(tmp_path):
    """A version registered before the alias followed validation BLEU carries no valid_bleu."""
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    client.create_registered_model(NAME)
    old = client.create_model_version(NAME, source=SOURCE).version
    client.set_model_version_tag(NAME, old, "test_bleu", "50.0")
    client.set_registered_model_alias(NAME, BEST, old)
    new = _version(client, valid=1.0, test=1.0)
    assert client.get_model_version_by_alias(NAME, BEST).version == new
