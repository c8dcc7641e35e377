"""Serve the `wmt14-ende` deployments declared in prefect.yaml from this process (no work
pool or worker needed):

    prefect server start                      # in one terminal (the team's API and UI)
    python -m flows.deploy --work-dir /data/wmt14-work
    prefect deployment run wmt14-ende/big     # from anywhere that reaches the server

prefect.yaml is the one declaration of names, parameters and schedules; with a work pool,
`PROJECT_DIR=$PWD prefect deploy --all` registers the same deployments for a worker.
"""

from __future__ import annotations

from pathlib import Path

import yaml
from prefect import serve
from prefect.schedules import Cron

from flows.wmt14_ende import wmt14_ende
from transformer.cli import ArgumentParser

ROOT = Path(__file__).resolve().parents[1]


def declared() -> dict[str, dict]:
    """The deployments of prefect.yaml, by name."""
    spec = yaml.safe_load((ROOT / "prefect.yaml").read_text())
    return {d["name"]: d for d in spec["deployments"]}


def deployments(work_dir: str, names: list[str]):
    work = str(Path(work_dir).resolve())
    specs = declared()
    return [
        wmt14_ende.to_deployment(
            name=name,
            parameters={**specs[name]["parameters"], "work_dir": work},
            schedules=[
                Cron(
                    s["cron"],
                    timezone=s.get("timezone"),
                    active=s.get("active", True),
                    parameters=s.get("parameters"),
                )
                for s in specs[name].get("schedules", [])
            ],
            tags=specs[name].get("tags"),
            description=specs[name].get("description"),
        )
        for name in names
    ]


def main(argv: list[str] | None = None) -> None:
    names = list(declared())
    parser = ArgumentParser(description="Serve the wmt14-ende deployments.")
    parser.add_argument("--work-dir", default="work", help="stage outputs and MLflow store")
    parser.add_argument("--only", nargs="+", default=names, choices=names)
    args = parser.parse_args(argv)
    serve(*deployments(args.work_dir, args.only))


if __name__ == "__main__":
    main()
