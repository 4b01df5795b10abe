"""The published item prior: ``prior.parquet`` (vid, neighbours list<int32>, weights
list<float32>) beside a marker of kind ``item_prior`` (written by ``pipelines.fit_item_prior``,
read by evaluation and the Ranker replicas)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import torch

from artifacts import storage
from models.errors import InputError
from models.item_prior import ItemPrior, PriorConfig

PRIOR_FILE = "prior.parquet"


def prior_table(prior: ItemPrior) -> pa.Table:
    n_items = prior.index.shape[0]
    return pa.table(
        {
            "vid": pa.array(np.arange(n_items, dtype=np.int32)),
            "neighbours": pa.array(list(prior.index.numpy()), type=pa.list_(pa.int32())),
            "weights": pa.array(list(prior.weight.numpy()), type=pa.list_(pa.float32())),
        }
    )


def read_prior(uri: str, n_items: int | None = None) -> tuple[ItemPrior, dict]:
    """A published prior and its marker; ``n_items`` (the ranker's catalog) must match."""
    uri = storage.absolute(uri)
    marker = storage.read_marker(uri)
    if marker.get("kind") != "item_prior":
        raise InputError(f"{uri} is not an item prior (fit_item_prior publishes one)")
    if n_items is not None and int(marker["n_items"]) != n_items:
        raise InputError(f"{uri} was fitted on {marker['n_items']} items, not {n_items}")
    t = storage.read_table(uri, PRIOR_FILE, marker=marker)
    index = torch.as_tensor(np.stack(t["neighbours"].to_numpy(zero_copy_only=False)))
    weight = torch.as_tensor(np.stack(t["weights"].to_numpy(zero_copy_only=False)))
    # a prior published before "next" fits existed is an "ease" one
    cfg = PriorConfig(**({"kind": "ease"} | marker["config"]))
    return ItemPrior(index, weight, cfg), marker
