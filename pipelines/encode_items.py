"""Encode the item catalog into one vector per item, with Ray Data, re-encoding only what changed.

    python -m pipelines.encode_items --dataset-uri out/datasets/ml-latest-small --out out \\
        [--encoder DIR] [--full] [--actors 2] [--batch-size 64] [--engine hf|vllm]

Reads ``items.parquet`` and writes ``<out>/item_vectors/<dataset>/<encoder_tag>/``:

- ``vectors.parquet``: item_id, vid, content_hash, vector (fixed_size_list<float16>);
- ``errors.parquet``: item_id, vid, reason - items that could not be encoded (text empty after
  cleaning, or longer than ``--max-chars``); they are skipped, listed, and never fatal;
- ``_SUCCESS.json``: encoder config, dim, counts and the dataset it came from.

Incremental by default: an item whose (item_id, content_hash) already has a vector in the
published folder keeps it (its vid is refreshed from the current catalog); new and changed items
are encoded; items gone from the catalog are dropped. ``--full`` re-encodes everything. Texts
longer than the encoder's ``max_length`` tokens are truncated and counted.

The encoding runs as a Ray Data ``map_batches`` over an actor pool of ``ItemEncoder``s: each
actor loads the model once; on a cluster with GPUs each actor takes one GPU, otherwise a
fraction of a CPU (``--cpus-per-actor``) so a pool fits on a small machine. With ``--engine
vllm`` the actors are vLLM engines instead (``ray.data.llm``'s embedding task, one GPU or one
CPU each; ``pipelines.common.vllm_engine``), which is how a decoder-LLM encoder runs on a GPU
cluster; their vectors go to their own folder (``<name>-vllm-<hash>``).
"""

from __future__ import annotations

import logging
import re
import sys
import time

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from artifacts import storage
from artifacts.data import blocks, encoder_tag, vectors_uri
from models.config import EncoderConfig
from models.errors import InputError
from pipelines.common import cli, jobs

log = logging.getLogger("kvrank.encode_items")

CONTROL = re.compile(r"[\x00-\x1f\x7f]+")


def clean_text(text: str | None) -> str:
    return CONTROL.sub(" ", text or "").strip()


class EncoderActor:
    """Ray Data callable class: one ItemEncoder per actor, applied to batches of items."""

    def __init__(self, cfg_json: str, threads: int) -> None:
        import torch

        from models.encoder import ItemEncoder

        torch.set_num_threads(max(1, threads))
        self.encoder = ItemEncoder(EncoderConfig.from_json(cfg_json))
        if torch.cuda.is_available():
            self.encoder.cuda()

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        texts = [str(t) for t in batch["text"]]
        tok = self.encoder.tokenize(texts)
        import torch

        with torch.no_grad():
            vecs = self.encoder(tok).float().cpu().numpy().astype(np.float16)
        return {
            "item_id": batch["item_id"],
            "vid": batch["vid"],
            "content_hash": batch["content_hash"],
            "vector": vecs,
            "truncated": tok.truncated.numpy(),
        }


def previous_vectors(target: str) -> pa.Table | None:
    """The published vectors of this encoder, if a complete earlier run exists."""
    try:
        return storage.read_table(target, "vectors.parquet")
    except storage.IncompleteError:
        return None


def _keys(t: pa.Table) -> pa.ChunkedArray:
    """'item_id/content_hash' per row: the identity of an encoded text."""
    return pc.binary_join_element_wise(
        pc.cast(t["item_id"], pa.string()), pc.cast(t["content_hash"], pa.string()), "/"
    )


