"""flows/ -> tasks/ -> transformer/, never back: the library runs under bare torchrun."""

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
