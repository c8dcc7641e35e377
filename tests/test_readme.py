"""README, benchmarks/README and docs/ tell the truth: every command in their shell blocks
names a real make target, params that validate (the params files a guide writes out
included), options the command has, and Prefect settings that exist; every relative link
resolves, anchors included. (What each command does is tested where it lives: the flow in
test_flow, translate in test_translate, export in test_export, the served model and the
Prefect server in test_flow, the work pool and the server's port in test_team, the
benchmarks in test_benchmarks; CI runs `make demo` and `make test`.)"""

from __future__ import annotations

import functools
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tasks.settings import load_run_params

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
DOCS = [ROOT / "README.md", ROOT / "benchmarks/README.md", *sorted((ROOT / "docs").rglob("*.md"))]
SKIP = {".", "export", "curl"}  # the shell's own, and the client of a server tested elsewhere
ENV = re.compile(r"[A-Z][A-Z0-9_]*=\S*")  # a variable set for one command: `VAR=value cmd`


def commands(path: Path) -> list[list[str]]:
    """The commands of a markdown file's bash blocks, comments dropped, lines joined."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", path.read_text(encoding="utf-8"), flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("  #")[0].strip()
            if line and not line.startswith("#"):
                out.append(shlex.split(line.replace("<key>", "KEY")))
    return out


def written_params(path: Path) -> dict[str, str]:
    """Params files a document writes out: yaml blocks whose first line names the file."""
    found = {}
    for block in re.findall(r"```yaml\n(.*?)```", path.read_text(encoding="utf-8"), flags=re.S):
        named = re.match(r"# (params/[\w.-]+\.yaml)", block)
        if named:
            found[named.group(1)] = block
    return found


COMMANDS = [(p, c) for p in DOCS for c in commands(p) if c[0] not in SKIP]
WRITTEN = {k: v for p in DOCS for k, v in written_params(p).items()}


def _id(item) -> str:
    path, cmd = item
    return f"{path.relative_to(ROOT)}: {' '.join(cmd)[:60]}"


def test_the_docs_have_commands():
    assert len(COMMANDS) >= 40
    readme = [c for p, c in COMMANDS if p.name == "README.md"]
    assert len(readme) >= 15
    assert WRITTEN, "the corpus guide's params file"


@pytest.fixture(scope="module")
def params_dir(tmp_path_factory) -> Path:
    """The repository's params files and those the guides write, side by side (a written
    one extends base.yaml by a relative path)."""
    out = tmp_path_factory.mktemp("params") / "params"
    shutil.copytree(ROOT / "params", out)
    for name, text in WRITTEN.items():
        (out.parent / name).write_text(text, encoding="utf-8")
    return out


@pytest.mark.parametrize("item", COMMANDS, ids=[_id(i) for i in COMMANDS])
def test_each_command_is_one_the_project_has(item, params_dir, monkeypatch):
    _, cmd = item
    while ENV.fullmatch(cmd[0]):
        name, value = cmd.pop(0).split("=", 1)
        _is_a_setting(name, value, monkeypatch)
    if cmd[0] == "make":
        makefile = (ROOT / "Makefile").read_text()
        assert re.search(rf"^{cmd[1]}:", makefile, flags=re.M), cmd
        return
    if cmd[0] in ("python", "torchrun"):
        module = cmd[cmd.index("-m") + 1]
        args = cmd[cmd.index("-m") + 2 :]
        if module in ("flows.wmt14_ende", "transformer.config"):  # params, overrides validate
            params = params_dir.parent / args[0]
            load_run_params(params, [a for a in args[1:] if "=" in a and "--" not in a])
            if module == "transformer.config":
                return
        options = [a.split("=")[0] for a in args if a.startswith("--")]
        _has_options([sys.executable, "-m", module], options)
        return
    if cmd[0] in ("prefect", "mlflow"):  # the subcommand exists, with these options
        words = [w for w in cmd[1:] if re.fullmatch(r"[a-z][a-z-]*", w)][:2]
        _has_options([str(BIN / cmd[0]), *words], [a for a in cmd if a.startswith("--")])
        return
    raise AssertionError(f"a command no test knows: {cmd}")


def _is_a_setting(name: str, value: str, monkeypatch) -> None:
    """A Prefect variable must be one of Prefect's settings (a misspelt one is ignored
    silently); MLflow's is its tracking URI."""
    if name == "MLFLOW_TRACKING_URI":
        return
    assert name.startswith("PREFECT_"), name
    from prefect.settings import Settings

    monkeypatch.setenv(name, value)
    assert value in str(Settings().model_dump()), f"{name} is no Prefect setting"


def _has_options(cmd: list[str], options: list[str]) -> None:
    code, out, err = _help(tuple(cmd))
    assert code == 0, err[-2000:]
    for option in options:
        assert option in out, f"{' '.join(cmd)} has no {option}"


@functools.cache
def _help(cmd: tuple[str, ...]) -> tuple[int, str, str]:
    """A command's --help, once per command (dozens of lines share a few commands)."""
    done = subprocess.run([*cmd, "--help"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    return done.returncode, done.stdout, done.stderr


# --------------------------------------------------------------------------------- links

LINK = re.compile(r"\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lowercase, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)
    return {_slug(h) for h in re.findall(r"^#+ (.+)$", text, flags=re.M)}


LINKS = [
    (doc, target)
    for doc in DOCS
    for target in LINK.findall(
        re.sub(r"```.*?```", "", doc.read_text(encoding="utf-8"), flags=re.S)
    )
    if not target.startswith(("http://", "https://", "mailto:"))
]


def test_the_docs_have_links():
    assert len(LINKS) >= 30


@pytest.mark.parametrize(
    "doc,target", LINKS, ids=[f"{d.relative_to(ROOT)} -> {t}" for d, t in LINKS]
)
def test_each_relative_link_resolves(doc, target):
    file, _, anchor = target.partition("#")
    path = (doc.parent / file).resolve() if file else doc
    assert path.exists(), f"{doc.relative_to(ROOT)}: {target} does not exist"
    assert ROOT in path.parents or path == ROOT, f"{target} leaves the repository"
    if anchor and path.suffix == ".md":
        assert anchor in _anchors(path), f"{doc.relative_to(ROOT)}: no #{anchor} in {file}"
