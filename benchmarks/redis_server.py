"""A real redis-server on 127.0.0.1 for the state-store benchmark and the tests: its own port
and folder, the append-only file fsynced on every write, ``kill`` a SIGKILL and ``start`` the
same server again on the same files (replaying its append-only file)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
import uuid


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """``conf``: a redis.conf whose persistence settings replace the fsync-always default."""

    def __init__(self, folder, conf: str | None = None, timeout_s: float = 30.0) -> None:
        self.binary = shutil.which("redis-server")
        if self.binary is None:
            raise RuntimeError(
                "no redis-server on the PATH: `make redis-server` installs Debian's package"
            )
        self.folder, self.port, self.conf = os.path.abspath(folder), free_port(), conf
        self.start(timeout_s)

    def start(self, timeout_s: float = 30.0) -> float:
        """Start the server and wait until it answers; returns the seconds that took."""
        import redis

        args = ["--port", str(self.port), "--bind", "127.0.0.1", "--dir", self.folder]
        if not self.conf:
            args += ["--appendonly", "yes", "--appendfsync", "always", "--save", ""]
        args += ["--logfile", os.path.join(self.folder, "redis.log")]
        t0 = time.perf_counter()
        self.proc = subprocess.Popen([self.binary, *([self.conf] if self.conf else []), *args])
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_connect_timeout=1)
        try:
            while True:
                try:
                    if client.ping():
                        return time.perf_counter() - t0
                except redis.exceptions.BusyLoadingError:
                    pass  # replaying its append-only file
                except redis.ConnectionError:
                    if self.proc.poll() is not None:
                        raise RuntimeError(
                            f"redis-server exited with {self.proc.returncode}: see "
                            f"{self.folder}/redis.log"
                        ) from None
                if time.perf_counter() - t0 > timeout_s:
                    raise TimeoutError(f"redis-server not answering after {timeout_s} s")
                time.sleep(0.02)
        finally:
            client.close()

    def client(self):
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port)

    def kill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def uri(self, prefix: str | None = None) -> str:
        """A store URI on this server; a fresh key prefix unless one is given."""
        return f"redis://127.0.0.1:{self.port}/0?prefix={prefix or uuid.uuid4().hex[:10]}"
