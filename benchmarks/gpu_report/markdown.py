"""report.md: the targets, the plan's summary tables, then a section a heading, each with
its status, tables, notes, and where it failed its traceback and the end of its output."""

from __future__ import annotations


def markdown(report: dict) -> str:
    lines = [
        f"# {report['title']}: {report['device']}",
        "",
        f"`{report['command']}`, started {report['started']}, {report['wall_s']:.0f} s in "
        f"all ({report['sizes']} sizes)."
        + ("" if report["complete"] else " Unfinished: the sections below are those it ran."),
        "",
        "## Targets",
        "",
        *md_table(report["targets"]),
    ]
    for title, rows in report.get("summary", {}).items():
        lines += ["", f"## {title}", "", *md_table(rows)]
    for title, section in report["sections"].items():
        lines += ["", f"## {title}", "", status_line(section)]
        for name, rows in section.get("tables", {}).items():
            lines += ["", *([f"**{name}**", ""] if name else []), *md_table(rows)]
        if section.get("notes"):
            lines += ["", *(f"- {note}" for note in section["notes"])]
        trace = "\n".join(filter(None, (section.get("traceback"), section.get("log tail"))))
        if trace:
            lines += ["", "```text", trace.rstrip(), "```"]
    return "\n".join(lines) + "\n"


def status_line(section: dict) -> str:
    """'ok (12.3 s)', and where it ran in a process of its own, which tree under what limit."""
    line = f"{section['status']} ({section['seconds']:.1f} s)"
    if "limit_s" in section:
        line += f"; {section['tree']}; time limit {section['limit_s']:.0f} s"
    return line


def md_table(rows: list[dict]) -> list[str]:
    if not rows:
        return ["(no rows)"]
    cols = list(dict.fromkeys(k for r in rows for k in r if k != "status"))
    cols += ["status"] if any("status" in r for r in rows) else []
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join(cell(c, r.get(c)) for c in cols) + " |")
    return lines


def cell(col: str, v) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else ""
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        if "MFU" in col or "difference" in col:
            return f"{v:.2%}" if "difference" in col else f"{v:.1%}"
        return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.3g}"
    if isinstance(v, dict):
        return "; ".join(f"{k}: {cell(col, x)}" for k, x in v.items())
    return str(v).replace("|", "\\|").replace("\n", " ")
