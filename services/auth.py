"""Bearer tokens for the HTTP API: who may rank, who may write events, who may look at users.

A token is a random string its holder sends as ``Authorization: Bearer <token>``. The service
keeps only its SHA-256 (tokens are 256 random bits: a plain hash cannot be reversed or guessed)
in a tokens file, one line per token::

    <sha256 hex of the token> <scopes, comma-separated> [a name for the logs]

Scopes: ``read`` (``POST /v1/rank``, ``POST /v1/recommend``), ``write`` (``POST /v1/events``),
``admin`` (every other ``/v1/`` route: ``/v1/users/{id}``, ``/v1/stats``). ``/healthz`` and the
OpenAPI pages stay open.
``python -m services.auth new --scopes read,write --name web`` makes a token: the token on
stderr (give it to the client), its line on stdout (append it to the file). The file is read
again whenever it changes, so adding a line and removing the old one rotates a token without a
restart (a Kubernetes Secret mounted as a volume is updated in place).

With no tokens file the API is open, and the app refuses to start unless Serve's HTTP host is a
loopback address (``make serve`` on 127.0.0.1).
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import ipaddress
import logging
import os
import secrets
import sys
import threading

from models.errors import InputError

log = logging.getLogger("kvrank.auth")

SCOPES = ("read", "write", "admin")
# the scope of a path: the first prefix it starts with; other /v1/ paths need admin
ROUTE_SCOPES = (
    ("/v1/rank", "read"),
    ("/v1/recommend", "read"),
    ("/v1/events", "write"),
    ("/v1/", "admin"),
)


def scope_of(path: str, root_path: str = "") -> str | None:
    """The scope a request for ``path`` needs, or None for an open path (health, API docs);
    ``root_path``: the app's route prefix, when ``path`` includes it."""
    if root_path and path.startswith(root_path.rstrip("/") + "/"):
        path = path[len(root_path.rstrip("/")) :]
    for prefix, scope in ROUTE_SCOPES:
        if path == prefix or path.startswith(prefix.rstrip("/") + "/"):
            return scope
    return None


def digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def parse(text: str, source: str) -> list[tuple[str, frozenset[str], str]]:
    """(hash, scopes, name) per line of a tokens file; blank lines and ``#`` comments skipped.
    A bad line is an InputError naming the file, the line and the rule."""
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        where = f"{source}, line {n}"
        if len(parts) < 2:
            raise InputError(f"{where}: want '<sha256 hex> <scopes> [name]', got {line!r}")
        hashed, scopes, name = parts[0].lower(), parts[1], " ".join(parts[2:]) or f"line {n}"
        if len(hashed) != 64 or any(c not in "0123456789abcdef" for c in hashed):
            raise InputError(f"{where}: the first field must be a token's sha256 (64 hex digits)")
        wanted = frozenset(scopes.split(","))
        if not wanted or not wanted <= set(SCOPES):
            raise InputError(f"{where}: scopes must be among {', '.join(SCOPES)}, got {scopes!r}")
        out.append((hashed, wanted, name))
    return out


class Tokens:
    """The tokens of a tokens file, read again when the file changes (its mtime or size)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.lock = threading.Lock()
        self.seen: tuple[float, int] | None = None
        self.entries: list[tuple[str, frozenset[str], str]] = []
        self._reload()
        if not self.entries:
            raise InputError(f"api_tokens_file {path} holds no tokens")

    def _reload(self) -> None:
        try:
            st = os.stat(self.path)
            if (st.st_mtime, st.st_size) == self.seen:
                return
            with open(self.path) as f:
                text = f.read()
        except OSError as e:
            raise InputError(f"api_tokens_file {self.path}: {e.strerror}") from e
        self.seen = (st.st_mtime, st.st_size)  # a bad edit is reported once, not per request
        self.entries = parse(text, self.path)  # a bad edit raises and keeps the last good set

    def scopes(self, token: str) -> tuple[frozenset[str], str] | None:
        """(scopes, name) of a presented token, or None. Every stored hash is compared, in
        constant time each, whether or not one matched before."""
        with self.lock:
            try:
                self._reload()
            except InputError as e:  # a rotation half written: serve with the tokens read last
                log.warning("API tokens not reloaded, the last good set is used: %s", e)
            entries = self.entries
        presented = digest(token)
        found = None
        for hashed, scopes, name in entries:
            if hmac.compare_digest(hashed, presented) and found is None:
                found = (scopes, name)
        return found


def check_exposure(host: str, tokens_file: str | None) -> None:
    """Refuse an open API (no tokens file) on an HTTP host other than a loopback address."""
    if tokens_file:
        return
    if host == "localhost":
        return
    try:
        if ipaddress.ip_address(host).is_loopback:
            return
    except ValueError:
        pass
    raise InputError(
        f"the HTTP API would be open to the network: Serve listens on {host!r} and no "
        "api_tokens_file is set. Set api_tokens_file (python -m services.auth new makes "
        "tokens; docs/operators.md, 'API tokens'), or listen on 127.0.0.1 only"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m services.auth",
        description="Make an API token: the token on stderr, its tokens-file line on stdout.",
    )
    sub = p.add_subparsers(dest="command", required=True)
    new = sub.add_parser("new", help="a new random token")
    new.add_argument("--scopes", required=True, help=f"comma-separated, among {', '.join(SCOPES)}")
    new.add_argument("--name", default="", help="a name for the token in the logs")
    a = p.parse_args(argv)
    token = secrets.token_urlsafe(32)
    line = f"{digest(token)} {a.scopes} {a.name}".rstrip()
    try:
        parse(line, "--scopes")
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"token (give it to the client; it is not stored): {token}", file=sys.stderr)
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
