"""README tells the truth: every command in its shell blocks names a real make target,
params that validate, options the command has. (What each command does is tested where it
lives: the flow in test_flow, translate in test_translate, export in test_export, the
served model and the Prefect server in test_flow; CI runs `make demo` and `make test`.)"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tasks.settings import load_run_params

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
SKIP = {".", "export", "curl"}  # the shell's own, and the client of a server tested elsewhere


def commands() -> list[list[str]]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("  #")[0].strip()
            if line and not line.startswith("#"):
                out.append(shlex.split(line.replace("<key>", "KEY")))
    return out


COMMANDS = [c for c in commands() if c[0] not in SKIP]


def test_the_readme_has_commands():
    assert len(COMMANDS) >= 20


@pytest.mark.parametrize("cmd", COMMANDS, ids=[" ".join(c)[:60] for c in COMMANDS])
def test_each_command_is_one_the_project_has(cmd):
    if cmd[0] == "make":
        makefile = (ROOT / "Makefile").read_text()
        assert re.search(rf"^{cmd[1]}:", makefile, flags=re.M), cmd
        return
    if cmd[0] in ("python", "torchrun"):
        module = cmd[cmd.index("-m") + 1]
        args = cmd[cmd.index("-m") + 2 :]
        if module == "flows.wmt14_ende":  # params and overrides validate
            load_run_params(ROOT / args[0], [a for a in args[1:] if "=" in a and "--" not in a])
            return
        options = [a.split("=")[0] for a in args if a.startswith("--")]
        _has_options([sys.executable, "-m", module], options)
        return
    if cmd[0] in ("prefect", "mlflow"):  # the subcommand exists, with these options
        words = [w for w in cmd[1:] if re.fullmatch(r"[a-z][a-z-]*", w)][:2]
        _has_options([str(BIN / cmd[0]), *words], [a for a in cmd if a.startswith("--")])
        return
    raise AssertionError(f"a README command no test knows: {cmd}")


def _has_options(cmd: list[str], options: list[str]) -> None:
    done = subprocess.run([*cmd, "--help"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    for option in options:
        assert option in done.stdout, f"{' '.join(cmd)} has no {option}"
