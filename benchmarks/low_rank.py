"""The low-rank (MLA-style) KV cache, the baseline CollectiveKV is compared with at equal bytes.

Each cached token keeps an R-number fp16 latent per layer (rounded as a stored state would be)
from which its K and V are up-projected; at R = 2 + 2 d_u it stores as many bytes as
CollectiveKV with d_u user numbers. It plugs into the ranker's ``kv_map`` (``attach``), starts
from the best rank-R map of the trained layer's joint K/V on sample hidden states (PCA,
``LowRankKV.init_from``) and is fine-tuned by the ranker's own training job (``fit``), so it
gets the same steps as the pools: collect, initialise, fine-tune with the same options.
"""

from __future__ import annotations

import io
import time

import torch
from torch import nn

from models.collective_kv import round_to_state

ATTACH = "benchmarks.low_rank:attach"
INIT_TOKENS = 50_000  # what the PCA is fitted to by default


class LowRankKV(nn.Module):
    """One layer's cached K and V from an R-number latent of each token's hidden state."""

    def __init__(self, d_model: int, kv_width: int, rank: int) -> None:
        super().__init__()
        self.kv_down = nn.Linear(d_model, rank, bias=False)
        self.k_up = nn.Linear(rank, kv_width, bias=False)
        self.v_up = nn.Linear(rank, kv_width, bias=False)

    def forward(self, hn: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        latent = round_to_state(self.kv_down(hn))  # what a cache would store, fp16
        return self.k_up(latent), self.v_up(latent)

    @torch.no_grad()
    def init_from(self, k_proj: nn.Linear, v_proj: nn.Linear, x: torch.Tensor) -> float:
        """Start as the best rank-R map onto the trained projections' joint K/V of sample
        hidden states ``x`` (N, d_model): PCA of [k_proj x, v_proj x]. Returns the relative
        squared error of that reconstruction."""
        w = torch.cat([k_proj.weight, v_proj.weight]).float()  # (2 width, d)
        y = x.float() @ w.T
        rank, width = self.kv_down.out_features, k_proj.out_features
        basis = torch.linalg.svd(y, full_matrices=False).Vh[:rank]  # (r, 2 width)
        self.kv_down.weight.copy_(basis @ w)
        self.k_up.weight.copy_(basis[:, :width].T)
        self.v_up.weight.copy_(basis[:, width:].T)
        err = y - (y @ basis.T) @ basis
        return float((err**2).sum() / (y**2).sum().clamp(min=1e-12))


def attach(model, rank: int):
    """Give every layer of ``model`` (a ``Ranker``) a rank-``rank`` latent cache."""
    cfg = model.cfg
    for layer in model.layers:
        layer.self_attn.kv_map = LowRankKV(cfg.d_model, cfg.kv_width, rank)
    return model


def ratio(rank: int, kv_width: int) -> float:
    """Stored bytes against the fp16 K and V: an fp16 latent of ``rank`` numbers a layer."""
    return rank / (2 * kv_width)


def load(checkpoint: str):
    """A published low-rank ranker (``fit``'s output): (model, marker)."""
    from artifacts import storage
    from models.config import RankerConfig
    from models.ranker import Ranker

    marker = storage.read_marker(checkpoint)
    rc = RankerConfig.from_json(storage.read_file(checkpoint, "ranker.json", marker).decode())
    model = attach(Ranker(rc, n_items=int(marker["n_items"])), **marker["prepare"][1])
    state = storage.read_file(checkpoint, "model.pt", marker)
    model.load_state_dict(torch.load(io.BytesIO(state), map_location="cpu", weights_only=True))
    return model.eval(), marker


def fit(
    dataset_uri: str, checkpoint: str, out: str, *, run: str, rank: int, tc, init_tokens: int = 0
) -> dict:
    """Collect the trained ranker's hidden states, start each layer's latent map by PCA, and
    fine-tune it like the pools (``train_kv_pool``'s steps and training options). Returns the
    training summary with the ratio and the fit's figures."""
    from artifacts import storage
    from artifacts.data import load_checkpoint
    from models.ranker import Ranker
    from pipelines.common.kv_inputs import collect_kv_inputs
    from pipelines.common.ranker_training import train

    t0 = time.perf_counter()
    dataset_uri, checkpoint = storage.pinned(dataset_uri), storage.pinned(checkpoint)
    base, marker = load_checkpoint(checkpoint)
    model = attach(Ranker(base.cfg, n_items=int(marker["n_items"])), rank)
    missing, unexpected = model.load_state_dict(base.state_dict(), strict=False)
    if unexpected or set(missing) != set(model.compressed_kv_parameters()):
        raise ValueError(f"{checkpoint} is not an uncompressed ranker: {unexpected or missing}")
    xs, user = collect_kv_inputs(
        checkpoint,
        dataset_uri,
        users=0,
        max_tokens=init_tokens or INIT_TOKENS,
        vectors_uri=marker.get("vectors_uri"),
        seed=tc.seed,
    )
    stats = {
        f"layer{i}_kv_rel_error": round(
            layer.self_attn.kv_map.init_from(
                layer.self_attn.k_proj, layer.self_attn.v_proj, torch.from_numpy(x)
            ),
            4,
        )
        for i, (layer, x) in enumerate(zip(model.layers, xs, strict=True))
    }
    summary = train(
        dataset_uri,
        marker.get("vectors_uri"),
        out,
        run,
        base.cfg,
        tc,
        init_state=model.state_dict(),
        base_uri=checkpoint,
        extra_meta={"base_checkpoint": checkpoint, "kv_rank": rank, **stats},
        prepare=(ATTACH, {"rank": rank}),
    )
    return summary | {
        "kv_rank": rank,
        "ratio": round(ratio(rank, base.cfg.kv_width), 5),
        "init_tokens": len(user),
        **stats,
        "seconds": round(time.perf_counter() - t0, 1),
    }
