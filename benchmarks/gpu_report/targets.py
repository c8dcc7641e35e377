"""Helpers of the plans' targets: a target row, and the figures it is judged on, read from
the sections' tables."""

from __future__ import annotations


def rows(sections: dict, title: str) -> list[dict]:
    """The rows of a section's main table (none if it did not run)."""
    return sections.get(title, {}).get("tables", {}).get("", [])


def find(sections: dict, title: str, **match) -> dict | None:
    same = lambda r: all(r.get(k) == v for k, v in match.items())
    return next((r for r in rows(sections, title) if same(r)), None)


def best_of(found: list[dict], key: str) -> dict | None:
    return max((r for r in found if r.get(key)), key=lambda r: r[key], default=None)


def get(row: dict | None, key: str) -> float | None:
    return None if row is None else row.get(key)


def ratio(a: dict | None, b: dict | None, key: str) -> float | None:
    x, y = get(a, key), get(b, key)
    return None if x is None or y is None else x / y


def target(name: str, value: float | None, threshold: float, why_not: str | None) -> dict:
    if value is None:
        result = "not measured (see its section)"
    elif why_not:
        result = f"not judged: {why_not}"
    else:
        result = "pass" if value >= threshold else "FAIL"
    return {"target": name, "at least": threshold, "measured": value, "result": result}
