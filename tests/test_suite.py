"""The suite itself: on two workers (`make test`), the modules that share a costly session
fixture run on one of them, so that it is made once (tests/conftest.py's GROUPS)."""

from __future__ import annotations

from pathlib import Path

from conftest import GROUPS, SHARED


def test_each_module_sharing_a_costly_fixture_is_in_its_group(request):
    """Those of this run (slow ones deselected, a module may use none: it may stay)."""
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
