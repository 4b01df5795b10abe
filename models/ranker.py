"""The personalized ranker (DuoLM): a Llama-style decoder whose tokens are item vectors.

Input sequence per user: ``[BOS] h_1 ... h_T`` with ``h_t = adapter(item_table[vid_t]) +
feedback_emb[f_t]``, then candidates ``c_j = adapter(item_table[vid_j])
+ cand_emb`` (the adapter: one linear map); with
``item_input="text+id"`` every item token also adds a learned per-item
residual ``id_residual[vid]`` (zero at start, so unseen items keep their text token), and with
``"id"`` (the baseline) a learned embedding replaces ``item_table``. Position p of BOS is 0, of
h_t is t; every candidate sits at position T+1 and sees the whole history and itself, never
another candidate (multi-item scoring, MIS). The score of candidate j is a linear head on its
last hidden state.

One more token rides along with the candidates, the user token: a learned
query embedding at position T+1 that sees the history and itself, like a candidate. Its output
``u = user_head(norm(x))`` is the user's vector, and every candidate's score gains ``<u, c_j>``
(c_j: the candidate's input token). Scoring stays one MIS pass (one token more), the cache is
unchanged; what it buys is training: ``<u_t, c>`` for the user token at each history position t
against every catalog item is a full-catalog softmax over all next-item predictions of a
history, which sampled negatives alone approximate poorly (the popular items a full-catalog
ranking competes with are rarely drawn).

Serving API, on a batch of users with ragged histories:

    cache  = ranker.prefill(history)                 # KVCache, or CompressedCache with CKV
    scores = ranker.score(cache, candidate_vids)     # MIS fast path, (B, N)
    cache  = ranker.extend(cache, event)             # one decode step: one more history token
    scores = ranker.score_reference(history, cands)  # packed sequence + dense mask (the oracle)

Training uses ``forward(history, candidate_vids)``: the same prefill + MIS fast path with
gradients, so training sees exactly the attention pattern serving uses.

A new history token and a candidate are the same computation - a token at position T+1 that
attends to the cache and itself - so ``extend`` and ``score`` share ``_step``; only what is kept
differs (the new token's K/V, or its score). With CollectiveKV the history tokens' K/V come from
the pools (``models.collective_kv``) and the cache IS the compressed state; candidates, which
are never cached, use the ordinary k/v projections.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models.collective_kv import (
    CollectiveKV,
    LayerState,
    Routing,
    full_kv_bytes,
)
from models.config import RankerConfig
from models.inputs import (  # noqa: F401 - re-exported: the ranker API
    Cache,
    CompressedCache,
    Event,
    History,
    KVCache,
    Prefill,
    RankerOutput,
)
from models.layers import (
    RMSNorm,
    SwiGLU,
    apply_rope,
    masked_attention,
    merge_heads,
    mis_attention,
    rope_cos_sin,
    split_heads,
)


def ranking_loss(scores: Tensor, labels: Tensor) -> Tensor:
    """Softmax cross-entropy over each row's candidates; labels (B,) = index of the positive."""
    return F.cross_entropy(scores, labels)


def distillation_loss(scores: Tensor, teacher: Tensor, temperature: float = 1.0) -> Tensor:
    """KL(teacher || ranker) between the softmax distributions over each row's candidates at
    ``temperature``, times temperature^2 (so its gradient keeps its scale as T changes), mean
    over rows. scores, teacher (R, N)."""
    t = temperature
    p = torch.log_softmax(teacher.float() / t, dim=-1)
    q = torch.log_softmax(scores.float() / t, dim=-1)
    return (p.exp() * (p - q)).sum(-1).mean() * t * t


# ----------------------------------------------------------------------------- the model


