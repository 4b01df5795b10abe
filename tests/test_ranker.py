"""Invariants of the ranker: multi-item scoring, incremental extension, CollectiveKV, HF naming."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close
from torch.utils._python_dispatch import TorchDispatchMode

from models.collective_kv import compression_ratio, full_kv_bytes, state_bytes_per_token
from models.config import CollectiveKVConfig, RankerConfig
from models.errors import InputError
from models.hf_llama import export_llama, import_llama, llama_config
from models.ranker import (
    CompressedCache,
    Event,
    History,
    KVCache,
    Ranker,
    ranking_loss,
)

N_ITEMS = 60
ATOL = 1e-5

CKV_MODES = {
    "plain": None,
    "collective_kv": CollectiveKVConfig(pool_size=32, user_dim=2),
    # the sharing ablation: the other half is the plain projection, stored whole
    "k_shared_only": CollectiveKVConfig(pool_size=32, user_dim=2, share_v=False),
    "v_shared_only": CollectiveKVConfig(pool_size=32, user_dim=2, share_k=False),
}
COMPRESSED = [m for m in CKV_MODES if m != "plain"]


def tiny_config(ckv: CollectiveKVConfig | None = None, **kw) -> RankerConfig:
    base = dict(
        item_dim=16,
        d_model=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        head_dim=8,
        ffn_dim=64,
        feedback_classes=5,
        collective_kv=ckv,
        item_input="text",
        dropout=0.0,
    )
    return RankerConfig(**(base | kw))


def tiny_ranker(ckv=None, seed: int = 0, **kw) -> Ranker:
    torch.manual_seed(seed)
    model = Ranker(tiny_config(ckv, **kw), n_items=N_ITEMS).eval()
    if model.cfg.reads_vectors:
        model.set_item_table(torch.randn(N_ITEMS, 16))
    return model


def ragged_history() -> History:
    vids = [[1, 2, 3, 4, 5, 6, 7], [8, 9], [10], [11, 12, 13, 14]]
    fb = [[0, 1, 2, 3, 4, -1, 2], [4, 4], [-1], [1, 2, 3, 0]]
    return History.from_lists(vids, fb)


def candidates() -> torch.Tensor:
    return torch.tensor(
        [[20, 21, 22, 23, 24], [25, 26, 27, -1, -1], [28, 29, 30, 31, 32], [33, 34, -1, -1, -1]]
    )


@pytest.mark.parametrize("mode", CKV_MODES)
def test_mis_fast_path_equals_reference_and_each_candidate_alone(mode):
    model = tiny_ranker(CKV_MODES[mode])
    h, c = ragged_history(), candidates()
    fast = model.score(model.prefill(h), c)
    ref = model.score_reference(h, c)
    alone = torch.stack(
        [model.score_reference(h, c[:, j : j + 1])[:, 0] for j in range(c.shape[1])], 1
    )
    assert torch.isinf(fast[c < 0]).all() and torch.isfinite(fast[c >= 0]).all()
    assert_close(fast, ref, atol=ATOL, rtol=0)
    assert_close(fast, alone, atol=ATOL, rtol=0)


@pytest.mark.parametrize("mode", CKV_MODES)
def test_shuffling_candidates_permutes_scores_only(mode):
    model = tiny_ranker(CKV_MODES[mode])
    h = ragged_history()
    c = torch.tensor([[20, 21, 22, 23, 24]] * 4)
    cache = model.prefill(h)
    base = model.score(cache, c)
    perm = torch.tensor([3, 0, 4, 1, 2])
    shuffled = model.score(cache, c[:, perm])
    assert_close(shuffled, base[:, perm], atol=ATOL, rtol=0)
    # and the cache is not changed by scoring
    assert_close(model.score(cache, c), base, atol=0, rtol=0)


@pytest.mark.parametrize("mode", CKV_MODES)
def test_prefill_prefix_then_extend_equals_full_prefill(mode):
    """prefill(h[:1]) then extend with each later event == prefill(h), for every user.

    CollectiveKV runs in float64 here: its stored user part is rounded to fp16, a step function,
    so the 1e-7 float32 noise between the decode and prefill kernels can move one stored value
    by an fp16 ulp and the scores by ~1e-5. In float64 both paths agree to 1e-9.
    """
    model = tiny_ranker(CKV_MODES[mode])
    atol = ATOL
    if mode != "plain":
        model = model.double()
        atol = 1e-9
    full = ragged_history()
    c = candidates()
    want = model.score(model.prefill(full), c)
    for b, n in enumerate(full.lengths.tolist()):
        cache = model.prefill(
            History(full.vids[b : b + 1, :1], full.feedback[b : b + 1, :1], torch.tensor([1]))
        )
        for t in range(1, n):
            cache = model.extend(cache, Event(full.vids[b : b + 1, t], full.feedback[b : b + 1, t]))
        assert cache.lengths.tolist() == [n + 1]
        assert_close(model.score(cache, c[b : b + 1]), want[b : b + 1], atol=atol, rtol=0)


@pytest.mark.parametrize("mode", COMPRESSED)
def test_extend_on_a_ragged_batch_matches_per_user_prefill(mode):
    model = tiny_ranker(CKV_MODES[mode])
    h = ragged_history()
    cache = model.extend(
        model.prefill(h), Event(torch.tensor([40, 41, 42, 43]), torch.tensor([0, 1, -1, 4]))
    )
    longer = History.from_lists(
        [
            row[:n].tolist() + [40 + b]
            for b, (row, n) in enumerate(zip(h.vids, h.lengths.tolist(), strict=True))
        ],
        [
            row[:n].tolist() + [f]
            for row, n, f in zip(h.feedback, h.lengths.tolist(), [0, 1, -1, 4], strict=True)
        ],
    )
    assert isinstance(cache, CompressedCache)
    assert_close(
        model.score(cache, candidates()),
        model.score(model.prefill(longer), candidates()),
        atol=ATOL,
        rtol=0,
    )


@pytest.mark.parametrize("mode", COMPRESSED)
def test_expand_of_compressed_state_equals_kv_computed_on_the_fly(mode):
    model = tiny_ranker(CKV_MODES[mode])
    h = ragged_history()
    with torch.no_grad():
        p = model._prefill(h)
    expanded = model.expand(p.state)
    valid = p.kv.valid()
    for k_fly, k_exp, v_fly, v_exp in zip(p.kv.k, expanded.k, p.kv.v, expanded.v, strict=True):
        # bit for bit on every valid token: the forward pass already rounds the user part to fp16
        assert torch.equal(k_fly.transpose(1, 2)[valid], k_exp.transpose(1, 2)[valid])
        assert torch.equal(v_fly.transpose(1, 2)[valid], v_exp.transpose(1, 2)[valid])
    # hence attention over expand(compress(...)) equals attention computed on the fly
    c = candidates()
    x = model._candidate_tokens(c)
    with torch.no_grad():
        fly, _, _ = model._step(p.kv, x, cached=False)
        exp, _, _ = model._step(expanded, x, cached=False)
    assert torch.equal(fly, exp)


class HostReads(TorchDispatchMode):
    """Records the ops that copy a tensor's values to the host (``int(t)``, ``t.item()``, boolean
    indexing): on a GPU each is a sync, and a CUDA graph cannot capture one."""

    SYNCING = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default}

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.SYNCING:
            self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("mode", ["plain", "collective_kv"])
def test_serving_calls_never_read_tensor_values_back_to_the_host(mode):
    """Scoring from a cached or stored state is capturable in a CUDA graph (the GPU benchmark's
    --cuda-graph): positions' bounds come from shapes, masks stay on the device."""
    model = tiny_ranker(CKV_MODES[mode])
    model.user_vector(model.prefill(ragged_history()))  # the rotary table exists, as when warm
    cache = model.prefill(ragged_history())
    reads = HostReads()
    with reads, torch.no_grad():
        model.score(cache, candidates())
        model.user_vector(cache)
        model.score_tokens(cache, model.candidate_tokens(torch.arange(N_ITEMS)))
    assert reads.seen == []
    with HostReads() as probe:  # the probe itself sees what it must
        int(torch.tensor(3))
    assert probe.seen == ["aten._local_scalar_dense.default"]


