"""The command line's own Prefect API, when no server is configured (PREFECT_API_URL).

Prefect's temporary API runs in the caller's process group: a scheduler that stops a job
signals the whole group, the API dies first, and the flow then retries it for minutes
before it can report how it ended. This one runs `prefect server start` (API only, loopback)
in a session of its own, so it outlives the signal long enough to hear the flow's last
word, and Linux stops it when the command that started it dies, however it dies.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator

from prefect.settings import PREFECT_API_URL, PREFECT_UI_URL, temporary_settings

from tasks.credentials import redact
from transformer.cli import UserError
from transformer.processes import die_with_parent

START_TIMEOUT_S = 180  # a busy 2-core machine takes ~15 s


class LocalApiError(RuntimeError):
    """The private API did not come up; the message is one line, the server's last words."""


class NoServer(UserError):
    """PREFECT_API_URL names a server that does not answer: the user's setting to mend."""


@contextlib.contextmanager
def local_api() -> Iterator[str]:
    """Yield the URL of a private API (Prefect's API URL setting points at it meanwhile)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
           "--port", str(port), "--no-services", "--no-ui", "--analytics-off"]  # fmt: skip
    # The flow's pid given: a flow that is pid 1 (a container without an init) is alive.
    ends_with_flow = functools.partial(die_with_parent, os.getpid())
    server = subprocess.Popen(cmd, start_new_session=True, preexec_fn=ends_with_flow,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)  # fmt: skip
    url = f"http://127.0.0.1:{port}/api"
    try:
        _wait_healthy(server, url)
    except BaseException:
        with contextlib.suppress(ProcessLookupError):  # a server that exited left no group
            os.killpg(server.pid, signal.SIGKILL)
        raise
    # No stop at the end of the block: Prefect sends its last logs and events while this
    # process exits, and the server stops when it is gone (PR_SET_PDEATHSIG).
    # No UI link ("View at ..."): this API serves no UI, and is gone when the command ends.
    with temporary_settings(updates={PREFECT_API_URL: url, PREFECT_UI_URL: ""}):
        yield url


def check_api(url: str) -> None:
    """That the Prefect API at `url` (PREFECT_API_URL) answers: else the flow would retry it
    for minutes and end in a traceback. NoServer names the URL, credentials redacted."""
    reason = _unhealthy(url, timeout=10)
    if reason:
        raise NoServer(
            f"PREFECT_API_URL {redact(url)}: no Prefect API answers ({reason}): start the "
            "server (prefect server start), or unset PREFECT_API_URL for a temporary one"
        )


def wait_for_api(url: str, seconds: float, say: Callable[[str], object]) -> None:
    """Wait up to `seconds` for the Prefect API at `url` to answer, as a server started
    moments ago does once it is up; `say(why)` once, at the first miss. LocalApiError, one
    line naming the URL (redacted), if it never does or the URL cannot be one."""
    deadline = time.monotonic() + seconds
    said = False
    while reason := _unhealthy(url, timeout=min(10.0, max(deadline - time.monotonic(), 1.0))):
        if reason.startswith("ValueError") or time.monotonic() >= deadline:
            waited = "" if reason.startswith("ValueError") else f" within {seconds:g} s"
            raise LocalApiError(
                f"PREFECT_API_URL {redact(url)}: no Prefect API answers{waited} ({reason}): "
                "start the server (prefect server start), or fix PREFECT_API_URL"
            )
        if not said:
            say(reason)
            said = True
        time.sleep(1)


def _unhealthy(url: str, timeout: float) -> str | None:
    """Why the API at `url` does not answer its health check, or None if it does."""
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/health", timeout=timeout) as r:
            return None if r.status == 200 else f"HTTP {r.status}"
    except (OSError, ValueError) as err:
        return redact(f"{type(err).__name__}: {getattr(err, 'reason', err)}")


def _wait_healthy(server: subprocess.Popen, url: str) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            lines = server.stderr.read().decode(errors="replace").strip().splitlines()
            raise LocalApiError(f"`prefect server start` exited with {server.returncode}: "
                                f"{lines[-1] if lines else 'no output'}")  # fmt: skip
        with contextlib.suppress(OSError), urllib.request.urlopen(f"{url}/health", timeout=2) as r:
            if r.status == 200:
                return
        time.sleep(0.2)
    raise LocalApiError(f"`prefect server start` on {url} not ready after {START_TIMEOUT_S} s")
