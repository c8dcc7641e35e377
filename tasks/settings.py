"""The pipeline's own settings: the `pipeline` section of a params file.

The library (`transformer/`) validates the sections that describe the model, the data and
training, and leaves this one alone; the pipeline validates the whole tree, with this
section added. No stage reads it, so nothing here changes a stage's output: every key is
operational, and none is part of a run's identity.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, model_validator

from tasks.credentials import CREDENTIAL, CREDENTIAL_ADVICE, holds_credential
from transformer.config import Params, ParamsError, Section, load_params, operational

# What the slurm launcher's batch script sets itself (tasks/slurm.py), or the keys above do:
# given again in sbatch_options they would contradict it (--wrap: a shell command instead).
SBATCH_OWN = {
    "--nodes": "pipeline.nnodes", "-N": "pipeline.nnodes",
    "--ntasks-per-node": "the launcher (one torchrun agent per node)",
    "--ntasks": "the launcher (one torchrun agent per node)", "-n": "the launcher",
    "--output": "the launcher (the run folder)", "-o": "the launcher (the run folder)",
    "--error": "the launcher (the run folder)", "-e": "the launcher (the run folder)",
    "--open-mode": "the launcher", "--chdir": "the launcher", "-D": "the launcher",
    "--signal": "pipeline.slurm.signal_seconds", "--parsable": "the launcher",
    "--time": "pipeline.slurm.time_limit_minutes", "-t": "pipeline.slurm.time_limit_minutes",
    "--partition": "pipeline.slurm.partition", "-p": "pipeline.slurm.partition",
    "--account": "pipeline.slurm.account", "-A": "pipeline.slurm.account",
    "--array": "the launcher (one job)", "-a": "the launcher (one job)",
    "--wrap": "the launcher",
}  # fmt: skip


# The flow's `overrides` parameter: its JSON schema (which Prefect's server checks before it
# creates, and stores, a deployment's run) allows no item that holds a credential. Its error
# quotes no item ("Too many items match the given schema (expected at most 0)"), where a
# pattern's would quote the credential back.
Overrides = Annotated[
    list[str],
    Field(json_schema_extra={"contains": {"pattern": CREDENTIAL}, "minContains": 0,
                             "maxContains": 0}),
]  # fmt: skip


class SlurmConfig(Section):
    """The train stage's job on a Slurm cluster, for `pipeline.launcher: slurm`."""

    partition: str | None = operational(None)  # None: the cluster's default partition
    account: str | None = operational(None)  # None: the user's default account
    # sbatch --time, in minutes as the other limits here; None: the partition's limit.
    time_limit_minutes: int | None = operational(None, ge=1)
    # The trainers get SIGTERM this long before the time limit and save. slurmctld looks at
    # time limits every 30 s, so this must cover that and a save.
    signal_seconds: int = operational(120, ge=30, le=65535)
    # Anything else sbatch takes, one option a string: ["--gpus-per-node=8", "--exclusive"].
    sbatch_options: list[str] = operational([])

    @model_validator(mode="after")
    def _checks(self) -> SlurmConfig:
        limit = self.time_limit_minutes
        if limit is not None and self.signal_seconds >= limit * 60:
            raise ValueError(f"signal_seconds: {self.signal_seconds} s is not less than "
                             f"time_limit_minutes ({limit} min)")  # fmt: skip
        for option in self.sbatch_options:
            name = option.split("=")[0]
            odd = name in ("-", "--") or not name.isprintable() or " " in name
            if not option.startswith("-") or odd:
                raise ValueError(f"sbatch_options: {option!r} is not one sbatch option "
                                 "('--name=value', a list item each)")  # fmt: skip
            if owned := _refused(name):
                raise ValueError(f"sbatch_options: {option!r} sets {owned}, which is set by "
                                 f"{SBATCH_OWN[owned]}")  # fmt: skip
        return self


# sbatch's short options that take no value: "-vt5" is -v, then -t with the value 5.
SBATCH_FLAGS = set("HhkOQsuVvW")


