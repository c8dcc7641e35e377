"""Deployments of `wmt14-ende`, served by this process (no work pool needed):

    prefect server start                      # in one terminal (the team's API and UI)
    python -m flows.deploy --work-dir /data/wmt14-work
    prefect deployment run wmt14-ende/big     # from anywhere that reaches the server

base and big carry weekly retraining schedules, inactive until someone turns them on
(`prefect deployment schedule resume ...` or in the UI); smoke retrains nightly.
The same deployments for a worker and work pool are declared in prefect.yaml.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from prefect import serve
from prefect.schedules import Cron

from flows.wmt14_ende import wmt14_ende

SCHEDULES = {
    # name: (params file, cron, active). Scheduled runs refresh: retrain from fresh data.
    "base": ("params/base.yaml", "0 2 * * 6", False),  # Saturdays 02:00
    "big": ("params/big.yaml", "0 2 * * 0", False),  # Sundays 02:00
    "smoke": ("params/smoke.yaml", "0 3 * * *", True),  # nightly 03:00
}


def deployments(work_dir: str, names: list[str]):
    work = str(Path(work_dir).resolve())
    return [
        wmt14_ende.to_deployment(
            name=name,
            parameters={"params": SCHEDULES[name][0], "work_dir": work},
            schedules=[
                Cron(
                    SCHEDULES[name][1],
                    timezone="UTC",
                    active=SCHEDULES[name][2],
                    parameters={"refresh": True},
                )
            ],
            tags=["wmt14-ende", name],
            description=f"Transformer {name} ({SCHEDULES[name][0]})",
        )
        for name in names
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Serve the wmt14-ende deployments.")
    parser.add_argument("--work-dir", default="work")
    parser.add_argument("--only", nargs="*", default=list(SCHEDULES), choices=list(SCHEDULES))
    args = parser.parse_args(argv)
    serve(*deployments(args.work_dir, args.only))


if __name__ == "__main__":
    main()