@pytest.mark.parametrize("user_dim", [1, 2, 4, 8])
def test_state_bytes_match_the_closed_form_ratio(user_dim):
    ckv = CollectiveKVConfig(pool_size=1024, user_dim=user_dim)
    model = tiny_ranker(ckv, n_kv_heads=4, head_dim=64)
    assert model.cfg.kv_width == 256
    state = model.prefill(ragged_history())
    assert state.layers[0].idx_k.dtype == torch.uint16
    assert state.layers[0].u_k.dtype == torch.float16
    tokens = int(state.lengths.sum())  # padding is not stored
    ratio = state.nbytes() / model.full_kv_bytes(state.lengths)
    assert (
        model.full_kv_bytes(state.lengths)
        == full_kv_bytes(tokens, 2, 256)
        == tokens * 2 * 2 * 256 * 2
    )
    assert ratio == pytest.approx(compression_ratio(ckv, 2, 256), abs=0)
    assert ratio == pytest.approx((4 + 4 * user_dim) / (4 * 256), abs=0)
    if user_dim == 1:
        assert ratio < 0.01  # 8 / 1024 = 0.78%


@pytest.mark.parametrize("share", ["k", "v"])
def test_sharing_off_stores_that_half_whole(share):
    """With only K (or V) shared the other half is the plain projection, kv_width fp16 numbers
    per token, with no index: the closed form and the stored bytes agree."""
    ckv = CollectiveKVConfig(pool_size=1024, user_dim=1, share_k=share == "k", share_v=share == "v")
    model = tiny_ranker(ckv, n_kv_heads=4, head_dim=64)
    state = model.prefill(ragged_history())
    layer = state.layers[0]
    whole = "v" if share == "k" else "k"
    assert getattr(layer, f"idx_{whole}") is None and getattr(layer, f"idx_{share}") is not None
    assert getattr(layer, f"u_{whole}").shape[-1] == 256
    assert getattr(layer, f"u_{share}").shape[-1] == 1
    assert model.layers[0].self_attn.ckv.side(whole) is None
    tokens = int(state.lengths.sum())
    assert state.nbytes() == tokens * state_bytes_per_token(ckv, 2, 256)
    assert compression_ratio(ckv, 2, 256) == pytest.approx((2 + 2 + 2 * 256) / (4 * 256), abs=0)
    # the unshared half is the layer's own projection of the cached tokens, rounded to fp16
    xs, valid = model.kv_inputs(ragged_history())
    for i, x in enumerate(xs):
        with torch.no_grad():
            plain = getattr(model.layers[i].self_attn, f"{whole}_proj")(x).half()
        assert torch.equal(getattr(state.layers[i], f"u_{whole}")[valid], plain[valid])
    with pytest.raises(InputError, match="share K, V or both"):
        CollectiveKVConfig(share_k=False, share_v=False)
    assert CollectiveKVConfig.share_flags(share) == {
        "share_k": share == "k",
        "share_v": share == "v",
    }
    with pytest.raises(InputError, match="share must be kv, k or v"):
        CollectiveKVConfig.share_flags("kx")


