"""One ``python -m sglang.launch_server`` process on 127.0.0.1, as a user starts it.

``Server`` starts the real HTTP server in its own process group, waits until
``/health_generate`` answers (or the process dies, raising with the tail of its log),
and on exit stops the whole group (SIGTERM, then SIGKILL after a grace period). The log
is kept in a file so a failed row can be read afterwards; ``log_errors`` lists the lines
that mean the server did not run cleanly.

``refusal`` runs a start that must fail at argument resolution and returns its output.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

HOST = "127.0.0.1"
# Lines that mean a server did not run cleanly. sglang's log lines carry no level, and some
# benign ones contain the word "error" (e.g. "max_error"), so match markers, not the word.
ERROR_MARKERS = re.compile(
    r"Traceback \(most recent call last\)|hit an exception|CUDA error|core dumped|"
    r"Segmentation fault|out of memory|^\w*Error: "
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def server_command(
    model: str | Path, args: Sequence[str], port: int, python: str = sys.executable
) -> list[str]:
    return [
        python,
        "-m",
        "sglang.launch_server",
        "--model-path",
        str(model),
        "--host",
        HOST,
        "--port",
        str(port),
        *args,
    ]


# Upstream 0.5.23 logs these with a traceback and carries on, with every fork flag off too: the
# traceback that follows one of them is upstream's handled fallback, not a failure of the row.
HANDLED_FALLBACKS = re.compile(
    r"Metadata glue-graph capture failed for key .*; falling back to eager metadata prep permanently"
)


def log_errors(text: str) -> list[str]:
    """The lines of a server log that show an error (tracebacks, ERROR records, CUDA errors).

    A traceback right after a line of ``HANDLED_FALLBACKS`` is left out (see ``handled_fallbacks``).
    """
    errors, handled = [], False
    for line in text.splitlines():
        if HANDLED_FALLBACKS.search(line):
            handled = True
        elif ERROR_MARKERS.search(line) and not handled:
            errors.append(line)
        elif line.startswith("[") and not line.startswith("[transformers]"):
            handled = False  # the next log record ends the handled traceback
    return errors


def handled_fallbacks(text: str) -> list[str]:
    return [line for line in text.splitlines() if HANDLED_FALLBACKS.search(line)]


class ServerDied(RuntimeError):
    pass


class Server:
    """A running ``launch_server``; use as a context manager."""

    def __init__(
        self,
        model: str | Path,
        args: Sequence[str] = (),
        *,
        env: Mapping[str, str] | None = None,
        log_path: str | Path,
        python: str = sys.executable,
        start_timeout: float = 600.0,
        request_timeout: float = 300.0,
    ):
        self.port = free_port()
        self.url = f"http://{HOST}:{self.port}"
        self.command = server_command(model, args, self.port, python)
        self.env = {**os.environ, **(env or {})}
        self.log_path = Path(log_path)
        self.start_timeout = start_timeout
        self.request_timeout = request_timeout
        self.proc: subprocess.Popen | None = None
        self.startup_seconds: float | None = None

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> "Server":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "w")
        self._log.write("$ " + " ".join(self.command) + "\n")
        self._log.flush()
        t0 = time.monotonic()
        self.proc = subprocess.Popen(
            self.command,
            env=self.env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        while True:
            if self.proc.poll() is not None:
                raise ServerDied(
                    f"server exited with {self.proc.returncode} before it was healthy; "
                    f"log {self.log_path}:\n{self.tail()}"
                )
            if time.monotonic() - t0 > self.start_timeout:
                self.stop()
                raise ServerDied(
                    f"server not healthy after {self.start_timeout:.0f} s; log {self.log_path}:\n"
                    f"{self.tail()}"
                )
            try:
                with urllib.request.urlopen(
                    self.url + "/health_generate", timeout=30
                ) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(1.0)
        self.startup_seconds = time.monotonic() - t0
        return self

    def stop(self, grace: float = 30.0) -> int | None:
        """SIGTERM to the launcher (it drains and stops its scheduler and detokenizer), then
        SIGKILL to whatever of the process group is left; returns the launcher's exit status.
        """
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        try:  # children (scheduler, detokenizer) that outlive the launcher
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self._log.close()
        return self.proc.returncode

    def __enter__(self) -> "Server":
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()

    # ------------------------------------------------------------------ log
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def tail(self, lines: int = 60) -> str:
        return "\n".join(self.log().splitlines()[-lines:])

    def errors(self) -> list[str]:
        return log_errors(self.log())

    def fallbacks(self) -> list[str]:
        return handled_fallbacks(self.log())

    # ------------------------------------------------------------------ HTTP
    def post(self, path: str, body: Any, timeout: float | None = None) -> Any:
        return json.loads(self._post(path, body, timeout))

    def post_text(self, path: str, body: Any, timeout: float | None = None) -> str:
        """POST for endpoints that answer plain text (``/start_profile``, ``/stop_profile``)."""
        return self._post(path, body, timeout).decode()

    def _post(self, path: str, body: Any, timeout: float | None) -> bytes:
        req = urllib.request.Request(
            self.url + path,
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(
                req, timeout=timeout or self.request_timeout
            ) as r:
                return r.read()
        except urllib.error.HTTPError as e:
            raise RuntimeError(
                f"POST {path} -> {e.code}: {e.read().decode(errors='replace')}"
            ) from None

    def get(self, path: str, timeout: float | None = None) -> Any:
        with urllib.request.urlopen(
            self.url + path, timeout=timeout or self.request_timeout
        ) as r:
            body = r.read()
        try:
            return json.loads(body)
        except ValueError:
            return body.decode()

    def stream(
        self, path: str, body: Any, timeout: float | None = None
    ) -> Iterator[Any]:
        """POST with ``stream: true``; yields each server-sent event's JSON until ``[DONE]``."""
        req = urllib.request.Request(
            self.url + path,
            data=json.dumps({**body, "stream": True}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=timeout or self.request_timeout) as r:
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    return
                yield json.loads(data)


def refusal(
    model: str | Path,
    args: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    python: str = sys.executable,
    timeout: float = 300.0,
) -> subprocess.CompletedProcess:
    """Run a server start that must be refused; returns the finished process (output in ``.stdout``)."""
    return subprocess.run(
        server_command(model, args, free_port(), python),
        env={**os.environ, **(env or {})},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
        start_new_session=True,
    )
