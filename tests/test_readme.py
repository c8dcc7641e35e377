"""README, benchmarks/README and docs/ tell the truth: every command in their shell blocks
names a real make target, params that validate (the params files a guide writes out
included), options the command has, and Prefect settings that exist; every relative link
resolves, anchors included. (What each command does is tested where it lives: the flow in
test_flow, translate in test_translate, export in test_export, the served model and the
Prefect server in test_flow, the work pool and the server's port in test_team, the
benchmarks in test_benchmarks; CI runs `make demo` and `make test`.)"""

from __future__ import annotations

import functools
import os
import random
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
    return commands_in(path.read_text(encoding="utf-8"))


def commands_in(text: str) -> list[list[str]]:
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
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


# ----------------------------------------------------------------- commands that really run

GUIDE = ROOT / "docs" / "guides" / "your-corpus.md"
PLACE = "/data/"  # where the corpus guide keeps its corpus and work dir; a tmp dir here


def _synthetic_en_cs(root: Path, pairs: int = 3000) -> Path:
    """A parallel English-Czech corpus of made-up words, translated word for word: a pair
    the project does not ship, with words enough for multi30k.yaml's 8,000 pieces."""
    rng = random.Random(62)

    def lexicon(vowels: str) -> list[str]:
        syllables = [c + v for c in "bcdfghjklmnprstvz" for v in vowels]
        words: set[str] = set()
        while len(words) < 3000:
            words.add("".join(rng.choice(syllables) for _ in range(rng.randint(2, 4))))
        return sorted(words)

    en, cs = lexicon("aeiou"), lexicon("aeiouáéíýůě")
    root.mkdir(parents=True)
    for split, n in (("train", pairs), ("dev", 100), ("test", 100)):
        rows = [[rng.randrange(len(en)) for _ in range(rng.randint(4, 12))] for _ in range(n)]
        for lang, words in (("en", en), ("cs", cs)):
            text = "".join(" ".join(words[i] for i in row) + " .\n" for row in rows)
            (root / f"{split}.{lang}").write_text(text, encoding="utf-8")
    return root


@pytest.fixture(scope="module")
def corpus_checkout(tmp_path_factory) -> tuple[Path, list[list[str]]]:
    """A folder to run the corpus guide's commands in, as from the repository root: its
    params files beside the one the guide writes, the corpus where the guide says (under a
    tmp dir for /data/); and the guide's commands, that tmp dir substituted."""
    here = tmp_path_factory.mktemp("checkout")
    place = f"{here}/data/"
    shutil.copytree(ROOT / "params", here / "params")
    for name, text in written_params(GUIDE).items():
        (here / name).write_text(text.replace(PLACE, place), encoding="utf-8")
    _synthetic_en_cs(here / "data" / "en-cs")
    cmds = [[w.replace(PLACE, place) for w in cmd] for cmd in commands(GUIDE)]
    return here, cmds


def _run(cmd: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    """A documented `python -m ...` or `mlflow ...` line as a shell after `. .venv/bin/activate`
    runs it: this checkout's code, its own MLflow store and Prefect API."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "PREFECT_"))}
    while ENV.fullmatch(cmd[0]):
        name, value = cmd[0].split("=", 1)
        env[name], cmd = value, cmd[1:]
    env.update(PYTHONPATH=str(ROOT), PATH=f"{BIN}:{os.environ['PATH']}")
    program = sys.executable if cmd[0] == "python" else str(BIN / cmd[0])
    return subprocess.run([program, *cmd[1:]], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)  # fmt: skip


def test_the_corpus_guide_checks_its_params_file_as_written(corpus_checkout):
    here, cmds = corpus_checkout
    check = next(c for c in cmds if c[-1] == "--check")
    done = _run(check, here, 300)
    assert done.returncode == 0, done.stderr
    said = done.stdout
    assert f"{here}/data/en-cs (text, en-cs): train 3,000 pairs" in said
    assert "average   the best 5 of 39 scored snapshots" in said and "warning" not in said
    # Without the guide's score.tokenized_refs, multi30k.yaml's German and French
    # references would fail the decode stage after training: the check refuses them.
    text = (here / "params" / "en-cs.yaml").read_text()
    bare = re.sub(r"score:\n  tokenized_refs: null.*\n", "", text)
    assert bare != text
    (here / "params" / "bare.yaml").write_text(bare)
    bare = _run([*check[:3], "params/bare.yaml", "--check"], here, 300)
    assert bare.returncode == 2 and "score.tokenized_refs, data.tgt_lang: " in bare.stderr


@pytest.mark.slow  # every stage on 3,000 pairs: minutes on 2 cores
def test_the_corpus_guide_runs_as_written_on_a_pair_the_project_does_not_ship(corpus_checkout):
    """The rehearsal runs every stage on the corpus; the run differs from it only in the
    model and the training's length (and its check passed above)."""
    here, cmds = corpus_checkout
    rehearsal, run = [c for c in cmds if "flows.wmt14_ende" in c]
    assert [w for w in rehearsal if w not in run] == [
        "model.n_layers=1", "train.max_steps=50", "train.save_every=10", "train.valid_every=10",
        "train.log_every=10",
    ]  # fmt: skip
    done = _run(rehearsal, here, 1800)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert "registered   models:/wmt14-encs-en-cs/1" in done.stdout
    # no link to the private Prefect API, gone when the command ends; no library warnings
    said = done.stdout + done.stderr
    assert "View at" not in said and "UserWarning" not in said
    assert "  then open http://127.0.0.1:5000/#/experiments/" in done.stdout
    work = Path(rehearsal[rehearsal.index("--work-dir") + 1])
    hyps = next(work.glob("decode/*/test.hyp")).read_text(encoding="utf-8").splitlines()
    assert len(hyps) == 100
    assert next(work.glob("export/*/ctranslate2/model.bin")).is_file()


def _serving_block() -> list[list[str]]:
    """README's commands after `make demo` that write files (the server: tests/test_flow)."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("\n## Serving\n", 1)[1].split("\n## ", 1)[0]
    return [c for c in commands_in(section) if c[0] != "curl" and "serve" not in c]


@pytest.mark.slow  # ~50 s beside the demo's flow (shared with tests/test_flow.py)
def test_the_serving_commands_run_as_written_after_the_demo(fresh_flow, tmp_path):
    """README's download, translate and export lines, from a folder whose `work` is a
    finished demo's work dir and whose `data` is the repository's: they succeed, and
    write nothing into the checkout."""
    here = tmp_path / "checkout"
    here.mkdir()
    (here / "work").symlink_to(fresh_flow)
    (here / "data").symlink_to(ROOT / "data")
    block = _serving_block()
    assert [c[c.index("-m") + 1] if "-m" in c else c[1] for c in block[1:]] == [
        "transformer.translate", "transformer.export"]  # fmt: skip
    assert block[0][1:3] == ["mlflow", "artifacts"]
    for cmd in block:
        done = _run([w.replace("/tmp/", f"{tmp_path}/") for w in cmd], here, 600)
        assert done.returncode == 0, (" ".join(cmd), done.stderr[-2000:])
    source = (ROOT / "data" / "smoke" / "test.en").read_text().splitlines()
    assert len((tmp_path / "test.de").read_text().splitlines()) == len(source)
    assert (tmp_path / "wmt14-smoke-ct2" / "model.bin").is_file()
    assert sorted(p.name for p in here.iterdir()) == ["data", "work"]
