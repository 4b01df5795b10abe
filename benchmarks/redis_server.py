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


def binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise RuntimeError(f"no {name} on the PATH: `make redis-server` installs Debian's package")
    return path


class RedisServer:
    """``conf``: a redis.conf whose persistence settings replace the fsync-always default;
    ``args``: more server options (a cluster node's)."""

    def __init__(
        self, folder, conf: str | None = None, timeout_s: float = 30.0, args: tuple = ()
    ) -> None:
        self.binary = binary("redis-server")
        self.folder, self.port, self.conf = os.path.abspath(folder), free_port(), conf
        self.args = list(args)
        os.makedirs(self.folder, exist_ok=True)
        self.start(timeout_s)

    def start(self, timeout_s: float = 30.0) -> float:
        """Start the server and wait until it answers; returns the seconds that took."""
        import redis

        args = ["--port", str(self.port), "--bind", "127.0.0.1", "--dir", self.folder]
        if not self.conf:
            args += ["--appendonly", "yes", "--appendfsync", "always", "--save", ""]
        args += ["--logfile", os.path.join(self.folder, "redis.log"), *self.args]
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


class RedisCluster:
    """A real Redis Cluster on 127.0.0.1: ``masters`` servers in cluster mode (each with its
    append-only file fsynced on every write), the 16,384 slots spread over them by
    ``redis-cli --cluster create``; ready when every node reports ``cluster_state:ok``."""

    def __init__(self, folder, masters: int = 3, timeout_s: float = 30.0) -> None:
        import redis

        folder = os.path.abspath(folder)
        self.nodes = [
            RedisServer(
                os.path.join(folder, f"node-{i}"),
                timeout_s=timeout_s,
                # the bus port named: by default it is the port + 10,000, past 65,535 for many
                args=("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf")
                + ("--cluster-port", str(free_port())),
            )
            for i in range(masters)
        ]
        try:
            subprocess.run(
                [binary("redis-cli"), "--cluster", "create"]
                + [f"127.0.0.1:{n.port}" for n in self.nodes]
                + ["--cluster-replicas", "0", "--cluster-yes"],
                check=True,
                capture_output=True,
                timeout=timeout_s,
            )
            t0 = time.perf_counter()
            for n in self.nodes:
                client = redis.Redis(host="127.0.0.1", port=n.port)
                while client.cluster("info").get("cluster_state") != "ok":
                    if time.perf_counter() - t0 > timeout_s:
                        raise TimeoutError(f"Redis Cluster not ready after {timeout_s} s")
                    time.sleep(0.05)
                client.close()
        except BaseException:
            self.kill()
            raise

    def uri(self, prefix: str | None = None) -> str:
        """A store URI on the cluster (any node is an entry point); a fresh key prefix."""
        port = self.nodes[0].port
        return f"redis://127.0.0.1:{port}/0?cluster=1&prefix={prefix or uuid.uuid4().hex[:10]}"

    def kill(self) -> None:
        for n in self.nodes:
            if n.proc.poll() is None:
                n.kill()