def test_large_pools_use_int32_indices():
    assert CollectiveKVConfig(pool_size=65536).index_bytes == 2
    assert CollectiveKVConfig(pool_size=65537).index_bytes == 4
    model = tiny_ranker(CollectiveKVConfig(pool_size=70000, user_dim=1))
    assert model.prefill(ragged_history()).layers[0].idx_v.dtype == torch.int32


def test_training_forward_equals_the_serving_scores():
    for ckv in CKV_MODES.values():
        model = tiny_ranker(ckv)
        h, c = ragged_history(), candidates()
        out = model(h, c)
        assert out.scores.requires_grad
        assert_close(out.scores.detach(), model.score(model.prefill(h), c), atol=ATOL, rtol=0)


def test_gradients_reach_pools_routers_and_user_projections():
    model = tiny_ranker(CKV_MODES["collective_kv"]).train()
    h, c = ragged_history(), candidates()
    out = model(h, c)
    loss = (
        ranking_loss(out.scores.masked_fill(c < 0, -1e4), torch.zeros(4, dtype=torch.long))
        + out.aux_loss
    )
    loss.backward()
    for layer in model.layers:
        ckv = layer.self_attn.ckv
        for name in (
            "pool_k",
            "pool_v",
            "router_k.weight",
            "router_v.weight",
            "user_k.weight",
            "user_v.weight",
        ):
            grad = ckv.get_parameter(name).grad
            assert grad is not None and grad.abs().sum() > 0, name


