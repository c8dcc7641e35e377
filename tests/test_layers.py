"""flows/ -> tasks/ -> transformer/, never back: the library runs under bare torchrun. Inside
the library, four wings over a ground floor, each arrow one way: training -> decoding ->
nn, data -> the ground floor (config, files, the model file, tokens, console, cli)."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _imports(package: str) -> set[str]:
    names = set()
    for path in (ROOT / package).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module.split(".")[0])
    return names


def test_transformer_imports_no_orchestration():
    assert not _imports("transformer") & {"prefect", "mlflow", "tasks", "flows"}


def test_tasks_do_not_import_flows():
    assert "flows" not in _imports("tasks")


def test_importing_the_library_loads_neither_prefect_nor_mlflow():
    modules = sorted(
        "transformer." + ".".join(p.relative_to(ROOT / "transformer").with_suffix("").parts)
        for p in (ROOT / "transformer").rglob("*.py")
        if p.name != "__init__.py"
    )
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        "print(sorted(k for k in sys.modules if k.split('.')[0] in ('prefect', 'mlflow')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# What each wing may import besides itself; the ground floor imports no wing. The commands
# (`python -m transformer.train`, ...; `python -m transformer.config`'s __main__) are the
# entry points of the wings' modules.
WINGS = {
    "nn": {"ground"},
    "data": {"ground"},
    "decoding": {"ground", "nn", "data"},
    "training": {"ground", "nn", "data", "decoding"},
    "ground": set(),
}
COMMANDS = {"train", "translate", "average", "export", "evaluate"}


def _wing(parts: tuple[str, ...]) -> str:
    return parts[0] if len(parts) > 1 and parts[0] in WINGS else "ground"


def test_the_wings_import_one_way():
    wrong = []
    for path in (ROOT / "transformer").rglob("*.py"):
        parts = path.relative_to(ROOT / "transformer").with_suffix("").parts
        command = (len(parts) == 1 and parts[0] in COMMANDS) or parts == ("config", "__main__")
        if parts == ("__init__",) or command:
            continue
        wing = _wing(parts)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module + "." + a.name for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                target = name.split(".")
                if target[0] != "transformer" or len(target) < 2:
                    continue
                to = _wing(tuple(target[1:]))
                if to != wing and to not in WINGS[wing]:
                    wrong.append(f"{'/'.join(parts)}.py ({wing}) imports {name} ({to})")
    assert not wrong, wrong


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _library_imports(path: Path, modules: set[str]) -> set[str]:
    """The library's modules that `path` imports, anywhere in it (an import inside a
    function is a dependency too, only a later one): `from a.b import c` is a.b.c where
    that is a module, else a.b."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in modules)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                name = f"{node.module}.{a.name}"
                found.add(name if name in modules else node.module)
    return found & modules


def test_no_two_modules_of_the_library_import_each_other():
    """One imports the other, never both (a circle is two modules that are one concern, or
    one that reads the other's internals), however long the way round."""
    paths = {_module_name(p): p for p in (ROOT / "transformer").rglob("*.py")}
    graph = {m: _library_imports(p, set(paths)) - {m} for m, p in paths.items()}
    circles = []
    for start in sorted(graph):
        stack, seen = [(start, (start,))], set()
        while stack:
            module, way = stack.pop()
            for nxt in graph[module]:
                if nxt == start:
                    circles.append(" -> ".join((*way, start)))
                elif nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, (*way, nxt)))
    assert not circles, circles
