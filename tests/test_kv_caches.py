"""The compressed caches besides CollectiveKV's pools: the low-rank (MLA-style) and int8
baselines (benchmarks/), plugged into the ranker, and which parameters a cache-only fine-tune
(`train_kv_pool --tune kv`) trains."""

from __future__ import annotations

import torch

from benchmarks.kv_sweep import quantize_int8
from benchmarks.low_rank import attach
from tests.test_ranker import ATOL, CKV_MODES, assert_close, candidates, ragged_history, tiny_ranker


def test_low_rank_kv_baseline_scores_like_its_reference_and_starts_from_pca():
    model = attach(tiny_ranker(), rank=4)
    h, c = ragged_history(), candidates()
    plain = tiny_ranker().score(tiny_ranker().prefill(h), c)
    cached = model.score(model.prefill(h), c)
    assert_close(cached, model.score_reference(h, c), atol=ATOL, rtol=0)
    assert not torch.allclose(cached, plain)  # the cache's K and V are the latent's
    x = torch.randn(400, 32)
    att = model.layers[0].self_attn
    assert 0 < att.kv_map.init_from(att.k_proj, att.v_proj, x) < 1
    # at the full rank of the joint K/V (d_model 32) the PCA start reconstructs it exactly
    att = attach(tiny_ranker(), rank=32).layers[0].self_attn
    assert att.kv_map.init_from(att.k_proj, att.v_proj, x) < 1e-6


def test_compressed_kv_parameters_are_the_caches_own():
    """What `train_kv_pool --tune kv` trains: the cache's routers, pools and user projections
    (or the low-rank maps), per layer; nothing of an uncompressed ranker."""
    assert tiny_ranker().compressed_kv_parameters() == []
    ckv = tiny_ranker(CKV_MODES["collective_kv"]).compressed_kv_parameters()
    per_side = ("router_{}.weight", "router_{}.bias", "pool_{}", "user_{}.weight")
    assert sorted(ckv) == sorted(
        f"layers.{i}.self_attn.ckv.{name.format(kv)}"
        for i in range(2)
        for kv in "kv"
        for name in per_side
    )
    # a half that is not shared is the layer's own projection: not the cache's to train
    assert not any(
        "_v" in n for n in tiny_ranker(CKV_MODES["k_shared_only"]).compressed_kv_parameters()
    )
    low = attach(tiny_ranker(), rank=4).compressed_kv_parameters()
    assert sorted(low) == sorted(
        f"layers.{i}.self_attn.kv_map.{m}.weight"
        for i in range(2)
        for m in ("kv_down", "k_up", "v_up")
    )


def test_int8_kv_baseline_bytes_and_error():
    model = tiny_ranker()
    h, c = ragged_history(), candidates()
    cache = model.prefill(h)
    q, nbytes = quantize_int8(cache)
    tokens = int(cache.lengths.sum())  # BOS included
    assert nbytes == tokens * 2 * 2 * 2 * (8 + 2)  # layers * (K, V) * heads * (int8s + scale)
    for a, b in zip(cache.k + cache.v, q.k + q.v, strict=True):
        step = a.abs().amax(-1, keepdim=True) / 127
        assert ((a - b).abs() <= step * 0.5 + 1e-3 * step).all()  # half a step, scale in fp16
    assert_close(model.score(q, c), model.score(cache, c), atol=0.05, rtol=0.05)