def test_aux_losses_are_finite_and_decrease_on_a_toy_task():
    ckv = CollectiveKVConfig(pool_size=16, user_dim=1, peak_weight=0.5, balance_weight=0.5)
    model = tiny_ranker(ckv).train()
    g = torch.Generator().manual_seed(0)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    aux_hist, loss_hist = [], []
    for _ in range(60):
        # toy task: the positive (candidate 0) is the item right after the last history item
        start = torch.randint(0, N_ITEMS - 8, (16,), generator=g)
        vids = torch.stack([start + i for i in range(5)], 1)
        h = History(vids, torch.full_like(vids, 3), torch.full((16,), 5))
        cands = torch.cat([start[:, None] + 5, torch.randint(0, N_ITEMS, (16, 7), generator=g)], 1)
        out = model(h, cands)
        loss = ranking_loss(out.scores, torch.zeros(16, dtype=torch.long))
        assert torch.isfinite(out.aux_loss)
        opt.zero_grad()
        (loss + out.aux_loss).backward()
        opt.step()
        aux_hist.append(out.aux_loss.item())
        loss_hist.append(loss.item())
    assert sum(aux_hist[-10:]) < 0.9 * sum(aux_hist[:10])
    assert sum(loss_hist[-10:]) < sum(loss_hist[:10])


def test_hugging_face_llama_round_trip_gives_the_same_hidden_states():
    from transformers import LlamaConfig, LlamaForCausalLM

    model = tiny_ranker(None, attention_bias=False)
    hf = LlamaForCausalLM(LlamaConfig(**llama_config(model))).eval()
    missing, unexpected = hf.load_state_dict(export_llama(model), strict=True), None
    assert unexpected is None and not missing.missing_keys
    h = History.from_lists([[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]], [[0, 1, 2, 3, 4], [4, 3, 2, 1, 0]])
    x, _ = model._embed_history(h)
    with torch.no_grad():
        theirs = hf.model(inputs_embeds=x).last_hidden_state
    assert_close(model.hidden_states(h), theirs, atol=ATOL, rtol=0)
    # and back: a fresh ranker loading those Llama weights has the same decoder
    other = tiny_ranker(None, seed=1)
    todo = import_llama(other, hf.state_dict())
    assert not [k for k in todo if k.startswith("layers.")]
    assert {"adapter.0.weight", "bos", "cand_emb", "head.weight"} <= set(todo)
    for k, v in model.state_dict().items():
        if k.startswith(("layers.", "norm.")):
            assert torch.equal(other.state_dict()[k], v), k


def test_import_rejects_a_checkpoint_of_another_shape():
    model = tiny_ranker(None)
    bigger = tiny_ranker(None, d_model=48)
    with pytest.raises(
        ValueError, match=r"model.layers.0.\S+: checkpoint shape \(48,?\S*\) != ranker"
    ):
        import_llama(model, export_llama(bigger))


