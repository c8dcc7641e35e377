"""Where `make test`'s two workers (pytest-xdist) run each test module.

The tests are mostly processes that start and wait, one core busy on average. A module's
tests stay on one worker, so its module fixtures are made once, and so do the modules
sharing a costly session fixture (a trained run, a finished flow): GROUPS, checked against
the fixtures they use by tests/test_suite.py. (xdist's --dist loadgroup would say it with
marks, but under pytest 9.2 it drops them: pytest-xdist#1386.)
"""

from __future__ import annotations

from pathlib import Path

import pytest

SHARED = {"golden_run": "golden", "smoke_model": "golden", "fresh_flow": "fresh_flow"}
GROUPS = {
    **dict.fromkeys(["test_export", "test_golden", "test_search", "test_static_search"],
                    "golden"),
    **dict.fromkeys(["test_flow", "test_readme", "test_registry", "test_reliability",
                     "test_slurm"], "fresh_flow"),
}  # fmt: skip


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """A scope a module, or its group; for xdist's default mode (-n alone) only."""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadFileScheduling

    class ByModuleGroup(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = Path(super()._split_scope(nodeid)).stem
            return GROUPS.get(module, module)

    return ByModuleGroup(config, log)
