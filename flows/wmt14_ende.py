"""Run the `wmt14-ende` pipeline (the flow: flows/pipeline.py) for one params file.

    python -m flows.wmt14_ende params/smoke.yaml [dotted.key=value ...] [--work-dir DIR]

runs it with no server (Prefect's temporary local API) and prints where the results are.
Exit codes: 0 done; 2 a user error (params, data, files, disk, a work dir in use), in one
line; 1 a bug, with its traceback; 128 + N after signal N (training saved first).
"""

from __future__ import annotations

import argparse
import sys

from tasks.credentials import redact
from tasks.settings import load_run_params
from transformer.cli import ArgumentParser, UserError


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(
        prog="python -m flows.wmt14_ende",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("params", help="params file, e.g. params/smoke.yaml")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value")
    parser.add_argument("--work-dir", default="work", help="stage outputs and MLflow store")
    parser.add_argument("--refresh", action="store_true", help="recompute every stage")
    args = parser.parse_intermixed_args(argv)  # overrides may follow --work-dir
    try:
        # The params first, with nothing but pydantic loaded: a typo's one line in about a
        # second, not after the seconds that Prefect, MLflow and torch take to import.
        # (A stop in that second ends the process as Python does; from the flow's start on,
        # as flows/stop.py says.)
        params = load_run_params(args.params, args.overrides)
        from flows.pipeline import run

        return run(args, params)
    except UserError as err:  # the params, or what they would fail at after hours
        print(f"error: {redact(str(err))}".replace("\n", "; "), file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
