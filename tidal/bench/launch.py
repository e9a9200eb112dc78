"""Local `tidal serve` processes for `tidal bench --launch`: started one after another on free
loopback ports (so one's start-up, including the adaptive policy's timing profile, never
competes with another's), stopped with SIGTERM then kill, whatever ends the sweep; started afresh
for each pass of a sweep with repeats (see LaunchedServers). Each writes its step-time log
(`--step-log`) beside its server log, for `tidal sim --profile`."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from tidal.bench.sweep import Target


def serve_args(mode: str) -> list[str]:
    """`tidal serve` arguments for a launch mode: off, fixed:K, adaptive, adaptive:K (K: the
    most the policy may choose)."""
    name, _, k = mode.partition(":")
    if name not in ("off", "fixed", "adaptive") or (name == "off" and k):
        raise ValueError(f"--launch mode {mode!r}: expected off, fixed:K, adaptive or adaptive:K")
    if k and not k.isdigit():
        raise ValueError(f"--launch mode {mode!r}: K must be a whole number")
    args = ["--speculation", name]
    if k:
        args += ["--num-speculative-tokens", k]
    elif name == "fixed":
        raise ValueError(f"--launch mode {mode!r}: fixed needs a K, e.g. fixed:4")
    return args


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LocalServer:
    """One launched server and where its output goes."""

    name: str
    url: str
    proc: subprocess.Popen
    log_path: Path

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]


def spawn_server(mode: str, extra_args: list[str], log_dir: Path, threads: int) -> LocalServer:
    """Start `tidal serve` in `mode` on a free loopback port (not yet ready)."""
    port = free_port()
    log_path = log_dir / f"server-{mode.replace(':', '-')}-{port}.log"
    step_log = log_path.with_name(f"steps-{mode.replace(':', '-')}-{port}.csv")  # what tidal sim --profile reads
    cmd = [sys.executable, "-m", "tidal.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--no-access-log", "--log-level", "warning", "--step-log", str(step_log), "--wait-compiled", *serve_args(mode), *extra_args]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    with open(log_path, "wb") as log:
        # its own process group: the terminal's Ctrl-C reaches only the bench, which stops it
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, process_group=0)
    return LocalServer(mode, f"http://127.0.0.1:{port}", proc, log_path)


async def wait_ready(server: LocalServer, timeout_s: float) -> None:
    """Poll /health until it answers 200; fail early, with the log, if the process exits."""
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=2) as client:
        while time.monotonic() < deadline:
            if server.proc.poll() is not None:
                raise RuntimeError(f"tidal serve ({server.name}) exited with {server.proc.returncode}:\n"
                                   f"{server.log_tail()}")
            try:
                if (await client.get(server.url + "/health")).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.25)
    raise RuntimeError(f"tidal serve ({server.name}) not ready in {timeout_s:.0f}s:\n{server.log_tail()}")


class LaunchedServers:
    """One local server per mode. `start()` stops those running and starts each mode afresh, one
    after another; a server is tracked from its spawn, so `stop()` also ends one still starting."""

    def __init__(self, modes: list[str], extra_args: list[str], log_dir: Path, threads: int, timeout_s: float):
        self.modes, self.extra_args, self.log_dir = modes, extra_args, log_dir
        self.threads, self.timeout_s = threads, timeout_s
        self.running: list[LocalServer] = []

    async def start(self) -> list[Target]:
        self.stop()
        for mode in self.modes:
            server = spawn_server(mode, self.extra_args, self.log_dir, self.threads)
            self.running.append(server)
            await wait_ready(server, self.timeout_s)
        return [Target(s.name, s.url) for s in self.running]

    def stop(self) -> None:
        stop_servers(self.running)
        self.running = []


def stop_servers(servers: list[LocalServer], grace_s: float = 30.0) -> None:
    """SIGTERM to all, then wait up to `grace_s` for each; kill what is left."""
    for s in servers:
        if s.proc.poll() is None:
            s.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for s in servers:
        try:
            s.proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            s.proc.kill()
            s.proc.wait(10)


def default_threads() -> int:
    """Compute threads per launched server: all cores but one, which the client needs for
    its streams (torch's threads slow down badly when another process takes one of theirs)."""
    return max(1, (os.cpu_count() or 2) - 1)


@contextmanager
def launched(modes: list[str], extra_args: list[str], log_dir: Path, threads: int | None = None,
             timeout_s: float = 300.0) -> Iterator[LaunchedServers]:
    """Local servers in `modes` (started by their `start()`), stopped on exit (normal end, error
    or Ctrl-C)."""
    for mode in modes:
        serve_args(mode)  # reject a bad mode before starting anything
    log_dir.mkdir(parents=True, exist_ok=True)
    servers = LaunchedServers(modes, extra_args, log_dir, threads or default_threads(), timeout_s)
    try:
        yield servers
    finally:
        servers.stop()
