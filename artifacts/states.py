"""Compressed user states (CollectiveKV) as Arrow rows: the format build_user_states writes,
evaluate reads and the serving store keeps.

One row per user:

    user_id    int64
    hist       list<int32>   the history as vids (item ids via the dataset's items table)
    hist_fb    list<int8>    feedback class per history item (-1 unknown)
    length     int32         cached tokens = 1 (BOS) + len(hist)
    l<i>_idx_k binary        layer i: K pool index per cached token (uint16/int32, little endian)
    l<i>_idx_v binary        layer i: V pool index per cached token
    l<i>_u_k   binary        layer i: user part of K, float16 [length, d_u]
    l<i>_u_v   binary        layer i: user part of V, float16 [length, d_u]

With sharing off for K (or V) the ``idx_k`` column is absent and ``u_k`` holds the whole key,
float16 [length, kv_width]; ``Layout`` says which columns a model's states have.
The serving store keeps each row as ONE packed value (``pack`` / ``unpack``): a 9-byte header
(format, history items, cached tokens), the history's vids (int32) and feedback (int8), then the
per-layer buffers in ``Layout.columns()`` order, their sizes fixed by the layout and the length.

The state bytes are exactly the binary columns, so a folder's size in state is the closed form
``tokens * state_bytes_per_token``. Raw little-endian buffers keep the round trip exact (the
fp16 user parts are stored bit for bit) and decode with one ``np.frombuffer`` per field.

No Ray here: the jobs and the Serve deployments both use these functions.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from artifacts import storage
from models.collective_kv import STATE_DTYPE, LayerState
from models.config import CollectiveKVConfig, RankerConfig
from models.errors import InputError
from models.inputs import CompressedCache

FIELDS = ("idx_k", "idx_v", "u_k", "u_v")


@dataclass(frozen=True)
class Layout:
    """Which per-layer columns a model's states have, and their dtype and values per token."""

    n_layers: int
    kv_width: int
    ckv: CollectiveKVConfig

    @classmethod
    def of(cls, rc: RankerConfig) -> Layout:
        if rc.collective_kv is None:
            raise ValueError("a ranker without CollectiveKV pools has no compressed state")
        return cls(rc.n_layers, rc.kv_width, rc.collective_kv)

    @classmethod
    def from_manifest(cls, manifest: dict) -> Layout:
        """The layout a user_states manifest records (states built before the sharing option
        have both K and V shared)."""
        share = manifest.get("share", "kv")
        ckv = CollectiveKVConfig(
            pool_size=int(manifest["pool_size"]),
            user_dim=int(manifest["user_dim"]),
            **CollectiveKVConfig.share_flags(share),
        )
        return cls(int(manifest["n_layers"]), int(manifest["kv_width"]), ckv)

    @property
    def fields(self) -> tuple[str, ...]:
        shared = {"k": self.ckv.share_k, "v": self.ckv.share_v}
        return tuple(f for f in FIELDS if not f.startswith("idx") or shared[f[-1]])

    @property
    def index_dtype(self) -> torch.dtype:
        return torch.uint16 if self.ckv.index_bytes == 2 else torch.int32

    def per_token(self, field: str) -> int:
        """Values per cached token in ``field``: 1 index, d_u user numbers, or the whole width."""
        if field.startswith("idx"):
            return 1
        shared = self.ckv.share_k if field == "u_k" else self.ckv.share_v
        return self.ckv.user_dim if shared else self.kv_width

    def columns(self) -> list[str]:
        return [column(i, f) for i in range(self.n_layers) for f in self.fields]


def column(layer: int, field: str) -> str:
    return f"l{layer}_{field}"


def is_state_column(name: str) -> bool:
    """True for the per-layer buffers (l<i>_idx_k, ...), false for ids, history and length."""
    return name[:1] == "l" and name[1:2].isdigit()


def row_nbytes(row: dict) -> int:
    """Bytes of compressed KV in one user's row."""
    return sum(len(v) for c, v in row.items() if is_state_column(c))


def schema(layout: Layout) -> pa.Schema:
    cols = [
        pa.field("user_id", pa.int64()),
        pa.field("hist", pa.list_(pa.int32())),
        pa.field("hist_fb", pa.list_(pa.int8())),
        pa.field("length", pa.int32()),
    ]
    cols += [pa.field(c, pa.binary()) for c in layout.columns()]
    return pa.schema(cols)


def _np_dtype(t: torch.dtype) -> np.dtype:
    return {torch.uint16: np.dtype("<u2"), torch.int32: np.dtype("<i4")}[t]


def to_table(
    cache: CompressedCache,
    user_ids: list[int],
    hist: list[np.ndarray],
    hist_fb: list[np.ndarray],
    layout: Layout,
) -> pa.Table:
    """A batch's compressed cache (B users, right-padded) -> B rows; padding is not stored."""
    lengths = cache.lengths.cpu().numpy()
    if not (len(user_ids) == len(hist) == len(hist_fb) == len(lengths)):
        raise ValueError("user_ids, hist, hist_fb and the cache must have one entry per user")
    for h, n in zip(hist, lengths, strict=True):
        if len(h) + 1 != n:
            raise ValueError(
                f"a history of {len(h)} items needs {len(h) + 1} cached tokens, not {n}"
            )
    data: dict[str, list] = {
        "user_id": [int(u) for u in user_ids],
        "hist": [np.asarray(h, dtype=np.int32) for h in hist],
        "hist_fb": [np.asarray(f, dtype=np.int8) for f in hist_fb],
        "length": lengths.astype(np.int32),
    }
    for i, s in enumerate(cache.layers):
        for f in layout.fields:
            t = getattr(s, f).cpu()
            a = (
                t.view(torch.int16).numpy().view(_np_dtype(t.dtype))
                if t.dtype == torch.uint16
                else t.numpy()
            )
            data[column(i, f)] = [a[b, :n].tobytes() for b, n in enumerate(lengths)]
    return pa.table(data, schema=schema(layout))


