"""Storage: every input and output of kvrank is a URI, a local path or ``s3://bucket/prefix``.

All file access goes through fsspec (s3fs for S3; its endpoint and credentials come from the
usual ``AWS_*`` environment variables, so a MinIO or moto endpoint works through
``AWS_ENDPOINT_URL``). Nothing here imports Ray.

Publishing never destroys (the pattern of Delta and Iceberg tables). A published folder holds
immutable versions, ``<folder>/_v/<version>/``, each with its files and a marker
``_SUCCESS.json`` listing them with their sizes and sha256; ``<folder>/_SUCCESS.json`` is the
pointer naming the current version, written last and in one piece (an S3 PUT, or a local
rename). ``Publication`` writes a new version's files, seals it with its marker, and only then
moves the pointer: a crash at any step leaves the previous version current and readable, and
a version is never changed after it is sealed. Readers ``resolve`` a folder to its current
version once and read every file from there, so a run (or a Serve deployment) keeps the
version it started with; ``read_file`` checks a file against its sha256. The newest
``KEEP_VERSIONS`` versions are kept. A run that fails before publishing - bad input, say -
never touches what was already there.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq

MARKER = "_SUCCESS.json"
VERSIONS = "_v"  # <folder>/_v/<version>/: one immutable version
KEEP_VERSIONS = 3


class StorageError(RuntimeError):
    """A URI that cannot be read or written, with the URI and the reason in the message."""


class IncompleteError(StorageError):
    """A folder with no (or an inconsistent) completion marker: a crashed or running write."""


def filesystem(uri: str) -> tuple[fsspec.AbstractFileSystem, str]:
    """The fsspec filesystem for ``uri`` and the path inside it."""
    try:
        fs, path = fsspec.core.url_to_fs(uri)
    except (ImportError, ValueError) as e:
        raise StorageError(f"unsupported storage URI {uri!r}: {e}") from e
    return fs, path


def is_remote(uri: str) -> bool:
    return "://" in uri and not uri.startswith("file://")


def absolute(uri: str) -> str:
    """``uri`` with a local path made absolute: Ray workers do not share the driver's cwd."""
    return uri if is_remote(uri) else os.path.abspath(uri.removeprefix("file://"))


def pinned(uri: str) -> str:
    """An input as a job records it: absolute, and resolved to the version published now."""
    return resolve(absolute(uri))


def join(uri: str, *parts: str) -> str:
    """Join path parts onto a URI with '/' (correct for S3 and POSIX paths alike)."""
    out = uri.rstrip("/")
    for p in parts:
        out = f"{out}/{p.strip('/')}"
    return out


def _wrap(uri: str, action: str, e: Exception) -> StorageError:
    return StorageError(f"cannot {action} {uri}: {type(e).__name__}: {e}")


def exists(uri: str) -> bool:
    fs, path = filesystem(uri)
    try:
        return fs.exists(path)
    except Exception as e:  # noqa: BLE001 - any backend failure means "unreachable"
        raise _wrap(uri, "reach", e) from e


def read_bytes(uri: str) -> bytes:
    fs, path = filesystem(uri)
    try:
        with fs.open(path, "rb") as f:
            return f.read()
    except FileNotFoundError as e:
        raise StorageError(f"{uri} does not exist") from e
    except Exception as e:  # noqa: BLE001
        raise _wrap(uri, "read", e) from e


def write_bytes(uri: str, data: bytes) -> None:
    """Write ``data`` in one piece: an S3 PUT, or locally a temporary file renamed into place
    (a reader never sees a half-written file)."""
    fs, path = filesystem(uri)
    try:
        if not is_remote(uri):
            path = uri.removeprefix("file://")
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
            return
        with fs.open(path, "wb") as f:
            f.write(data)
    except Exception as e:  # noqa: BLE001
        raise _wrap(uri, "write", e) from e


def read_json(uri: str) -> Any:
    return json.loads(read_bytes(uri))


def write_json(uri: str, obj: Any) -> None:
    write_bytes(uri, json.dumps(obj, indent=2, sort_keys=True).encode())