def test_config_round_trips_through_json_and_rejects_conflicts():
    cfg = tiny_config(CollectiveKVConfig(pool_size=256, user_dim=4))
    again = RankerConfig.from_json(cfg.to_json())
    assert again == cfg and isinstance(again.collective_kv, CollectiveKVConfig)
    with pytest.raises(InputError, match=r"n_heads \(6\) must be a multiple of n_kv_heads \(4\)"):
        tiny_config(n_heads=6, n_kv_heads=4)
    with pytest.raises(InputError, match="user_dim"):
        tiny_config(CollectiveKVConfig(pool_size=8, user_dim=16))
    with pytest.raises(InputError, match="unknown field"):
        RankerConfig.from_dict({"d_modle": 3})


def test_plain_cache_layout():
    model = tiny_ranker(None)
    cache = model.prefill(ragged_history())
    assert isinstance(cache, KVCache)
    assert cache.k[0].shape == (4, 2, 8, 8)  # (B, Hkv, 1 + T_max, D)
    assert cache.lengths.tolist() == [8, 3, 2, 5]


@pytest.mark.parametrize("mode", CKV_MODES)
def test_training_at_cut_points_equals_scoring_each_prefix(mode):
    """One prefill trains on several next-item predictions: a candidate scored at cut t sees
    exactly what it would see after prefill(h[:t])."""
    model = tiny_ranker(CKV_MODES[mode])
    h = ragged_history()
    c = candidates().clamp(min=0)
    cut = torch.tensor([[1, 3, 7, 2, 5], [1, 2, 2, 1, 2], [1, 1, 1, 1, 1], [4, 3, 2, 1, 4]])
    with torch.no_grad():
        got = model(h, c, cut=cut).scores
    for b in range(4):
        for j in range(5):
            t = int(cut[b, j])
            prefix = History(h.vids[b : b + 1, :t], h.feedback[b : b + 1, :t], torch.tensor([t]))
            want = model.score(model.prefill(prefix), c[b : b + 1, j : j + 1])
            assert_close(got[b, j], want[0, 0], atol=ATOL, rtol=0)


@pytest.mark.parametrize("mode", CKV_MODES)
def test_catalog_logits_are_the_user_vector_after_each_prefix(mode):
    """The full-catalog training logits at position t are <u, every catalog item's token> with
    u the user token's vector after prefill(h[:t]) - what scoring the catalog would add."""
    model = tiny_ranker(CKV_MODES[mode])
    h = ragged_history()
    with torch.no_grad():
        out = model(h, candidates().clamp(min=0), catalog=True)
        catalog = model.catalog_tokens()
    assert out.catalog.shape == (4, 7, N_ITEMS)
    for b in range(4):
        for t in range(1, int(h.lengths[b]) + 1):
            prefix = History(h.vids[b : b + 1, :t], h.feedback[b : b + 1, :t], torch.tensor([t]))
            u = model.user_vector(model.prefill(prefix))
            assert_close(out.catalog[b, t - 1], (u @ catalog.T)[0], atol=ATOL, rtol=0)
    # a mask of prefixes returns just those rows (what training computes: no padding rows)
    mask = torch.arange(h.vids.shape[1]) < h.lengths[:, None]
    mask[0, 0] = False
    with torch.no_grad():
        rows = model(h, candidates().clamp(min=0), catalog=mask).catalog
    assert rows.shape == (int(mask.sum()), N_ITEMS)
    assert_close(rows, out.catalog[mask], atol=ATOL, rtol=0)