def plan(items: pa.Table, previous: pa.Table | None, max_chars: int):
    """Split the catalog into (to_encode, reused, errors, dropped count): every text that cleans
    to 1..``max_chars`` characters is encoded unless ``previous`` (the stored vectors; None for
    ``--full``) holds its item with the same content hash, whose vector is then reused."""
    texts = [clean_text(t) for t in items.column("text").to_pylist()]
    lengths = np.array([len(t) for t in texts])
    reasons = np.where(
        lengths == 0,
        "empty text after cleaning",
        np.where(lengths > max_chars, f"text longer than {max_chars} characters", ""),
    )
    bad = reasons != ""
    errors = pa.table(
        {
            "item_id": items.column("item_id").filter(pa.array(bad)),
            "vid": items.column("vid").filter(pa.array(bad)),
            "reason": pa.array(reasons[bad].tolist(), pa.string()),
        }
    )
    good = items.filter(pa.array(~bad)).set_column(
        items.schema.get_field_index("text"),
        "text",
        pa.array(np.array(texts, dtype=object)[~bad], pa.string()),
    )
    if previous is None:
        return good.select(["item_id", "vid", "content_hash", "text"]), None, errors, 0
    key_prev, key_now = _keys(previous), _keys(good)
    have = pc.is_in(key_now, value_set=key_prev)
    to_encode = good.filter(pc.invert(have)).select(["item_id", "vid", "content_hash", "text"])
    keep = good.filter(have).select(["item_id", "vid", "content_hash"])
    # reuse the stored vector, with the vid of the current catalog
    rows = pc.index_in(_keys(keep), value_set=key_prev)
    reused = keep.append_column("vector", previous["vector"].take(rows))
    gone = pc.invert(pc.is_in(previous["item_id"], value_set=items["item_id"]))
    dropped = int(pc.sum(gone).as_py() or 0)
    return to_encode, reused, errors, dropped