def read_parquet(uri: str, columns: list[str] | None = None) -> pa.Table:
    fs, path = filesystem(uri)
    try:
        return pq.read_table(path, filesystem=fs, columns=columns)
    except FileNotFoundError as e:
        raise StorageError(f"{uri} does not exist") from e
    except Exception as e:  # noqa: BLE001
        raise _wrap(uri, "read", e) from e


def parquet_bytes(table: pa.Table) -> bytes:
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd")
    return buf.getvalue()


def check_writable(uri: str) -> None:
    """Fail early, before any work, when ``uri`` cannot be written (bad bucket, no endpoint)."""
    probe = join(uri, f".kvrank-probe-{uuid.uuid4().hex[:8]}")
    write_bytes(probe, b"")
    fs, path = filesystem(probe)
    with contextlib.suppress(Exception):
        fs.rm(path)


@contextlib.contextmanager
def local_copy(uri: str) -> Iterator[str]:
    """A local path holding the file at ``uri``: the path itself, or a temporary download."""
    if not is_remote(uri):
        path = uri.removeprefix("file://")
        if not os.path.exists(path):
            raise StorageError(f"{uri} does not exist")
        yield path
        return
    fs, path = filesystem(uri)
    with tempfile.TemporaryDirectory(prefix="kvrank-") as tmp:
        local = os.path.join(tmp, os.path.basename(path))
        try:
            fs.get(path, local)
        except FileNotFoundError as e:
            raise StorageError(f"{uri} does not exist") from e
        except Exception as e:  # noqa: BLE001
            raise _wrap(uri, "read", e) from e
        yield local


@contextlib.contextmanager
def local_folder(folder: str) -> Iterator[str]:
    """A local directory holding the published ``folder`` (every file its marker lists): the
    folder itself, or a temporary download - for readers that want a directory, such as
    Hugging Face's ``from_pretrained``."""
    marker = read_marker(folder)
    if not is_remote(folder):
        yield marker["uri"].removeprefix("file://")
        return
    with tempfile.TemporaryDirectory(prefix="kvrank-") as tmp:
        for name in marker.get("files", {}):
            dst = os.path.join(tmp, name)
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            with open(dst, "wb") as f:
                f.write(read_file(marker["uri"], name, marker))
        yield tmp


def _is_version(uri: str) -> bool:
    parts = uri.rstrip("/").rsplit("/", 2)
    return len(parts) == 3 and parts[1] == VERSIONS


def root_of(uri: str) -> str:
    """The published folder a version folder belongs to (any other URI: itself)."""
    return uri.rstrip("/").rsplit("/", 2)[0] if _is_version(uri) else uri


def name_of(uri: str) -> str:
    """The name of a published folder (its last path part), given it or one of its versions."""
    return root_of(uri).rstrip("/").rsplit("/", 1)[-1]


def resolve(folder: str) -> str:
    """The immutable version folder that ``folder`` publishes now (its pointer names it); a
    version folder resolves to itself. Resolve an input once and read every file from what it
    returns, so a publish meanwhile can never mix two versions."""
    if _is_version(folder):
        return folder
    marker_uri = join(folder, MARKER)
    if not exists(marker_uri):
        raise IncompleteError(
            f"{folder} is not a complete publication (no {MARKER}): it was never written, "
            "or the job writing it failed or is still running"
        )
    version = read_json(marker_uri).get("version")
    if not version:
        raise IncompleteError(f"{marker_uri} names no version: not a kvrank publication")
    return join(folder, VERSIONS, version)


def read_marker(folder: str) -> dict[str, Any]:
    """The marker of the version ``folder`` publishes (or of a version folder itself), checked
    against the sizes of the files it lists; ``marker["uri"]`` is that version's folder."""
    uri = resolve(folder)
    marker_uri = join(uri, MARKER)
    if not exists(marker_uri):
        raise IncompleteError(f"{uri} is not a complete version (no {MARKER})")
    marker = read_json(marker_uri)
    fs, _ = filesystem(uri)
    for name, meta in marker.get("files", {}).items():
        _, path = filesystem(join(uri, name))
        try:
            size = fs.size(path)
        except FileNotFoundError:
            size = None
        if size != meta["bytes"]:
            raise IncompleteError(
                f"{join(uri, name)} has {size} bytes but {MARKER} records {meta['bytes']}: "
                "the folder was changed after publishing"
            )
    marker["uri"] = uri
    return marker


