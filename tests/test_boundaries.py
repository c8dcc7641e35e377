"""The project's outer boundary, table by table: what a deployment parameter, a params key,
a work dir or a file argument may hold, and what each gets. A shell never sees a value
unquoted; no credential reaches Prefect, a log or an error line; nothing in a work dir's
registry runs; a schedule that would flood the machine, or an API that does not answer, is
one line and exit 2; a file argument is checked for what it must be, and no error quotes
its content. The cases that start a flow or a Prefect server are the few at the end."""

from __future__ import annotations

import logging
import subprocess
from pathlib import Path

import pytest

from tasks import slurm
from tasks.launch import Layout, TrainingFailed
from tasks.settings import load_run_params
from transformer.config import ParamsError

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "params" / "smoke.yaml"
log = logging.getLogger(__name__)


# --- A shell never sees a value unquoted (tasks/slurm.py) ----------------------------------

WORDS = [
    "w$(touch PWNED)",
    "w`touch PWNED`",
    "it's",
    'say "hi"',
    "two  spaces",
    "a;touch PWNED",
    "$HOME",
    "line\nbreak",
    "star*",
    "back\\slash",
]


@pytest.mark.parametrize("word", WORDS)
def test_a_word_of_the_node_script_reaches_bash_as_it_is(word, tmp_path):
    """The agent's command line as the node's bash reads it: each argument the same string,
    nothing run (bash itself parses what tasks/slurm.py writes)."""
    line = slurm._join(["printf", "%s\\0", word, slurm.Expanded('"$X"')])
    done = subprocess.run(["bash", "-c", line], cwd=tmp_path, env={"X": "x"},
                          capture_output=True, text=True, timeout=30)  # fmt: skip
    assert done.stdout.split("\0")[:2] == [word, "x"]
    assert not (tmp_path / "PWNED").exists()


@pytest.mark.parametrize("name", ["per%jcent", "back\\slash"])
def test_a_work_dir_slurm_reads_as_a_pattern_is_one_line_before_sbatch(name, tmp_path):
    out = tmp_path / name / "train" / "key"
    cfg = load_run_params(SMOKE).pipeline.slurm
    with pytest.raises(slurm.SlurmError) as err:
        slurm.submit(Layout("slurm", 1, 1), cfg, ["-c", "pass"], out, {}, log)
    assert str(err.value) == (
        f"the run folder {out}: Slurm reads '%' and '\\' in a job's paths as patterns: "
        "choose a work dir without them"
    )
    assert not out.exists()


@pytest.mark.parametrize(
    "option, said",
    [
        ("--wra=echo hi", "--wra (--wrap) is set by the launcher (its batch script)"),
        ("--wrap=echo hi", "--wrap is set by the launcher (its batch script)"),
        ("--sig=B:USR1@9", "--sig (--signal) is set by pipeline.slurm.signal_seconds"),
        ("--ntasks-per=3", "--ntasks-per (--ntasks-per-node) is set by the launcher"),
        ("-t5", "'-t5' is not one sbatch option in its long form"),
        ("-N2", "'-N2' is not one sbatch option in its long form"),
        ("--", "'--' is not one sbatch option in its long form"),
    ],
)
def test_an_sbatch_option_the_launcher_sets_is_refused_however_spelled(option, said):
    with pytest.raises(ParamsError) as err:
        load_run_params(SMOKE, [f"pipeline.slurm.sbatch_options=[{option!r}]"])
    assert f"pipeline.slurm.sbatch_options: {said}" in str(err.value)
    assert "\n" not in str(err.value)


def test_sbatch_options_of_their_own_pass():
    opts = "pipeline.slurm.sbatch_options=[--gpus-per-node=8, --exclusive, --qos=high]"
    assert load_run_params(SMOKE, [opts]).pipeline.slurm.sbatch_options[0] == "--gpus-per-node=8"


def test_a_job_that_failed_to_launch_is_one_line_not_a_signal_it_never_got(tmp_path):
    """Slurm's ExitCode 0:53 (a launch failure) reads as 181: no signal's number."""
    with pytest.raises(TrainingFailed, match=r"^Slurm job 7 failed: the trainer exited with 181"):
        slurm.raise_for_end("7", "FAILED", 181, False, [], tmp_path)
