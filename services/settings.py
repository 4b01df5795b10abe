"""Typed settings of the Serve application; ``infra/serve_config.yaml`` sets the same fields.

Every field has a default sized for one machine; ``from_args`` takes the ``args`` of a Serve
config (or ``serve run services.app:build_app key=value ...``) and rejects unknown keys and
bad values with a message naming the field.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from models.config import option, typed_values
from models.errors import InputError


@dataclass(frozen=True)
class ServeSettings:
    manifest_uri: str = option(
        "",
        "what to serve: an evaluate report over stored states (evaluate --user-states "
        "--item-prior), which names the states, their ranker, the prior and the fusion weight it "
        "measured; or a build_user_states folder (the ranker alone, or with item_prior_*)",
    )
    store_uri: str | None = option(
        None,
        "where the store keeps the users' states and events: a local folder for the embedded "
        "engine, one database per shard (a persistent volume on a cluster; default: "
        "<out>/serving/<run> beside local states), or redis://host:port/db[?prefix=P&cluster=1] "
        "for a Redis or Valkey server or cluster",
    )
    redis_fsync: str = option(
        "always",
        "with a redis:// store: the server's append-only-file fsync, set when a shard opens - "
        "'always' (no acknowledged event lost), 'everysec' (up to a second of them on a crash), "
        "or 'server' (leave the server's own persistence settings, e.g. a managed service)",
    )
    api_tokens_file: str | None = option(
        None,
        "a file of API token hashes and their scopes (read, write, admin; services.auth), read "
        "again when it changes; none: the API is open, allowed on a loopback HTTP host only",
    )
    shards: int = option(2, "UserStateStore shards; a user lives in shard user_id % shards")
    store_cache_mib: int = option(
        64, "MiB of page cache per store shard: its memory, whatever the number of users"
    )
    state_slack_items: int = option(
        50,
        "history items a state may grow past the ranker's max_len before it is rebuilt from the "
        "newest max_len (what the ranker was trained on; a memory ceiling per user)",
    )
    max_candidates: int = option(2048, "candidates per /v1/rank request at most")
    recommend_candidates: int = option(
        500,
        "items /v1/recommend retrieves from the whole catalog by the user vector (and the "
        "prior) and then ranks with the full score; at least the catalog's size: exact",
    )
    max_k: int = option(1000, "k per request at most")
    max_body_bytes: int = option(1 << 20, "request body bytes at most")
    # ranker replicas: stateless, autoscaled on ongoing requests
    ranker_min_replicas: int = option(1, "Ranker replicas at least")
    ranker_max_replicas: int = option(2, "Ranker replicas at most")
    ranker_target_ongoing_requests: float = option(16.0, "autoscaling target per replica")
    ranker_upscale_delay_s: float = option(
        30.0, "seconds the load must stay above the target before Ranker replicas are added"
    )
    ranker_downscale_delay_s: float = option(
        600.0, "seconds the load must stay below the target before Ranker replicas are removed"
    )
    ranker_max_ongoing_requests: int = option(64, "requests a Ranker replica holds at once")
    ranker_num_cpus: float = option(0.5, "CPUs per Ranker replica")
    ranker_num_gpus: float = option(0.0, "GPUs per Ranker replica (1 in production)")
    batch_max_size: int = option(16, "requests scored in one forward pass")
    batch_wait_timeout_s: float = option(0.005, "seconds a batch waits to fill")
    torch_threads: int = option(1, "torch threads per Ranker replica")
    ingress_num_cpus: float = option(0.25, "CPUs of the ingress")
    store_num_cpus: float = option(0.25, "CPUs per store shard")
    # the ingress and the stores only wait on others: let them hold many requests, or Serve's
    # router backs off at their limit and throughput collapses under load
    ingress_max_ongoing_requests: int = option(512, "requests the ingress holds at once")
    store_max_ongoing_requests: int = option(256, "requests a store shard holds at once")
    # overload answers instead of queueing without end: past these queues a request gets 503
    # with Retry-After at once (the proxy's queue for the ingress, the ingress's for the rankers)
    ingress_max_queued_requests: int = option(
        1024, "requests queued at the proxy for the ingress beyond those it holds; then 503"
    )
    ranker_max_queued_requests: int = option(
        256, "rank requests queued at the ingress for the rankers beyond those they hold; then 503"
    )
    retry_after_s: int = option(1, "the Retry-After seconds of an overload answer (503)")
    health_check_period_s: float = option(
        2.0,
        "seconds between Serve's health checks of each replica: a replica whose process died is "
        "noticed (and replaced) within this (Serve's own default is 10)",
    )
    item_vectors_poll_s: float = option(
        60.0,
        "seconds between a Ranker replica's checks for a newer version of the item vectors its "
        "states were built with (encode_items re-encoding changed texts): it is scored from at "
        "once, without a restart; 0: serve the states' version only",
    )
    item_prior_uri: str | None = option(
        None,
        "with a user_states manifest: an item prior (fit_item_prior) fused into every ranking, "
        "ranker + weight x prior (a report manifest names its own)",
    )
    item_prior_weight: float = option(
        0.0, "with item_prior_uri: the fusion weight, evaluate --item-prior's pick"
    )

    def __post_init__(self) -> None:
        positive = (
            "shards",
            "store_cache_mib",
            "max_candidates",
            "recommend_candidates",
            "max_k",
            "max_body_bytes",
            "ranker_min_replicas",
            "ranker_max_replicas",
            "ranker_max_ongoing_requests",
            "batch_max_size",
            "torch_threads",
            "ingress_max_ongoing_requests",
            "store_max_ongoing_requests",
            "ingress_max_queued_requests",
            "ranker_max_queued_requests",
            "retry_after_s",
            "health_check_period_s",
        )
        for name in positive:
            if getattr(self, name) <= 0:
                raise InputError(f"{name} must be > 0, got {getattr(self, name)}")
        if min(self.ranker_upscale_delay_s, self.ranker_downscale_delay_s) < 0:
            raise InputError("ranker_upscale_delay_s and ranker_downscale_delay_s must be >= 0")
        if self.item_vectors_poll_s < 0:
            raise InputError(f"item_vectors_poll_s must be >= 0, got {self.item_vectors_poll_s}")
        if self.state_slack_items < 0:
            raise InputError(f"state_slack_items must be >= 0, got {self.state_slack_items}")
        from artifacts.redis_store import FSYNC

        if self.redis_fsync not in FSYNC:
            raise InputError(f"redis_fsync must be one of {FSYNC}, got {self.redis_fsync!r}")
        if self.ranker_min_replicas > self.ranker_max_replicas:
            raise InputError("ranker_min_replicas must be <= ranker_max_replicas")
        if not self.manifest_uri:
            raise InputError("manifest_uri is required: a build_user_states output folder")
        if self.item_prior_uri and self.item_prior_weight <= 0:
            raise InputError(
                "item_prior_uri needs item_prior_weight > 0: the weight evaluate --item-prior "
                "picked for this ranker (its metrics.json, ranker_prior.fusion.weight)"
            )
        if self.item_prior_weight and not self.item_prior_uri:
            raise InputError("item_prior_weight is set but item_prior_uri is not")

    def resolved_store_uri(self) -> str:
        from artifacts.state_store import check_store_uri

        uri = self.store_uri or _store_of(self.manifest_uri)
        try:
            check_store_uri(uri)
        except InputError as e:
            if self.store_uri:
                raise
            raise InputError(
                f"{e} - the default beside the states at {self.manifest_uri}; set store_uri"
            ) from e
        return uri

    def pinned(self) -> ServeSettings:
        """These settings with the published inputs resolved to their current versions, so
        that every replica (a restarted one too) serves the same versions while newer ones are
        published. A report manifest becomes the states, prior and weight it names."""
        from artifacts import storage

        marker = storage.read_marker(self.manifest_uri)
        if marker.get("kind") == "report":
            return self._measured(marker)
        prior = self.item_prior_uri
        return dataclasses.replace(
            self,
            manifest_uri=storage.resolve(self.manifest_uri),
            item_prior_uri=storage.resolve(prior) if prior else None,
        )

    def _measured(self, report: dict) -> ServeSettings:
        """The settings that serve what the evaluate ``report`` measured: its stored states,
        and the prior at the weight it picked."""
        if not report.get("user_states"):
            raise InputError(
                f"{report['uri']} evaluated a checkpoint, not stored states: serve the report of "
                "evaluate --user-states, or the build_user_states folder"
            )
        if self.item_prior_uri or self.item_prior_weight:
            raise InputError(
                "item_prior_uri / item_prior_weight are set, but the report manifest names the "
                "prior and the weight it measured: give one or the other"
            )
        prior, weight = report.get("item_prior"), float(report.get("fusion_weight") or 0.0)
        return dataclasses.replace(
            self,
            manifest_uri=report["user_states"],  # a version folder: pinned when evaluated
            store_uri=self.store_uri or _store_of(report["user_states"]),
            item_prior_uri=prior if prior and weight > 0 else None,
            item_prior_weight=weight if prior else 0.0,
        )

    @classmethod
    def from_args(cls, args: dict[str, Any]) -> ServeSettings:
        """The settings from a Serve config's ``args`` (or ``serve run ... key=value``: text),
        converted to the fields' types; relative paths pinned to absolute ones, since replicas
        do not share the caller's working directory."""
        from artifacts import storage

        values = typed_values(cls, args)
        for name in ("manifest_uri", "store_uri", "item_prior_uri"):
            if values.get(name):
                values[name] = storage.absolute(values[name])
        return cls(**values)


def _store_of(states_uri: str) -> str:
    """The store's default folder for a user_states folder: <out>/serving/<run>."""
    from artifacts import storage

    root, run = storage.root_of(states_uri).rstrip("/").rsplit("/", 1)
    parent = root.rsplit("/", 1)[0] if root.rstrip("/").endswith("user_states") else root
    return f"{parent}/serving/{run}"