def test_the_adapter_is_one_linear_map_and_old_config_fields_are_refused():
    model = tiny_ranker()
    assert {k for k in model.state_dict() if k.startswith("adapter.")} == {
        "adapter.0.weight",
        "adapter.0.bias",
    }
    # fields of retired options: a checkpoint written with them does not load, by name
    for field in ("adapter", "user_token", "time_buckets"):
        old = tiny_config().to_dict() | {field: 0}
        with pytest.raises(InputError, match=f"unknown field.*{field}"):
            RankerConfig.from_dict(old)


def test_a_fitted_router_starts_as_the_nearest_entry_of_its_pool():
    from models.collective_kv import init_from_projections, nearest

    g = torch.Generator().manual_seed(0)
    # tokens around a few centres of very different norms: the router's bias (-|c|^2) is what
    # keeps tokens near a small centre from going to a large one
    centres = torch.randn(6, 32, generator=g) * torch.tensor([0.2, 0.5, 1, 2, 4, 8])[:, None]
    x = centres[torch.randint(6, (600,), generator=g)] + 0.05 * torch.randn(600, 32, generator=g)
    model = tiny_ranker(CollectiveKVConfig(pool_size=8, user_dim=1))
    att = model.layers[0].self_attn
    stats = init_from_projections(att.ckv, x, att.k_proj, att.v_proj, seed=0)
    shared = att.ckv.pool_k.shape[1]
    keys = att.k_proj(x)[:, :shared].detach()
    routed = att.ckv.router_k(x).argmax(-1)
    # the router's choice is the pool entry nearest each key, token for token
    assert torch.equal(routed, nearest(keys, att.ckv.pool_k.detach()))
    assert stats["k_router_rel_error"] == pytest.approx(stats["k_kmeans_rel_error"])
    assert any(k.endswith("router_k.bias") for k in model.state_dict())


def test_item_id_inputs_learn_an_embedding_per_item():
    model = tiny_ranker(None, item_input="id").train()
    with pytest.raises(ValueError, match="item-id embeddings"):
        model.set_item_table(torch.randn(N_ITEMS, 16))
    out = model(ragged_history(), candidates().clamp(min=0))
    out.scores.sum().backward()
    grad = model.item_emb.weight.grad
    assert grad[20].abs().sum() > 0 and grad[59].abs().sum() == 0  # 59 is never seen


def test_text_plus_id_starts_as_text_and_learns_residuals_of_seen_items_only():
    text, both = tiny_ranker(None), tiny_ranker(None, item_input="text+id")
    h, c = ragged_history(), candidates()
    missing, _ = both.load_state_dict(text.state_dict(), strict=False)
    assert missing == ["id_residual.weight"]
    both.set_item_table(text.item_table)
    # same weights, same table, residuals at zero: the same ranker as text alone
    assert_close(both.score(both.prefill(h), c), text.score(text.prefill(h), c), atol=ATOL, rtol=0)
    with torch.no_grad():
        both.id_residual.weight.normal_(std=0.1)
    assert_close(both.score(both.prefill(h), c), both.score_reference(h, c), atol=ATOL, rtol=0)
    assert not torch.allclose(both.score(both.prefill(h), c), text.score(text.prefill(h), c))
    both.train()
    both(h, c.clamp(min=0)).scores.sum().backward()
    grad = both.id_residual.weight.grad
    assert grad[20].abs().sum() > 0 and grad[59].abs().sum() == 0  # 59 is never seen


def test_training_batch_positives_cuts_and_next_items_follow_the_window():
    import numpy as np

    from models.batches import training_batch

    seqs = [np.arange(100, 130), np.array([7, 8]), np.arange(200, 205)]
    fbs = [np.zeros(len(s), dtype=np.int64) for s in seqs]
    tb = training_batch(
        seqs, fbs, np.random.default_rng(3), n_items=300, max_len=10, cuts=4, negatives=3
    )
    for b, seq in enumerate(seqs):
        n = int(tb.history.lengths[b])
        hist = tb.history.vids[b, :n].numpy()
        # the history is a contiguous run of the sequence, at most max_len long
        start = int(np.flatnonzero(seq == hist[0])[0])
        assert n <= 10 and (seq[start : start + n] == hist).all()
        window = seq[start : start + n + 1]  # ... and the window's last item is only a target
        assert tb.next_vids[b, :n].tolist() == window[1:].tolist()
        assert (tb.next_vids[b, n:] == -100).all()
        groups = tb.candidates[b].view(4, 4)
        cuts = tb.cut[b].view(4, 4)
        for g in range(4):
            t = int(cuts[g, 0])
            assert (cuts[g] == t).all() and 1 <= t <= n
            assert int(groups[g, 0]) == window[t]  # the positive is the item after the cut