def _refused(name: str) -> str | None:
    """The option of SBATCH_OWN that `name` gives sbatch, if any. sbatch (getopt_long)
    takes any unambiguous prefix of a long option (`--wra` is --wrap; an ambiguous one is
    refused here too, as sbatch would), and short options grouped, a value attached
    (`-t5`, `-vN2`)."""
    if name.startswith("--"):
        owned = [own for own in SBATCH_OWN if own.startswith("--") and own.startswith(name)]
        return name if name in SBATCH_OWN else (owned[0] if owned and len(name) > 2 else None)
    for letter in name[1:]:
        if f"-{letter}" in SBATCH_OWN:
            return f"-{letter}"
        if letter not in SBATCH_FLAGS:  # an option with a value: the rest is its value
            return None
    return None


class PipelineConfig(Section):
    # MLflow: None = sqlite:///<work dir>/mlflow.db. MLFLOW_TRACKING_URI and
    # MLFLOW_EXPERIMENT_NAME win over these, as everywhere in MLflow.
    tracking_uri: str | None = operational(None)
    experiment: str | None = operational(None)  # None: the language pair's (experiment_name)
    # Where the train stage's processes run: this machine, or a job on a Slurm cluster
    # (tasks/slurm.py) whose nodes share the work dir's file system.
    launcher: Literal["local", "slurm"] = operational("local")
    nnodes: int = operational(1, ge=1)  # nodes of the Slurm job
    nproc_per_node: int | None = operational(None, ge=1)  # None: one per GPU, or 1 on CPU
    train_timeout_minutes: float = operational(0.0, ge=0.0, le=525_600.0)  # 0: none; <= a year
    # The MLflow Model Registry name of the averaged model; None: <experiment>-<params stem>
    registered_model: str | None = operational(None)
    slurm: SlurmConfig = Field(default_factory=SlurmConfig)

    @model_validator(mode="after")
    def _launcher(self) -> PipelineConfig:
        if self.tracking_uri is not None and holds_credential(self.tracking_uri):
            raise ValueError(f"tracking_uri: {CREDENTIAL_ADVICE}")
        if self.launcher == "local" and self.nnodes > 1:
            raise ValueError(f"nnodes: {self.nnodes} nodes need pipeline.launcher: slurm "
                             "(the local launcher trains on this machine only)")  # fmt: skip
        if self.launcher == "slurm" and self.nproc_per_node is None:
            raise ValueError("nproc_per_node: give the processes per node for launcher "
                             "slurm (this machine cannot count a node's GPUs)")  # fmt: skip
        return self


class RunParams(Params):
    pipeline: PipelineConfig = Field(default_factory=PipelineConfig)


def load_run_params(path: str | os.PathLike, overrides: list[str] | tuple = ()) -> RunParams:
    """The whole params tree, the pipeline section included (ParamsError names the key).
    No override may hold a credential (a URL's user info, a password), whatever its key:
    overrides are a flow run's parameters, which Prefect stores and shows. The error names
    the key, never the value."""
    for item in overrides:
        if holds_credential(item):
            key = item.partition("=")[0] if "=" in item else ""
            key = "an override" if not key or holds_credential(key) else key
            raise ParamsError(f"{path} (override): {key}: {CREDENTIAL_ADVICE}")
    return load_params(Path(path), overrides, schema=RunParams)


def experiment_name(params: RunParams) -> str:
    """MLFLOW_EXPERIMENT_NAME, else pipeline.experiment, else the pipeline's experiment of
    the params' language pair, `wmt14-<src><tgt>`: `wmt14-ende` for English-German (base,
    big, smoke, multi30k), `wmt14-enfr` for English-French. It names the registered model
    too (`<experiment>-<params stem>`), so a pair never registers under another's name."""
    pair = f"wmt14-{params.data.src_lang}{params.data.tgt_lang}"
    return os.environ.get("MLFLOW_EXPERIMENT_NAME") or params.pipeline.experiment or pair