def from_table(table: pa.Table | dict, layout: Layout, device=None) -> CompressedCache:
    """Rows (a table, or a dict of columns as Ray Data batches come) -> one right-padded
    CompressedCache on ``device``; padded tokens hold index 0 and zeros (never attended)."""
    if isinstance(table, pa.Table):
        table = {c: table.column(c).to_pylist() for c in table.column_names}
    lengths = np.asarray(table["length"], dtype=np.int64)
    b, width = len(lengths), int(lengths.max()) if len(lengths) else 0
    index_dtype = layout.index_dtype
    idx_np = _np_dtype(index_dtype)
    layers = []
    for i in range(layout.n_layers):
        parts = dict.fromkeys(FIELDS)
        for f in layout.fields:
            is_idx = f.startswith("idx")
            per_token = layout.per_token(f)
            dtype = idx_np if is_idx else np.dtype("<f2")
            if column(i, f) not in table:
                raise ValueError(
                    f"the states have no column {column(i, f)}: they were built by a model "
                    f"with other CollectiveKV settings (this one shares {layout.ckv.share!r})"
                )
            out = np.zeros((b, width * per_token), dtype=dtype)
            for r, (buf, n) in enumerate(zip(table[column(i, f)], lengths, strict=True)):
                v = np.frombuffer(buf, dtype=dtype)
                if v.size != n * per_token:
                    raise ValueError(
                        f"{column(i, f)} of user row {r} holds {v.size} values, expected "
                        f"{n * per_token}: the state does not match the model "
                        "(d_u, layers, sharing)"
                    )
                out[r, : v.size] = v
            if is_idx:
                t = _as_uint16(out) if index_dtype == torch.uint16 else torch.from_numpy(out)
            else:
                t = torch.from_numpy(out).view(b, width, per_token).to(STATE_DTYPE)
            parts[f] = t.to(device)
        layers.append(LayerState(**parts))
    return CompressedCache(layers, torch.from_numpy(lengths).to(device))


def _as_uint16(a: np.ndarray) -> torch.Tensor:
    """numpy uint16 -> torch.uint16 with the same bits (torch.from_numpy has no uint16)."""
    return torch.from_numpy(a.view(np.int16)).view(torch.uint16)


def state_nbytes(table: pa.Table) -> int:
    """Bytes of compressed KV in ``table`` (the binary state columns; ids and feedback aside)."""
    return sum(
        int(pc.sum(pc.binary_length(table.column(c))).as_py() or 0)
        for c in table.column_names
        if is_state_column(c)
    )


def read_manifest(uri: str) -> dict:
    """The manifest of a published user_states folder."""
    manifest = storage.read_marker(uri)
    if manifest.get("kind") != "user_states":
        raise InputError(f"{uri} is not a user_states folder (kind {manifest.get('kind')!r})")
    return manifest


def read_states(uri: str) -> tuple[dict, pa.Table]:
    """(manifest, all state rows) of a published user_states folder."""
    manifest = read_manifest(uri)
    parts = [storage.read_table(uri, f, marker=manifest) for f in manifest["state_files"]]
    return manifest, pa.concat_tables(parts)


PACK_FORMAT = 1
_HEADER = struct.Struct("<BII")  # format, history items, cached tokens


def _itemsize(layout: Layout, field: str) -> int:
    return layout.ckv.index_bytes if field.startswith("idx") else 2  # fp16 user parts


def pack(row: dict, layout: Layout) -> bytes:
    """One user's row as one value: header, vids, feedback, then every state buffer."""
    hist = np.asarray(row["hist"], dtype="<i4")
    fb = np.asarray(row["hist_fb"], dtype=np.int8)
    length = int(row["length"])
    parts = [_HEADER.pack(PACK_FORMAT, len(hist), length), hist.tobytes(), fb.tobytes()]
    for c in layout.columns():
        buf = row[c]
        field = c.split("_", 1)[1]
        if len(buf) != length * layout.per_token(field) * _itemsize(layout, field):
            raise ValueError(f"{c} holds {len(buf)} bytes, not {length} tokens of this layout")
        parts.append(buf)
    return b"".join(parts)


def unpack(user_id: int, value: bytes, layout: Layout) -> dict:
    """The row ``pack`` packed (``user_id`` is the key it was stored under)."""
    fmt, n, length = _HEADER.unpack_from(value)
    if fmt != PACK_FORMAT:
        raise ValueError(f"a packed state of format {fmt}; this code reads {PACK_FORMAT}")
    at = _HEADER.size
    hist = np.frombuffer(value, dtype="<i4", count=n, offset=at).tolist()
    at += 4 * n
    fb = np.frombuffer(value, dtype=np.int8, count=n, offset=at).tolist()
    at += n
    row = {"user_id": int(user_id), "hist": hist, "hist_fb": fb, "length": length}
    for c in layout.columns():
        field = c.split("_", 1)[1]
        size = length * layout.per_token(field) * _itemsize(layout, field)
        row[c] = value[at : at + size]
        at += size
    if at != len(value):
        raise ValueError(f"a packed state of {len(value)} bytes; its layout reads {at}")
    return row
