"""Typed settings of the Serve application; ``infra/serve_config.yaml`` sets the same fields.

Every field has a default sized for one machine; ``from_args`` takes the ``args`` of a Serve
config (or ``serve run services.app:build_app key=value ...``) and rejects unknown keys and
bad values with a message naming the field.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


class SettingsError(ValueError):
    pass


@dataclass(frozen=True)
class ServeSettings:
    manifest_uri: str  # a published user_states folder (build_user_states): the ONE input
    # where the store keeps its write-ahead log and snapshots; default <out>/serving/<run>
    store_uri: str | None = None
    shards: int = 2  # UserStateStore shards; a user lives in shard user_id % shards
    snapshot_every: int = 1000  # events per shard between snapshots (the log is then cut)
    max_candidates: int = 2048  # per /v1/rank request
    max_k: int = 1000
    max_body_bytes: int = 1 << 20
    # ranker replicas: stateless, autoscaled on ongoing requests
    ranker_min_replicas: int = 1
    ranker_max_replicas: int = 2
    ranker_target_ongoing_requests: float = 16.0
    ranker_max_ongoing_requests: int = 64
    ranker_num_cpus: float = 0.5
    ranker_num_gpus: float = 0.0  # 1 in production: model, item table and pools on the GPU
    batch_max_size: int = 16  # requests scored in one forward pass
    batch_wait_timeout_s: float = 0.005
    torch_threads: int = 1
    ingress_num_cpus: float = 0.25
    store_num_cpus: float = 0.25
    # the ingress and the stores only wait on others: let them hold many requests, or Serve's
    # router backs off at their limit and throughput collapses under load
    ingress_max_ongoing_requests: int = 512
    store_max_ongoing_requests: int = 256
    # the item-to-item prior (fit_item_prior) fused into every ranking: score = ranker +
    # item_prior_weight x prior; the weight is evaluate --item-prior's pick for this ranker
    item_prior_uri: str | None = None
    item_prior_weight: float = 0.0

    def __post_init__(self) -> None:
        positive = (
            "shards",
            "snapshot_every",
            "max_candidates",
            "max_k",
            "max_body_bytes",
            "ranker_min_replicas",
            "ranker_max_replicas",
            "ranker_max_ongoing_requests",
            "batch_max_size",
            "torch_threads",
            "ingress_max_ongoing_requests",
            "store_max_ongoing_requests",
        )
        for name in positive:
            if getattr(self, name) <= 0:
                raise SettingsError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.ranker_min_replicas > self.ranker_max_replicas:
            raise SettingsError("ranker_min_replicas must be <= ranker_max_replicas")
        if not self.manifest_uri:
            raise SettingsError("manifest_uri is required: a build_user_states output folder")
        if self.item_prior_uri and self.item_prior_weight <= 0:
            raise SettingsError(
                "item_prior_uri needs item_prior_weight > 0: the weight evaluate --item-prior "
                "picked for this ranker (its metrics.json, ranker_prior.fusion.weight)"
            )
        if self.item_prior_weight and not self.item_prior_uri:
            raise SettingsError("item_prior_weight is set but item_prior_uri is not")

    def resolved_store_uri(self) -> str:
        if self.store_uri:
            return self.store_uri
        from artifacts import storage

        root, run = storage.root_of(self.manifest_uri).rstrip("/").rsplit("/", 1)
        parent = root.rsplit("/", 1)[0] if root.rstrip("/").endswith("user_states") else root
        return f"{parent}/serving/{run}"

    def pinned(self) -> ServeSettings:
        """These settings with the published inputs resolved to their current versions, so
        that every replica (a restarted one too) serves the same versions while newer ones are
        published."""
        from artifacts import storage

        prior = self.item_prior_uri
        return dataclasses.replace(
            self,
            manifest_uri=storage.resolve(self.manifest_uri),
            item_prior_uri=storage.resolve(prior) if prior else None,
        )

    @classmethod
    def from_args(cls, args: dict[str, Any]) -> ServeSettings:
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(args) - set(fields))
        if unknown:
            raise SettingsError(f"unknown setting(s): {', '.join(unknown)}")
        values = {}
        for name, value in args.items():
            kind = type(fields[name].default) if name != "manifest_uri" else str
            if name in ("store_uri", "item_prior_uri"):
                kind = str
            if kind is bool and isinstance(value, str):
                value = {"true": True, "false": False}.get(value.lower(), value)
                if isinstance(value, str):
                    raise SettingsError(f"{name}: {value!r} is not true or false")
            try:
                values[name] = kind(value) if value is not None else None
            except (TypeError, ValueError) as e:
                raise SettingsError(f"{name}: {value!r} is not a {kind.__name__}") from e
        from artifacts import storage

        # replicas do not share the caller's working directory: pin relative paths now
        for name in ("manifest_uri", "store_uri", "item_prior_uri"):
            if values.get(name):
                values[name] = storage.absolute(values[name])
        return cls(**values)
