"""``kvbatch serve``: build the services from the environment, recover the batches a previous
server left, and serve with uvicorn until interrupted. Running batches are separate processes:
they finish even while no server is up, and the next server reports them."""

from __future__ import annotations

import logging
import os
import socket
import sys
from typing import Any

from kvbatch.serve.auth import ApiKeys, KeyConfigError
from kvbatch.serve.settings import ServeSettings

log = logging.getLogger(__name__)


class ServeConfigError(ValueError):
    """The server cannot start (no keys, a bad key entry); the message says what to set."""


def api_keys(env_value: str | None, insecure_no_auth: bool) -> ApiKeys | None:
    """The accepted keys, or None for no auth; refuses to serve openly unless told to."""
    try:
        keys = ApiKeys.parse(env_value)
    except KeyConfigError as exc:
        raise ServeConfigError(str(exc)) from None
    if keys and insecure_no_auth:
        raise ServeConfigError("KVBATCH_API_KEYS is set and --insecure-no-auth was given: choose one")
    if not keys and not insecure_no_auth:
        raise ServeConfigError("no API keys: set KVBATCH_API_KEYS (comma-separated keys or sha256:<hex> entries), "
                               "or pass --insecure-no-auth to serve without authentication")
    return keys or None


def build(settings: ServeSettings, keys: ApiKeys | None) -> tuple[Any, Any, Any]:
    """(the FastAPI app, the batch driver, the worker launcher), over the state in ``settings``."""
    from kvbatch.serve.app import create_app
    from kvbatch.serve.batches import BatchService, Driver
    from kvbatch.serve.files import FileService
    from kvbatch.serve.launcher import LocalLauncher
    from kvbatch.serve.state import StateStore

    store = StateStore(settings.state_url, settings.storage_options)
    files = FileService(store, settings)
    launcher = LocalLauncher()
    launcher.start()
    batches = BatchService(store, files, launcher, settings)
    return create_app(files, batches, keys), Driver(batches, settings.poll_s), launcher


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` and listening. Port 0 takes a free port from the OS: the
    server holds it from here on, so nothing can take it between a look for a free port and the
    bind (a test, or a user who wants any port, reads the one bound from the "serving" line)."""
    if not 0 <= port <= 65535:
        raise ServeConfigError(f"--port must be in 0..65535 (0: any free port), got {port}")
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn's own bind: restart at once
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ServeConfigError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.listen(2048)  # uvicorn's backlog: clients queue from now on, while the batches are recovered
    return sock


def serve(settings: ServeSettings, keys: ApiKeys | None, host: str, port: int) -> int:
    """Serve on ``host:port`` (port 0: one the OS picks) until interrupted; the line on stderr that
    says so names the address bound, port included."""
    import uvicorn

    from kvbatch.io.urls import redact

    if not os.environ.get("DAGSTER_HOME"):
        log.warning("DAGSTER_HOME is not set: batch runs go to an ephemeral Dagster instance and will not show "
                    "in the UI")
    try:
        sock = listen(host, port)  # before recovery: a port in use fails at once, touching no batch
    except ServeConfigError as exc:
        print(f"kvbatch: error: {exc}", file=sys.stderr)
        return 2  # the CLI's EXIT_FATAL, as for the other refusals to start
    bound = sock.getsockname()[1]
    app, driver, launcher = build(settings, keys)
    driver.start()  # first pass: batches a previous server left are recovered now
    shown = f"[{host}]" if ":" in host else host
    print(f"kvbatch: serving the Files and Batches API on http://{shown}:{bound}/v1 "
          f"(state in {redact(settings.state_url)}, model {settings.model}"
          f"{', NO AUTH' if keys is None else f', {len(keys.digests)} API keys'})", file=sys.stderr, flush=True)
    try:
        uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])
    finally:
        sock.close()
        driver.stop()
        launcher.stop()  # running batches finish; the next server reports them
    return 0
