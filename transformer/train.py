"""Train the Transformer: one process, or any number under torchrun, with the same command
(`python -m transformer.train`; the trainer itself: training/trainer.py).

    python -m transformer.train PARAMS --data SHARDS --out RUN_DIR [key=value ...]
    torchrun --nproc_per_node N -m transformer.train PARAMS --data SHARDS --out RUN_DIR

The trainer is a set of stateful parts (model, optimizer, schedule, data position, every
rank's RNG, progress, early stopping, the checkpoint manager), each with `state_dict` /
`load_state_dict`, saved together by the checkpoint manager. Rerunning the command resumes
from the newest readable state and continues the same trajectory; a finished run is a
no-op. Operational keys (config.operational: cadences, how long to train, patience, the
memory bound max_tokens) may change on resume; any other model or train key, or other data,
is refused with the differences named, unless `--allow-param-change`; `--reset` starts over.
`--init-from STATE` starts an empty run folder from another run's training state with these
params: a branch, as warmup-stable-decay invites (one held-lr run, several cooldowns).

Exit codes: 0 trained to train.max_steps or stopped early (or already there); 1 stopped
after train.max_bad_steps non-finite updates in a row (seen at the next read); 2 bad params,
data or checkpoints (one line on stderr); 128 + signal number after SIGTERM/SIGINT: the
current update is finished and saved first. Not 0, because an interrupted run is not a
finished one.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from pathlib import Path

from transformer import processes
from transformer.cli import USER_ERRORS, ArgumentParser
from transformer.config import Params, ParamsError, load_params
from transformer.console import setup_logging
from transformer.files import SPM_MODEL, atomic_write
from transformer.nn.attention import attention_context
from transformer.training.distributed import (
    DistEnv,
    DistributedError,
    distribute,
    init_distributed,
    shutdown,
)
from transformer.training.lifecycle import StopSignal, die_with_parent, prepare_run_dir
from transformer.training.metrics import ConsoleLogger, MetricsLogger, NullLogger, TeeLogger
from transformer.training.trainer import EXIT_USAGE, Trainer

log = logging.getLogger("transformer.train")  # not "__main__" under -m


def main(argv: list[str] | None = None, logger: MetricsLogger | None = None) -> int:
    """Train as the command line says; returns the exit code. Rank 0 logs metrics to the
    console and to `logger` (closed on return); other ranks log nothing."""
    parent = processes.started_by()  # before the rendezvous, which may outlast torchrun
    try:
        args = parse_args(argv)
    except SystemExit as exit_:  # argparse's usage errors
        return int(exit_.code or 0)
    try:
        params = load_params(args.params, args.overrides)
    except ParamsError as err:
        print(f"error: {err}".replace("\n", "; "), file=sys.stderr)
        return EXIT_USAGE
    try:
        env = init_distributed()
    except DistributedError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USAGE
    setup_logging(env.is_main, timestamps=not args.no_timestamps)
    try:
        die_with_parent(args.die_with_parent, parent)
        with prepare_run_dir(args.out, args.reset, env):
            return run(params, args, env, logger)
    except USER_ERRORS as err:
        rank = f" (rank {env.rank})" if env.distributed else ""
        print(f"error{rank}: {err}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:  # a second Ctrl-C (lifecycle.StopSignal), after any save
        print("error: stopped at once by a second SIGINT; the newest saved state is whole: "
              "rerun to resume from it", file=sys.stderr)  # fmt: skip
        return 128 + signal.SIGINT
    finally:
        shutdown()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = ArgumentParser(
        prog="python -m transformer.train", description="Train (or resume) a Transformer."
    )
    parser.add_argument("params", type=Path, help="params YAML file")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="params overrides")
    parser.add_argument("--data", type=Path, required=True, help="shards folder")
    parser.add_argument("--out", type=Path, required=True, help="run folder")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "--allow-param-change",
        action="store_true",
        help="resume even if params or data differ from the checkpoint's",
    )
    mode.add_argument("--reset", action="store_true", help="delete the checkpoints, start over")
    parser.add_argument(
        "--init-from",
        type=Path,
        metavar="STATE",
        help="start an empty run folder from another run's training state (state-*.pt): "
        "its weights, optimizer, step and data position, with these params (a branch; the "
        "differences are listed); a rerun resumes the folder's own",
    )
    parser.add_argument(
        "--no-timestamps",
        action="store_true",
        help="log lines without a time (a caller that adds its own)",
    )
    parser.add_argument(
        "--die-with-parent",
        action="store_true",
        help="save and stop if the launching process dies (always so under torchrun)",
    )
    return parser.parse_intermixed_args(argv)


def run(params: Params, args: argparse.Namespace, env: DistEnv, logger: MetricsLogger | None):
    t = Trainer(params, env, args.data, args.out)
    t.log_plan()
    t.resume(args.allow_param_change, args.init_from)
    if env.is_main:  # the run folder's copy of the vocabulary: the export bundles it
        atomic_write(args.out / SPM_MODEL, t.sp.serialized_model_proto())
    if t.finished:
        early = ", stopped early" if t.stopping.stopped else ""
        log.info("step %d: nothing to do (train.max_steps %d%s)",
                 t.progress.step, params.train.max_steps, early)  # fmt: skip
        return 0
    t.net = distribute(t.weights.net, env, params.train.compile)
    console = ConsoleLogger(params.train.max_steps, t.progress.step) if env.is_main else None
    sink = TeeLogger(console, logger) if console and logger else console or NullLogger()
    stop = StopSignal()
    try:
        stop.install()
        with attention_context(env.device):  # the backends chosen in attention.py
            return t.fit(sink, stop)
    finally:
        stop.restore()
        t.loader.close()
        sink.close()


if __name__ == "__main__":
    sys.exit(main())
