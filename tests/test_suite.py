"""The suite itself: on two workers (`make test`), the modules that share a costly session
fixture run on one of them, so that it is made once (tests/conftest.py's GROUPS)."""

from __future__ import annotations

from pathlib import Path

from conftest import GROUPS, SHARED


def test_each_module_sharing_a_costly_fixture_is_in_its_group(request):
    uses: dict[str, set[str]] = {}
    for item in request.session.items:  # every module collected in this run
        module = Path(item.nodeid.split("::")[0]).stem
        groups = uses.setdefault(module, set())
        groups.update(SHARED[name] for name in item.fixturenames if name in SHARED)
    for module, groups in uses.items():
        assert len(groups) <= 1, f"{module} uses fixtures of two groups: {groups}"
        assert GROUPS.get(module) == next(iter(groups), None), (
            f"{module}: uses {groups or 'no shared fixture'}, GROUPS says {GROUPS.get(module)}"
        )
