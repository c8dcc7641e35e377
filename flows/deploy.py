"""Serve the `wmt14-ende` deployments declared in prefect.yaml from this process (no work
pool or worker needed), or register them for the workers of a work pool:

    prefect server start                      # in one terminal (the team's API and UI)
    python -m flows.deploy --work-dir /data/wmt14-work
    prefect deployment run wmt14-ende/smoke   # from anywhere that reaches the server

    python -m flows.deploy --pool gpu --work-dir /data/wmt14-work   # registers, then exits
    prefect deployment run wmt14-ende/smoke-gpu                     # a worker of `gpu` runs it

prefect.yaml is the one declaration of names, parameters and schedules (cron or interval,
as `prefect deploy` reads them). A served deployment keeps its name (`smoke`); one for a
work pool is named after the pool too (`smoke-gpu`), so that the two never share a
deployment (a run of a shared name would go to whichever registered it last). Either way
the work dir is a parameter of every run, made absolute here.

A deployment runs one flow at a time (Prefect's concurrency limit of one, CANCEL_NEW): a
run that comes due, or is started, while another of the same deployment runs is cancelled
("Deployment concurrency limit reached."), never queued behind it. Stopping a serve process
leaves the schedules active: runs that come due meanwhile wait, Late, until a serve process
serves them again, and then one runs and the others are cancelled. A schedule fires at most
once an hour (MIN_INTERVAL_S). The schedules are checked, and a starting API waited for
(--wait), before anything is served or registered.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import sys
import zoneinfo
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
from prefect import serve
from prefect.client.schemas.objects import ConcurrencyLimitConfig, ConcurrencyLimitStrategy
from prefect.exceptions import PrefectHTTPStatusError
from prefect.schedules import Cron, Interval, Schedule
from prefect.server.schemas.schedules import CronSchedule
from prefect.settings import get_current_settings
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from flows.local_api import LocalApiError, wait_for_api
from flows.pipeline import wmt14_ende
from tasks.credentials import CREDENTIAL_ADVICE, holds_credential, redact
from transformer.cli import ArgumentParser
from transformer.config import read_yaml

ROOT = Path(__file__).resolve().parents[1]
# A schedule more frequent than the shortest retraining (the smoke params; README gives its
# time) only makes runs that the concurrency limit cancels, or without the limit, flows that
# pile up until the machine runs out of memory (docs/guides/team.md).
MIN_INTERVAL_S = 3600
MAX_INTERVAL_S = 366 * 86400  # a yearly retraining at most; timedelta and Prefect take it
# One run of a deployment at a time; one that would collide is cancelled, not queued.
ONE_AT_A_TIME = ConcurrencyLimitConfig(
    limit=1, collision_strategy=ConcurrencyLimitStrategy.CANCEL_NEW
)
API_WAIT_S = 60  # for a server started moments ago, which answers once it is up


class DeploymentsError(ValueError):
    """A deployments file that cannot be read or says something this serve cannot do."""


def no_credential(parameters: dict[str, Any]) -> dict[str, Any]:
    """Parameters that hold no credential (Prefect stores and shows them): the error names
    the parameter, never its value."""
    for name, value in parameters.items():
        if any(holds_credential(s) for s in _strings(value)):
            raise ValueError(f"{name}: {CREDENTIAL_ADVICE}")
    return parameters


def _strings(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    items = value.values() if isinstance(value, dict) else value if isinstance(value, list) else []
    return [s for item in items for s in _strings(item)]


class ScheduleSpec(BaseModel):
    """One entry of a deployment's `schedules`, the keys `prefect deploy` reads for a cron or
    interval schedule; any other key is refused, a typo (`timezon`) never a silent default."""

    model_config = ConfigDict(extra="forbid")
    cron: str | None = None
    interval: float | None = Field(None, gt=0)  # seconds, as prefect.yaml writes it
    anchor_date: datetime | None = None
    timezone: str | None = None
    active: bool = True
    parameters: dict[str, Any] = {}

    _parameters = field_validator("parameters")(no_credential)

    @model_validator(mode="after")
    def _one_kind(self) -> ScheduleSpec:
        if (self.cron is None) == (self.interval is None):
            raise ValueError("give exactly one of 'cron' and 'interval'")
        if self.timezone is not None and self.timezone not in zoneinfo.available_timezones():
            raise ValueError(f"timezone: {self.timezone!r} is no IANA time zone")
        if self.cron is not None:
            _check_cron(self.cron, self.timezone)
        else:
            _check_interval(self.interval)
        return self


def _check_interval(seconds: float) -> None:
    if not math.isfinite(seconds) or not MIN_INTERVAL_S <= seconds <= MAX_INTERVAL_S:
        raise ValueError(f"interval: {seconds:g} s is outside {MIN_INTERVAL_S} (hourly) to "
                         f"{MAX_INTERVAL_S} (yearly)")  # fmt: skip


def _check_cron(cron: str, timezone: str | None) -> None:
    """A cron of five fields (minute hour day month weekday; croniter reads a sixth as
    seconds) that fires, at most hourly: the gaps between its next fire times as Prefect's
    scheduler computes them (a cron of several minutes in an hour shows the smallest gap
    within its first whole hour, so 62 fire times show it)."""
    Cron(cron)  # Prefect's ValueError for a cron string that does not parse
    if len(cron.split()) != 5 and not cron.startswith("@"):
        raise ValueError(f"cron: {cron!r} is not five fields (minute hour day month weekday)")
    start = datetime(2030, 1, 1, tzinfo=UTC)  # any start: the gaps repeat
    try:
        when = asyncio.run(CronSchedule(cron=cron, timezone=timezone).get_dates(62, start))
    except Exception:  # croniter's CroniterBadDateError: no such date (30 February)
        raise ValueError(f"cron: {cron!r} never fires") from None
    gap = min((b - a).total_seconds() for a, b in itertools.pairwise(when))
    if gap < MIN_INTERVAL_S:
        raise ValueError(f"cron: {cron!r} fires {gap:g} s apart, more often than hourly")


class DeploymentSpec(BaseModel):
    """One entry of `deployments`: what this serve reads; the rest (entrypoint, work_pool,
    ...) is for `prefect deploy` and a worker."""

    model_config = ConfigDict(extra="allow")
    name: str
    parameters: dict[str, Any]
    schedules: list[ScheduleSpec] = []
    tags: list[str] = []
    description: str | None = None

    _parameters = field_validator("parameters")(no_credential)


def declared(path: Path) -> dict[str, DeploymentSpec]:
    """The deployments of a prefect.yaml, by name, each checked; an error names the file,
    the deployment and the key."""
    spec = read_yaml(path, "deployments file", DeploymentsError)
    entries = spec.get("deployments") if isinstance(spec, dict) else None
    if not isinstance(entries, list):
        raise DeploymentsError(f"{path}: deployments: must be a list of deployments")
    found = {}
    for i, entry in enumerate(entries):
        name = entry.get("name", f"#{i + 1}") if isinstance(entry, dict) else f"#{i + 1}"
        if name in found:
            raise DeploymentsError(f"{path}: deployment {name}: declared twice")
        try:
            found[name] = DeploymentSpec.model_validate(entry)
        except ValidationError as err:
            raise DeploymentsError(f"{path}: deployment {name}: {_reason(err)}") from None
    return found


def _reason(err: ValidationError) -> str:
    """The first problem, in one line, after the dotted key it concerns."""
    first = err.errors()[0]
    key = ".".join(str(part) for part in first["loc"])
    message = first["msg"].removeprefix("Value error, ")
    return f"{key or '<top>'}: {'unknown key' if first['type'] == 'extra_forbidden' else message}"


def schedule(spec: ScheduleSpec) -> Schedule:
    common = {"timezone": spec.timezone, "active": spec.active, "parameters": spec.parameters}
    if spec.cron is not None:
        return Cron(spec.cron, **common)
    return Interval(timedelta(seconds=spec.interval), anchor_date=spec.anchor_date, **common)


def options(spec: DeploymentSpec, work_dir: str) -> dict:
    """What a served deployment and a pool's share: the spec's, the work dir, one at a time."""
    return {
        "parameters": {**spec.parameters, "work_dir": str(Path(work_dir).resolve())},
        "schedules": [schedule(s) for s in spec.schedules],
        "concurrency_limit": ONE_AT_A_TIME,
        "tags": spec.tags,
        "description": spec.description,
    }


def deployments(specs: dict[str, DeploymentSpec], work_dir: str, names: list[str]):
    return [wmt14_ende.to_deployment(name=name, **options(specs[name], work_dir)) for name in names]


def register_for_pool(specs: dict[str, DeploymentSpec], work_dir: str, names: list[str],
                      pool: str) -> None:  # fmt: skip
    """The deployments as `<name>-<pool>`, run by a worker of `pool` from this checkout
    (its folder is the runs' working directory: relative paths in params resolve there)."""
    source = wmt14_ende.from_source(source=str(ROOT), entrypoint="flows/pipeline.py:wmt14_ende")
    for name in names:
        try:
            source.deploy(
                name=f"{name}-{pool}",
                work_pool_name=pool,
                **options(specs[name], work_dir),
                print_next_steps=False,
            )
        except ValueError as err:  # Prefect's "Could not find work pool 'gpu'. ..."
            raise DeploymentsError(
                f"{err} (prefect work-pool create {pool} --type process)"
            ) from None
        print(f"registered wmt14-ende/{name}-{pool} for work pool {pool}")


def api_url(wait_s: float) -> str:
    """The Prefect API this process would use (PREFECT_API_URL, or the profile's), answering
    within `wait_s`; without one, serving would start a private API nobody else reaches."""
    url = get_current_settings().api.url
    if not url:
        raise DeploymentsError(
            "no Prefect API to serve on: start one (prefect server start) and set "
            "PREFECT_API_URL=http://127.0.0.1:4200/api in this shell"
        )
    say = lambda why: print(f"waiting up to {wait_s:g} s for the Prefect API at "
                            f"{redact(url)} ({why})", flush=True)  # fmt: skip
    try:
        wait_for_api(url, wait_s, say)
    except LocalApiError as err:
        raise DeploymentsError(str(err)) from None
    return url


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m flows.deploy", description=__doc__.split("\n\n")[0])
    parser.add_argument("--work-dir", default="work", help="stage outputs and MLflow store")
    parser.add_argument(
        "--file",
        type=Path,
        default=ROOT / "prefect.yaml",
        help="the deployments file (default: the repository's prefect.yaml)",
    )
    parser.add_argument("--only", nargs="+", metavar="NAME", help="serve these deployments")
    parser.add_argument(
        "--pool",
        metavar="POOL",
        help="register the deployments for the workers of this work pool, as NAME-POOL, and "
        "exit (instead of serving them from this process)",
    )
    parser.add_argument(
        "--wait",
        type=float,
        default=API_WAIT_S,
        metavar="SECONDS",
        help=f"how long to wait for a Prefect API that does not answer yet (default "
        f"{API_WAIT_S}: a server started moments ago)",
    )
    args = parser.parse_args(argv)  # fmt: skip
    try:
        specs = declared(args.file)
        names = args.only or list(specs)
        unknown = sorted(set(names) - set(specs))
        if unknown:
            raise DeploymentsError(f"{args.file}: no deployment {', '.join(unknown)}")
        url = api_url(args.wait)
        print(f"Prefect API {redact(url)}: each deployment runs one flow at a time; a run that "
              "comes due while another runs is cancelled", flush=True)  # fmt: skip
        if args.pool:
            register_for_pool(specs, args.work_dir, names, args.pool)
            return 0
        served = deployments(specs, args.work_dir, names)
    except (PrefectHTTPStatusError, httpx.HTTPError) as err:  # the API answered, then did not
        lines = str(err).strip().splitlines() or [type(err).__name__]
        print(f"error: Prefect API: {redact(lines[0])}", file=sys.stderr)
        return 2
    except DeploymentsError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    # Stopping the server process must not pause the team's schedules.
    serve(*served, pause_on_shutdown=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