class Attention(nn.Module):
    def __init__(self, cfg: RankerConfig) -> None:
        super().__init__()
        self.cfg = cfg
        qw, kvw = cfg.n_heads * cfg.head_dim, cfg.kv_width
        self.q_proj = nn.Linear(cfg.d_model, qw, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(cfg.d_model, kvw, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(cfg.d_model, kvw, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(qw, cfg.d_model, bias=False)
        self.ckv = CollectiveKV(cfg.d_model, kvw, cfg.collective_kv) if cfg.collective_kv else None
        # a module mapping cached tokens' hidden states to their K and V in place of k_proj and
        # v_proj: where a benchmark plugs in another compressed cache to compare with the pools
        # (benchmarks/low_rank.py). None in the ranker itself.
        self.kv_map: nn.Module | None = None

    def project(
        self, hn: Tensor, cos: Tensor, sin: Tensor, pool_valid: Tensor | None
    ) -> tuple[Tensor, Tensor, Tensor, Routing | None]:
        """hn (B, S, d) -> q (B, H, S, D), k, v (B, Hkv, S, D) with rotary applied.

        For cached tokens (``pool_valid`` (B, S) given) K/V come from the CollectiveKV pools
        when this layer has them; otherwise, and for candidates, from k_proj / v_proj.
        """
        cfg = self.cfg
        q = apply_rope(split_heads(self.q_proj(hn), cfg.n_heads), cos, sin)
        routing = None
        if pool_valid is not None and self.ckv is not None:
            k, v, routing = self.ckv(hn, pool_valid, self.k_proj, self.v_proj)
        elif pool_valid is not None and self.kv_map is not None:
            k, v = self.kv_map(hn)
        else:
            k, v = self.k_proj(hn), self.v_proj(hn)
        k = apply_rope(split_heads(k, cfg.n_kv_heads), cos, sin)
        return q, k, split_heads(v, cfg.n_kv_heads), routing


class DecoderLayer(nn.Module):
    def __init__(self, cfg: RankerConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = SwiGLU(cfg.d_model, cfg.ffn_dim)

    def finish(self, x: Tensor, attended: Tensor, drop: nn.Module) -> Tensor:
        """The residual updates after attention: x + o_proj(attended), then x + mlp(norm(x))."""
        x = x + drop(self.self_attn.o_proj(merge_heads(attended)))
        return x + drop(self.mlp(self.post_attention_layernorm(x)))


class Ranker(nn.Module):
    """See the module docstring. ``item_table`` (n_items, item_dim) is a buffer set with
    ``set_item_table``; it lives on the ranker's device and is addressed by vid."""

    def __init__(self, cfg: RankerConfig, n_items: int = 1) -> None:
        super().__init__()
        self.cfg = cfg
        self.register_buffer("item_table", torch.zeros(n_items, cfg.item_dim), persistent=False)
        # the baseline without text: a learned vector per item id instead of the encoder's
        self.item_emb = nn.Embedding(n_items, cfg.item_dim) if cfg.item_input == "id" else None
        # text+id: a learned residual per item on top of its text token, zero until training
        # moves it (items that never occur in training keep their text token exactly)
        self.id_residual = None
        if cfg.item_input == "text+id":
            self.id_residual = nn.Embedding(n_items, cfg.d_model)
            nn.init.zeros_(self.id_residual.weight)
        self.adapter = nn.Sequential(nn.Linear(cfg.item_dim, cfg.d_model))
        self.feedback_emb = nn.Embedding(cfg.feedback_classes + 1, cfg.d_model)  # row 0: unknown
        self.bos = nn.Parameter(torch.randn(cfg.d_model) * 0.02)
        self.cand_emb = nn.Parameter(torch.randn(cfg.d_model) * 0.02)
        self.user_query = nn.Parameter(torch.randn(cfg.d_model) * 0.02)
        self.user_head = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.head = nn.Linear(cfg.d_model, 1)
        self.drop = nn.Dropout(cfg.dropout)
        # the item prior's weight, prior_weight * exp(prior_gain): learned as a log-gain, so one
        # step moves it by a share of itself at any scale
        self.prior_gain = nn.Parameter(torch.zeros(())) if cfg.prior_weight > 0 else None
        self._rope_table: dict[tuple, tuple[Tensor, Tensor]] = {}
        # Embeddings start small, like the item tokens they are added to: at nn.Embedding's
        # default N(0, 1) the feedback term would drown which item a token is.
        for emb in (self.feedback_emb, self.item_emb):
            if emb is not None:
                nn.init.normal_(emb.weight, std=0.02)

    @property
    def prior_weight(self) -> Tensor | None:
        """The item prior's weight in this ranker's score (None: trained without the prior):
        the served score is ``score + prior_weight * prior``, the fusion it was trained as."""
        if self.prior_gain is None:
            return None
        return self.cfg.prior_weight * self.prior_gain.exp()

    def compressed_kv_parameters(self) -> list[str]:
        """Names of the compressed cache's parameters: the CollectiveKV routers, pools and user
        projections, or a plugged-in ``kv_map``'s (empty for an uncompressed ranker)."""
        parts = (".ckv.", ".kv_map.")
        return [n for n, _ in self.named_parameters() if any(p in n for p in parts)]

    # -- item table and token embeddings

    def set_item_table(self, vectors: Tensor) -> None:
        """vectors (n_items, item_dim): row i is the item with vid i."""
        if not self.cfg.reads_vectors:
            raise ValueError("this ranker learns item-id embeddings (item_input='id'): no table")
        if vectors.ndim != 2 or vectors.shape[1] != self.cfg.item_dim:
            raise ValueError(
                f"item table must be (n_items, {self.cfg.item_dim}), got {tuple(vectors.shape)}"
            )
        self.item_table = vectors.to(device=self.bos.device, dtype=self.bos.dtype).contiguous()

    def _item_tokens(self, vids: Tensor | None) -> Tensor:
        """Item tokens of ``vids`` (padding -1 reads item 0), or of the whole catalog in vid
        order with ``None`` - read straight from the tables: no gather of a copy of them."""
        if vids is None:
            raw = self.item_emb.weight if self.item_emb is not None else self.item_table
            residual = None if self.id_residual is None else self.id_residual.weight
        else:
            v = vids.clamp(min=0)
            raw = self.item_emb(v) if self.item_emb is not None else self.item_table[v]
            residual = None if self.id_residual is None else self.id_residual(v)
        tokens = self.adapter(raw.to(self.bos.dtype))
        return tokens if residual is None else tokens + residual

    def _history_tokens(self, vids: Tensor, feedback: Tensor) -> Tensor:
        return self._item_tokens(vids) + self.feedback_emb((feedback + 1).clamp(min=0))

    def _embed_history(self, h: History) -> tuple[Tensor, Tensor]:
        """-> x (B, 1+T, d) with BOS first, lengths (B,) including BOS."""
        b = h.vids.shape[0]
        x = self._history_tokens(h.vids, h.feedback)
        x = torch.cat([self.bos.expand(b, 1, -1), x], dim=1)
        return self.drop(x), h.lengths + 1

    def _candidate_tokens(self, vids: Tensor | None) -> Tensor:
        return self._item_tokens(vids) + self.cand_emb

    def _rope(self, positions: Tensor, bound: int) -> tuple[Tensor, Tensor]:
        """cos, sin for integer positions (...,) -> (..., head_dim), from a table that grows by
        doubling: every score and expand call needs them, so they are computed once. ``bound``
        (> every position) comes from the callers' shapes, never from reading ``positions``:
        reading a device tensor's values is a host sync, which a CUDA graph cannot capture and
        which stalls every serving call on a GPU."""
        key = (positions.device, self.bos.dtype)
        table = self._rope_table.get(key)
        if table is None or table[0].shape[0] < bound:
            size = max(bound, 2 * (table[0].shape[0] if table is not None else 256))
            pos = torch.arange(size, device=positions.device)
            table = rope_cos_sin(pos, self.cfg.head_dim, self.cfg.rope_theta, self.bos.dtype)
            self._rope_table[key] = table
        return table[0][positions], table[1][positions]

    # -- prefill

    def _prefill(self, h: History, capture: list[Tensor] | None = None) -> Prefill:
        """``capture``: if given, each layer's normed input (B, 1+T, d) is appended to it - the
        hidden states K and V are projected from (used to analyse the KV and fit the pools)."""
        x, lengths = self._embed_history(h)
        b, length, _ = x.shape
        pos = torch.arange(length, device=x.device)
        valid = pos < lengths[:, None]
        mask = (
            torch.tril(torch.ones(length, length, dtype=torch.bool, device=x.device))
            & valid[:, None, :]
        )
        mask = mask | torch.eye(length, dtype=torch.bool, device=x.device)  # padded rows: no NaN
        cos, sin = self._rope(pos.expand(b, -1), length)
        ks, vs, states, aux = [], [], [], x.new_zeros(())
        for layer in self.layers:
            hn = layer.input_layernorm(x)
            if capture is not None:
                capture.append(hn)
            q, k, v, routing = layer.self_attn.project(hn, cos, sin, valid)
            if routing is not None:
                states.append(routing.state)
                aux = aux + routing.aux_loss
            ks.append(k)
            vs.append(v)
            x = layer.finish(x, masked_attention(q, k, v, mask), self.drop)
        state = CompressedCache(states, lengths) if states else None
        return Prefill(KVCache(ks, vs, lengths), state, aux, self.norm(x))

    @torch.no_grad()
    def prefill(self, history: History) -> Cache:
        """Encode histories into the cache the serving path keeps (compressed with CollectiveKV)."""
        p = self._prefill(history)
        return p.state if p.state is not None else p.kv

    @torch.no_grad()
    def kv_inputs(self, history: History) -> tuple[list[Tensor], Tensor]:
        """Per layer the normed inputs of the cached tokens (B, 1+T, d) and their validity mask
        (B, 1+T): ``k_proj`` / ``v_proj`` of them are the layer's K and V before rotary."""
        capture: list[Tensor] = []
        self._prefill(history, capture)
        length = capture[0].shape[1]
        valid = torch.arange(length, device=capture[0].device) < (history.lengths + 1)[:, None]
        return capture, valid

    @torch.no_grad()
    def hidden_states(self, history: History) -> Tensor:
        """Final (normed) hidden states of [BOS] + history, (B, 1+T, d); padding rows undefined."""
        return self._prefill(history).hidden

    def expand(self, cache: Cache) -> KVCache:
        """CompressedCache -> KVCache on this device (gather + concat + rotary); KVCache as is."""
        if isinstance(cache, KVCache):
            return cache
        cfg = self.cfg
        b, length = cache.layers[0].u_k.shape[:2]
        positions = torch.arange(length, device=cache.lengths.device).expand(b, -1)
        cos, sin = self._rope(positions, length)
        ks, vs = [], []
        for layer, state in zip(self.layers, cache.layers, strict=True):
            k, v = layer.self_attn.ckv.expand(state, self.bos.dtype)
            ks.append(apply_rope(split_heads(k, cfg.n_kv_heads), cos, sin))
            vs.append(split_heads(v, cfg.n_kv_heads))
        return KVCache(ks, vs, cache.lengths)

    # -- the shared step: new tokens at position `lengths` attending to the cache and themselves

    def _step(
        self, kv: KVCache, x: Tensor, cached: bool, visible: Tensor | None = None
    ) -> tuple[Tensor, list, Tensor]:
        """x (B, N, d) -> final hidden (B, N, d), per-layer new-token K/V (or states), aux.

        ``cached``: the new tokens become history (extend), so with CollectiveKV their K/V come
        from the pools; otherwise (candidates) from the k/v projections. ``visible`` (B, N):
        how many cache tokens (BOS included) each new token sees - by default all of them; a
        smaller value scores the token as if the history ended there (it sits at that position).
        """
        b, n, _ = x.shape
        width = kv.k[0].shape[2]  # cached tokens, BOS included: new tokens sit at <= width
        if visible is None:
            cos, sin = self._rope(kv.lengths[:, None].expand(b, n), width + 1)
            valid = kv.valid()
        else:
            cos, sin = self._rope(visible, width + 1)
            valid = torch.arange(width, device=x.device) < visible[..., None]
        new, aux = [], x.new_zeros(())
        # new history tokens take K/V from the pools (if any); candidates from the projections
        pool_valid = torch.ones(b, n, dtype=torch.bool, device=x.device) if cached else None
        for i, layer in enumerate(self.layers):
            q, k, v, routing = layer.self_attn.project(
                layer.input_layernorm(x), cos, sin, pool_valid
            )
            if routing is not None:
                new.append(routing.state)
                aux = aux + routing.aux_loss
            else:
                new.append((k, v))
            x = layer.finish(x, mis_attention(q, kv.k[i], kv.v[i], valid, k, v), self.drop)
        return x, new, aux

    def _head(self, x: Tensor) -> Tensor:
        return self.head(self.norm(x)).squeeze(-1)

    # -- scoring

    @torch.no_grad()
    def score(self, cache: Cache, candidate_vids: Tensor) -> Tensor:
        """MIS fast path: candidate_vids (B, N) long, -1 = padding -> scores (B, N), pads -inf."""
        scores = self.score_tokens(cache, self._candidate_tokens(candidate_vids))
        return scores.masked_fill(candidate_vids < 0, float("-inf"))

    @torch.no_grad()
    def candidate_tokens(self, vids: Tensor) -> Tensor:
        """Input tokens of candidates, (..., d): user-independent, so a caller scoring the same
        items for many users (a full catalog) computes them once."""
        return self._candidate_tokens(vids)

    @torch.no_grad()
    def score_tokens(self, cache: Cache, tokens: Tensor) -> Tensor:
        """MIS from precomputed candidate tokens (B, N, d), or (N, d) shared by all users."""
        kv = self.expand(cache)
        if tokens.ndim == 2:
            tokens = tokens.expand(len(kv.lengths), -1, -1)
        b = len(kv.lengths)
        x, _, _ = self._step(kv, torch.cat([self.user_query.expand(b, 1, -1), tokens], 1), False)
        return self._head(x[:, 1:]) + (self._user_vector(x[:, :1]) * tokens).sum(-1)

    @torch.no_grad()
    def user_vector(self, cache: Cache) -> Tensor:
        """The user token's vector u (B, d) for these caches: ``<u, candidate token>`` is the
        part of each candidate's score a dot product gives (a retrieval query)."""
        kv = self.expand(cache)
        x, _, _ = self._step(kv, self.user_query.expand(len(kv.lengths), 1, -1), cached=False)
        return self._user_vector(x[:, 0])

    def _user_vector(self, x: Tensor) -> Tensor:
        """Final hidden states of user tokens (..., d) -> the user's vectors (..., d)."""
        return self.user_head(self.norm(x))

    def forward(
        self,
        history: History,
        candidate_vids: Tensor,
        cut: Tensor | None = None,
        catalog: bool | Tensor = False,
    ) -> RankerOutput:
        """Training forward: prefill + MIS fast path with gradients; see ``ranking_loss``.

        candidate_vids (B, N). ``cut`` (B, N), optional: candidate j is scored against the first
        cut[b, j] history items only, as if the history ended there - one prefill then trains
        on several next-item predictions per user (the causal prefix of a history does not
        depend on what follows it). Default: the whole history. ``catalog``: also return the
        user token's full-catalog logits (``RankerOutput.catalog``): True, after every history
        prefix, (B, T, n_items); a (B, T) bool mask, after the chosen prefixes only, (R,
        n_items) in row-major order - the rows a loss uses, so padding costs no logits (the
        catalog product is the largest tensor of a training step on short histories).
        """
        p = self._prefill(history)
        tokens = self._candidate_tokens(candidate_vids)
        b, n = candidate_vids.shape
        if cut is None:
            cut = history.lengths[:, None].expand(b, n)
        # a user token after each history prefix t = 1..T (t clamped to the user's length), in
        # the same pass as the candidates; a candidate at cut t adds <u_t, its token>
        t = history.vids.shape[1]
        prefix = torch.minimum(
            torch.arange(1, t + 1, device=cut.device).expand(b, -1), history.lengths[:, None]
        ).clamp(min=1)
        queries = self.user_query.expand(b, t, -1)
        x, _, _ = self._step(
            p.kv,
            torch.cat([queries, tokens], 1),
            cached=False,
            visible=torch.cat([prefix, cut], 1) + 1,
        )
        u = self._user_vector(x[:, :t])  # (B, T, d)
        u_cand = u.gather(1, (cut - 1).clamp(min=0)[..., None].expand(-1, -1, u.shape[-1]))
        scores = self._head(x[:, t:]) + (u_cand * tokens).sum(-1)
        scores = scores.masked_fill(candidate_vids < 0, float("-inf"))
        logits = None
        if isinstance(catalog, Tensor):
            logits = u[catalog] @ self.catalog_tokens().T
        elif catalog:
            logits = u @ self.catalog_tokens().T
        return RankerOutput(scores, p.aux, logits)

    def catalog_tokens(self) -> Tensor:
        """Candidate tokens of every item in the catalog, (n_items, d)."""
        return self._candidate_tokens(None)

    @torch.no_grad()
    def score_reference(self, history: History, candidate_vids: Tensor) -> Tensor:
        """The oracle: history and candidates packed in one sequence with a dense boolean mask
        and ``scaled_dot_product_attention``. candidate_vids (B, N) -> scores (B, N)."""
        cfg = self.cfg
        xh, lengths = self._embed_history(history)
        xc = cand_tokens = self._candidate_tokens(candidate_vids)
        b, length, _ = xh.shape
        xc = torch.cat([self.user_query.expand(b, 1, -1), xc], 1)  # the user token, first
        n = xc.shape[1]
        x = torch.cat([xh, xc], dim=1)
        dev = x.device
        hist_pos = torch.arange(length, device=dev).expand(b, -1)
        pos = torch.cat([hist_pos, lengths[:, None].expand(b, n)], dim=1)
        hist_valid = hist_pos < lengths[:, None]
        s = length + n
        is_hist = torch.arange(s, device=dev) < length
        causal = torch.tril(torch.ones(s, s, dtype=torch.bool, device=dev))
        # history rows: causal over valid history; candidate rows: all valid history + self
        key_ok = torch.cat([hist_valid, torch.ones(b, n, dtype=torch.bool, device=dev)], dim=1)
        mask = (causal & is_hist[None, :] & key_ok[:, None, :]) | torch.eye(
            s, dtype=torch.bool, device=dev
        )
        cos, sin = self._rope(pos, length + 1)
        for layer in self.layers:
            att = layer.self_attn
            hn = layer.input_layernorm(x)
            q = apply_rope(split_heads(att.q_proj(hn), cfg.n_heads), cos, sin)
            k, v = att.k_proj(hn), att.v_proj(hn)
            if att.ckv is not None:
                kh, vh, _ = att.ckv(hn[:, :length], hist_valid, att.k_proj, att.v_proj)
            elif att.kv_map is not None:
                kh, vh = att.kv_map(hn[:, :length])
            if att.ckv is not None or att.kv_map is not None:
                k = torch.cat([kh, k[:, length:]], dim=1)
                v = torch.cat([vh, v[:, length:]], dim=1)
            k = apply_rope(split_heads(k, cfg.n_kv_heads), cos, sin)
            v = split_heads(v, cfg.n_kv_heads)
            x = x + att.o_proj(merge_heads(masked_attention(q, k, v, mask)))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        scores = self._head(x[:, length + n - candidate_vids.shape[1] :])
        u = self._user_vector(x[:, length])
        scores = scores + (cand_tokens * u[:, None, :]).sum(-1)
        return scores.masked_fill(candidate_vids < 0, float("-inf"))

    # -- extend

    @torch.no_grad()
    def extend(self, cache: Cache, event: Event) -> Cache:
        """Append one history token per user (a decode step against the cache); returns a new
        cache, the input is left unchanged."""
        kv = self.expand(cache)
        x = self._history_tokens(event.vid[:, None], event.feedback[:, None])
        _, new, _ = self._step(kv, x, cached=True)
        rows = torch.arange(len(cache.lengths), device=cache.lengths.device)
        at = cache.lengths

        def put(t: Tensor, value: Tensor, dim: int) -> Tensor:
            """Write value at index lengths[b] of dim ``dim`` (1: (B, L, ...), 2: (B, H, L, D))."""
            if int(at.max()) >= t.shape[dim]:
                pad_shape = list(t.shape)
                pad_shape[dim] = 1
                t = torch.cat([t, t.new_zeros(pad_shape)], dim=dim)
            else:
                t = t.clone()
            # uint16 has no index_put: write through an int16 view of the same bits
            view = t.view(torch.int16) if t.dtype == torch.uint16 else t
            val = value.view(torch.int16) if value.dtype == torch.uint16 else value
            if dim == 1:
                view[rows, at] = val[:, 0]
            else:
                view[rows, :, at] = val[:, :, 0]
            return t

        if isinstance(cache, CompressedCache):
            layers = [
                LayerState(
                    *(
                        None if old is None else put(old, nw, 1)
                        for old, nw in zip(s.parts(), n.parts(), strict=True)
                    )
                )
                for s, n in zip(cache.layers, new, strict=True)
            ]
            return CompressedCache(layers, cache.lengths + 1)
        ks = [put(k, nk, 2) for k, (nk, _) in zip(cache.k, new, strict=True)]
        vs = [put(v, nv, 2) for v, (_, nv) in zip(cache.v, new, strict=True)]
        return KVCache(ks, vs, cache.lengths + 1)

    # -- sizes

    def full_kv_bytes(self, lengths: Tensor) -> int:
        """Bytes the plain fp16 KV of these cached tokens would take."""
        return full_kv_bytes(int(lengths.sum()), self.cfg.n_layers, self.cfg.kv_width)