def read_file(folder: str, name: str, marker: dict[str, Any] | None = None) -> bytes:
    """File ``name`` of the version ``folder`` publishes, checked against the sha256 its marker
    records (IncompleteError when it differs: the file was changed after publishing). Pass
    ``marker`` (``read_marker(folder)``) when reading several files of one version, so that
    the marker is read and its files' sizes checked once, not once per file."""
    marker = marker if marker is not None else read_marker(folder)
    uri = join(marker["uri"], name)
    data = read_bytes(uri)
    want = marker.get("files", {}).get(name, {}).get("sha256")
    if want is None:
        raise IncompleteError(f"{uri} is not one of the files {join(marker['uri'], MARKER)} lists")
    if hashlib.sha256(data).hexdigest() != want:
        raise IncompleteError(
            f"{uri} does not match the sha256 in {MARKER}: the folder was changed after publishing"
        )
    return data


def read_table(
    folder: str,
    name: str,
    columns: list[str] | None = None,
    marker: dict[str, Any] | None = None,
) -> pa.Table:
    """Parquet file ``name`` of the version ``folder`` publishes, checksum verified."""
    return pq.read_table(io.BytesIO(read_file(folder, name, marker)), columns=columns)


@dataclass
class Publication:
    """Write the files of one new version of ``folder``, then publish them together (see the
    module docstring).

    >>> pub = Publication("s3://bucket/datasets/ml")       # doctest: +SKIP
    >>> pub.put_table("items.parquet", items)               # doctest: +SKIP
    >>> pub.publish({"n_items": items.num_rows})            # doctest: +SKIP
    """

    folder: str
    _files: dict[str, dict[str, Any]] = field(default_factory=dict)
    version: str = ""
    uri: str = ""  # the new version's folder

    def __post_init__(self) -> None:
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        self.version = f"{stamp}-{uuid.uuid4().hex[:8]}"
        self.uri = join(self.folder, VERSIONS, self.version)

    def put_bytes(self, name: str, data: bytes) -> None:
        write_bytes(join(self.uri, name), data)
        self._files[name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}

    def put_table(self, name: str, table: pa.Table) -> None:
        self.put_bytes(name, parquet_bytes(table))

    def publish(self, meta: dict[str, Any]) -> dict[str, Any]:
        """Seal the version (its marker), then point ``folder`` at it (one write, the commit);
        returns the marker, ``marker["uri"]`` the version's folder. Older versions beyond the
        newest ``KEEP_VERSIONS`` are then removed."""
        marker = {k: v for k, v in meta.items() if k != "uri"}  # "uri" is where it is read
        marker["files"] = dict(self._files)
        marker["published_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        marker["version"] = self.version
        write_json(join(self.uri, MARKER), marker)
        write_json(join(self.folder, MARKER), marker)  # the pointer: the only commit step
        self._prune()
        return marker | {"uri": self.uri}

    def discard(self) -> None:
        """Remove this unpublished version (when the run gives up)."""
        remove_tree(self.uri)

    def _prune(self) -> None:
        fs, path = filesystem(join(self.folder, VERSIONS))
        with contextlib.suppress(Exception):
            names = sorted(os.path.basename(p.rstrip("/")) for p in fs.ls(path, detail=False))
            old = [n for n in names if n != self.version][: max(0, len(names) - KEEP_VERSIONS)]
            for name in old:
                remove_tree(join(self.folder, VERSIONS, name))


def remove_tree(uri: str) -> None:
    """Remove a folder and everything under it, if it is there (best effort)."""
    fs, path = filesystem(uri)
    with contextlib.suppress(Exception):
        if is_remote(uri):
            fs.rm(path, recursive=True)
        else:
            shutil.rmtree(path, ignore_errors=True)
