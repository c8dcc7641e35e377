"""The suite itself: on two workers (`make test`), the modules that share a costly session
fixture run on one of them, so that it is made once (tests/workers.py's GROUPS)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from workers import GROUPS, SHARED


def test_each_module_sharing_a_costly_fixture_is_in_its_group(request):
    """The modules collected in this run; one whose sharing tests are all slow (deselected
    here) may stay in its group."""
    uses: dict[str, set[str]] = {}
    for item in request.session.items:
        module = Path(item.nodeid.split("::")[0]).stem
        uses.setdefault(module, set()).update(
            SHARED[name] for name in item.fixturenames if name in SHARED
        )
    for module, groups in uses.items():
        assert len(groups) <= 1, f"{module} uses fixtures of two groups: {groups}"
        if groups:
            assert GROUPS.get(module) == next(iter(groups)), f"{module}: not in GROUPS"
    for module in GROUPS:
        assert (Path(__file__).parent / f"{module}.py").is_file(), module


def test_the_modules_of_a_group_run_on_one_worker(tmp_path):
    """The scheduler on a suite of three modules of four tests each, two of them a group
    (test_export and test_golden): two workers, the group on one, the third on the other;
    xdist's own schedule would deal the tests out one by one."""
    for module in ("test_export", "test_golden", "test_config"):
        tests = "".join(f"def test_{i}():\n    pass\n\n\n" for i in range(4))
        (tmp_path / f"{module}.py").write_text(tests)
    (tmp_path / "conftest.py").write_text(
        f"import sys\nsys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "from workers import pytest_xdist_make_scheduler  # noqa: F401\n"
    )
    cmd = [sys.executable, "-m", "pytest", "-n", "2", "-v", "-p", "no:cacheprovider"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}  # not a worker's
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:]
    ran = re.findall(r"\[(gw\d)\] .*PASSED (test_\w+)\.py::", done.stdout)
    assert len(ran) == 12, done.stdout[-3000:]
    workers = {module: {w for w, m in ran if m == module} for _, module in ran}
    assert workers["test_export"] == workers["test_golden"] and len(workers["test_export"]) == 1
    assert workers["test_config"] | workers["test_export"] == {"gw0", "gw1"}