def test_length_buckets_cover_every_row_once_in_batches_of_similar_lengths():
    import numpy as np

    from models.batches import length_buckets

    rng = np.random.default_rng(0)
    lengths = rng.integers(2, 52, size=100)
    batches = length_buckets(lengths, 8, rng)
    assert sorted(np.concatenate(batches).tolist()) == list(range(100))  # every row once
    assert [len(b) for b in batches].count(8) == 12 and min(len(b) for b in batches) == 4
    # a batch holds a contiguous run of the sorted lengths: no row outside its batch's range
    spans = sorted((lengths[b].min(), lengths[b].max()) for b in batches)
    assert all(hi <= lo_next for (_, hi), (lo_next, _) in zip(spans, spans[1:], strict=False))
    # the batches come in a seeded random order, not shortest first
    again = length_buckets(lengths, 8, np.random.default_rng(1))
    assert [b.tolist() for b in batches] != [b.tolist() for b in again]
    firsts = [lengths[b].max() for b in batches]
    assert firsts != sorted(firsts)


def test_a_window_scores_the_same_in_a_batch_of_its_length_as_padded_beside_longer_ones():
    """What grouping windows by length changes is only the padding: each window's candidate
    scores and catalog logits are the ones it gets beside much longer windows."""
    import numpy as np

    from models.batches import length_buckets, training_batch

    model = tiny_ranker()
    rng = np.random.default_rng(4)
    windows = [rng.integers(0, N_ITEMS, size=int(n)) for n in (2, 30, 3, 9, 31, 2, 4, 17)]
    feedback = [rng.integers(0, 5, size=len(w)) for w in windows]
    # fixed cut points and candidates per window, so both batchings score the same examples
    cuts = [rng.integers(1, len(w), size=2) for w in windows]
    cands = [
        np.concatenate([w[t][:, None], rng.integers(0, N_ITEMS, (2, 3))], 1).reshape(-1)
        for w, t in zip(windows, cuts, strict=True)
    ]

    def scored(idx):
        tb = training_batch(
            [windows[i] for i in idx],
            [feedback[i] for i in idx],
            rng,
            n_items=N_ITEMS,
            max_len=50,
            cuts=2,
            negatives=3,
            windowed=True,
            given=([cuts[i] for i in idx], [cands[i] for i in idx]),
        )
        rows = tb.next_vids >= 0
        with torch.no_grad():
            out = model(tb.history, tb.candidates, cut=tb.cut, catalog=rows)
        logits = out.catalog.split(rows.sum(1).tolist())
        return {i: (out.scores[j], logits[j]) for j, i in enumerate(idx)}, tb

    mixed, mixed_tb = scored(list(range(len(windows))))
    bucketed, widths = {}, []
    for idx in length_buckets([len(w) for w in windows], 2, rng):
        got, tb = scored(idx.tolist())
        bucketed |= got
        widths.append(tb.history.vids.shape[1])
    for i in range(len(windows)):
        assert_close(bucketed[i][0], mixed[i][0], atol=ATOL, rtol=0)
        assert_close(bucketed[i][1], mixed[i][1], atol=ATOL, rtol=0)
    # and the grouped batches compute far less padding than one batch of mixed lengths
    assert sorted(widths) == [1, 3, 16, 30] and mixed_tb.history.vids.shape[1] == 30