def encode_items(
    dataset_uri: str,
    out: str,
    cfg: EncoderConfig,
    *,
    full: bool = False,
    actors: int = 2,
    cpus_per_actor: float = 0.5,
    max_chars: int = 20_000,
    engine: str = "hf",
) -> dict:
    import ray

    from pipelines.common import vllm_engine
    from pipelines.common.ranker_actors import pool_size
    from pipelines.common.ray_runtime import cluster_gpus, init_ray

    t0 = time.perf_counter()
    vllm_engine.check_engine(engine)
    dataset_uri = storage.pinned(dataset_uri)
    marker = storage.read_marker(dataset_uri)
    if marker.get("kind") != "dataset":
        raise InputError(f"{dataset_uri} is not a prepared dataset")
    tag = encoder_tag(cfg, engine)
    target = vectors_uri(out, marker["name"], tag)
    items = storage.read_table(
        dataset_uri, "items.parquet", columns=["item_id", "vid", "text", "content_hash"]
    )
    previous = None if full else previous_vectors(target)
    to_encode, reused, errors, dropped = plan(items, previous, max_chars)
    log.info(
        "catalog %d items: %d to encode, %d reused, %d dropped, %d errors",
        items.num_rows,
        to_encode.num_rows,
        0 if reused is None else reused.num_rows,
        dropped,
        errors.num_rows,
    )
    encoded = None
    truncated = 0
    enc_seconds = 0.0
    if to_encode.num_rows:
        # similar lengths in one batch waste less compute on padding
        order = pc.sort_indices(pc.utf8_length(to_encode["text"]))
        to_encode = to_encode.take(order)
        init_ray()
        gpus = cluster_gpus()
        # an incremental run's few changed texts take one encoder, not a pool of idle ones
        actors = pool_size(to_encode.num_rows, cfg.batch_size, actors)
        t_enc = time.perf_counter()
        ds = ray.data.from_arrow(
            blocks(to_encode, max(1, min(actors * 4, to_encode.num_rows // cfg.batch_size + 1)))
        )
        if engine == "vllm":
            res = vllm_engine.embed_items(ds, cfg, actors=actors, gpus=gpus)
        else:
            res = ds.map_batches(
                EncoderActor,
                fn_constructor_args=(
                    cfg.to_json(),
                    1 if gpus else max(1, int(round(cpus_per_actor * 2))),
                ),
                compute=ray.data.ActorPoolStrategy(size=actors),
                batch_size=cfg.batch_size,
                batch_format="numpy",
                num_gpus=1 if gpus else 0,
                num_cpus=None if gpus else cpus_per_actor,
            )
        encoded = pa.concat_tables(ray.get(res.to_arrow_refs()))
        enc_seconds = time.perf_counter() - t_enc
        truncated = int(pc.sum(encoded["truncated"]).as_py() or 0)
        encoded = encoded.drop(["truncated"])
    dim = None
    parts = []
    for part in (reused, encoded):
        if part is not None and part.num_rows:
            vec = part.column("vector")
            dim = dim or _vector_dim(vec)
            parts.append(
                pa.table(
                    {
                        "item_id": part["item_id"].cast(pa.int64()),
                        "vid": part["vid"].cast(pa.int32()),
                        "content_hash": part["content_hash"].cast(pa.string()),
                        "vector": _as_fixed_f16(vec, dim),
                    }
                )
            )
    if not parts:
        raise InputError(f"{dataset_uri}: no item could be encoded ({errors.num_rows} errors)")
    vectors = pa.concat_tables(parts).sort_by("vid")
    pub = storage.Publication(target)
    try:
        pub.put_table("vectors.parquet", vectors)
        pub.put_table("errors.parquet", errors)
        summary = {
            "job": "encode_items",
            "engine": engine,
            "encoder_tag": tag,
            "items": items.num_rows,
            "encoded": to_encode.num_rows,
            "reused": 0 if reused is None else reused.num_rows,
            "dropped": dropped,
            "errors": errors.num_rows,
            "truncated": truncated,
            "dim": dim,
            "encode_seconds": round(enc_seconds, 2),
            "items_per_second": round(to_encode.num_rows / enc_seconds, 1) if enc_seconds else None,
            "out": target,
        }
        pub.publish(
            {
                "kind": "item_vectors",
                "dataset_uri": dataset_uri,
                "encoder": cfg.to_dict(),
                "engine": engine,
                **{
                    k: summary[k]
                    for k in (
                        "encoder_tag",
                        "dim",
                        "items",
                        "encoded",
                        "reused",
                        "dropped",
                        "errors",
                        "truncated",
                    )
                },
                "vectors": vectors.num_rows,
            }
        )
    except BaseException:
        pub.discard()
        raise
    summary["seconds"] = round(time.perf_counter() - t0, 2)
    return summary


def _vector_dim(col: pa.ChunkedArray) -> int:
    t = col.type
    if isinstance(t, pa.ExtensionType):  # Ray Data's tensor type
        return int(np.prod(t.shape))
    if pa.types.is_fixed_size_list(t):
        return t.list_size
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return len(col.chunk(0)[0].as_py())
    raise InputError(f"unexpected vector column type {t}")


def _as_fixed_f16(col: pa.ChunkedArray, dim: int) -> pa.Array:
    """Any list/tensor column of vectors -> fixed_size_list<float16>[dim]."""
    arr = col.combine_chunks()
    if isinstance(arr.type, pa.ExtensionType):
        arr = arr.storage
    values = arr.flatten().to_numpy(zero_copy_only=False).astype(np.float16)
    return pa.FixedSizeListArray.from_arrays(pa.array(values, pa.float16()), dim)


def main(argv: list[str] | None = None) -> int:
    p = cli.job_parser("encode_items", __doc__)
    p.add_argument(
        "--dataset-uri", required=True, help="a prepared dataset folder (local or s3://)"
    )
    p.add_argument(
        "--out",
        required=True,
        help="output root; vectors go to <out>/item_vectors/<dataset>/<tag>/",
    )
    p.add_argument(
        "--encoder", default=None, help="a local Hugging Face model directory (default: MiniLM)"
    )
    p.add_argument("--full", action="store_true", help="re-encode every item")
    p.add_argument(
        "--actors",
        type=int,
        default=2,
        help="encoder actors (Ray Data map_batches; never more than there are batches)",
    )
    p.add_argument(
        "--cpus-per-actor", type=float, default=0.5, help="CPUs reserved per encoder actor"
    )
    p.add_argument(
        "--batch-size", type=int, default=EncoderConfig.batch_size, help="texts per forward pass"
    )
    p.add_argument(
        "--max-length", type=int, default=EncoderConfig.max_length, help="tokens per text"
    )
    p.add_argument(
        "--max-chars", type=int, default=20_000, help="longer texts are skipped as errors"
    )
    p.add_argument(
        "--engine",
        default="hf",
        help="hf (PyTorch actors) or vllm (ray.data.llm's embedding task)",
    )
    a = cli.parse(p, argv)

    def job() -> dict:
        cfg = EncoderConfig(model_dir=a.encoder, batch_size=a.batch_size, max_length=a.max_length)
        return encode_items(
            a.dataset_uri,
            a.out,
            cfg,
            full=a.full,
            actors=a.actors,
            cpus_per_actor=a.cpus_per_actor,
            max_chars=a.max_chars,
            engine=a.engine,
        )

    return jobs.run(job)


if __name__ == "__main__":
    sys.exit(main())
