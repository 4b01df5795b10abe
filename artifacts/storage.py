"""Storage: every input and output of kvrank is a URI, a local path or ``s3://bucket/prefix``.

All file access goes through fsspec (s3fs for S3; its endpoint and credentials come from the
usual ``AWS_*`` environment variables, so a MinIO or moto endpoint works through
``AWS_ENDPOINT_URL``). Nothing here imports Ray.

Publishing is crash-safe. A table set (a dataset, a set of vectors, ...) counts as complete only
when its marker file ``_SUCCESS.json`` exists and the files it lists have the sizes it records.
``Publication`` stages every file under a hidden ``.staging-<id>/`` folder first, and only once
all of them are written does it (1) remove the old marker, (2) move the staged files into
place, (3) write the new marker. A crash before (1) leaves the old publication untouched; a crash
between (1) and (3) leaves no marker, so readers refuse the folder instead of reading a mix.
A run that fails before publishing - bad input, say - never touches what was already there.
"""

from __future__ import annotations

import contextlib
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
    fs, path = filesystem(uri)
    try:
        if not is_remote(uri):
            fs.makedirs(fs._parent(path), exist_ok=True)
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
        yield folder.removeprefix("file://")
        return
    with tempfile.TemporaryDirectory(prefix="kvrank-") as tmp:
        for name in marker.get("files", {}):
            dst = os.path.join(tmp, name)
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            with open(dst, "wb") as f:
                f.write(read_bytes(join(folder, name)))
        yield tmp


def read_marker(folder: str) -> dict[str, Any]:
    """The completion marker of a published folder, checked against the files it lists."""
    marker_uri = join(folder, MARKER)
    if not exists(marker_uri):
        raise IncompleteError(
            f"{folder} is not a complete publication (no {MARKER}): it was never written, "
            "or the job writing it failed or is still running"
        )
    marker = read_json(marker_uri)
    fs, _ = filesystem(folder)
    for name, meta in marker.get("files", {}).items():
        _, path = filesystem(join(folder, name))
        try:
            size = fs.size(path)
        except FileNotFoundError:
            size = None
        if size != meta["bytes"]:
            raise IncompleteError(
                f"{join(folder, name)} has {size} bytes but {MARKER} records {meta['bytes']}: "
                "the folder was changed after publishing"
            )
    return marker


@dataclass
class Publication:
    """Stage files for one folder, then publish them together (see the module docstring).

    >>> pub = Publication("s3://bucket/datasets/ml")       # doctest: +SKIP
    >>> pub.put_table("items.parquet", items)               # doctest: +SKIP
    >>> pub.publish({"n_items": items.num_rows})            # doctest: +SKIP
    """

    folder: str
    _staged: dict[str, int] = field(default_factory=dict)
    _staging: str = ""

    def __post_init__(self) -> None:
        self._staging = join(self.folder, f".staging-{int(time.time())}-{uuid.uuid4().hex[:8]}")

    def put_bytes(self, name: str, data: bytes) -> None:
        write_bytes(join(self._staging, name), data)
        self._staged[name] = len(data)

    def put_table(self, name: str, table: pa.Table) -> None:
        self.put_bytes(name, parquet_bytes(table))

    def publish(self, meta: dict[str, Any]) -> dict[str, Any]:
        """Move the staged files into place and write the marker; returns the marker."""
        fs, _ = filesystem(self.folder)
        marker_uri = join(self.folder, MARKER)
        try:
            if exists(marker_uri):
                fs.rm(filesystem(marker_uri)[1])
            for name in self._staged:
                src = filesystem(join(self._staging, name))[1]
                dst = filesystem(join(self.folder, name))[1]
                fs.mv(src, dst)
        except StorageError:
            raise
        except Exception as e:  # noqa: BLE001
            raise _wrap(self.folder, "publish to", e) from e
        marker = dict(meta)
        marker["files"] = {name: {"bytes": n} for name, n in self._staged.items()}
        marker["published_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        write_json(marker_uri, marker)
        self.discard()
        return marker

    def discard(self) -> None:
        """Remove the staging folder (after publishing, or when the run gives up)."""
        fs, path = filesystem(self._staging)
        with contextlib.suppress(Exception):
            if is_remote(self._staging):
                fs.rm(path, recursive=True)
            else:
                shutil.rmtree(path, ignore_errors=True)
