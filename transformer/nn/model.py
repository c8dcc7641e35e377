"""The Transformer of "Attention Is All You Need" (Vaswani et al., 2017), section by section.

Read top to bottom: positions, attention, feed-forward, the residual wrapper, encoder and
decoder layers, the model with `encode()` / `decode()` (the cache for step-by-step
decoding is in kv_cache.py). Shapes: B batch, S source length, T target length, D d_model,
h heads, d_k = D / h, V vocabulary. Padding masks are boolean with True = pad (as in PyTorch);
F.scaled_dot_product_attention (and kernels.attention) take the opposite convention
(True = may attend), or an additive mask (0, or -inf where not), which `key_mask` makes for
decoding with the cache.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from transformer.config import ModelConfig
from transformer.nn.kernels import Dropout, Linear, add_norm, attention, linear
from transformer.nn.kv_cache import Arena, KVCache, SelfAttentionKV, stored_keys


def sinusoidal(pos: Tensor, d_model: int) -> Tensor:
    """Section 3.5: PE(pos, 2i) = sin(pos / 10000^(2i/D)), PE(pos, 2i+1) = cos(same)."""
    two_i = torch.arange(0, d_model, 2, device=pos.device, dtype=torch.float32)  # (D/2,)
    angle = pos.float()[:, None] / 10000.0 ** (two_i / d_model)  # (T, D/2)
    return torch.stack([angle.sin(), angle.cos()], dim=-1).flatten(1)[:, :d_model]  # (T, D)


def key_mask(padding: Tensor, additive: bool) -> Tensor:
    """SDPA's attn_mask from key padding (B, S), True = pad: (B, 1, 1, S), broadcast over
    heads and queries; boolean (True = may attend), or additive (0, or -inf at padding),
    which a decoding step on a CPU adds faster than it masks (kernels.attention)."""
    padding = padding[:, None, None, :]
    return torch.where(padding, float("-inf"), 0.0) if additive else ~padding


class MultiHeadAttention(nn.Module):
    """Sections 3.2.1-3.2.2: h heads of softmax(Q K^T / sqrt(d_k)) V on learned projections
    of the queries, keys and values, concatenated and projected by W^O. Self-attention when
    called without `memory`; `causal` makes it the decoder's masked self-attention."""

    def __init__(self, d_model: int, n_heads: int, attn_dropout: float, causal: bool = False):
        super().__init__()
        self.n_heads, self.d_k = n_heads, d_model // n_heads
        self.attn_dropout, self.causal = attn_dropout, causal
        # W^Q, W^K, W^V of all heads stacked in one (3D, D) matrix, nn.MultiheadAttention's
        # layout: self-attention projects in one matmul, cross-attention splits Q from K, V.
        self.in_proj = Linear(d_model, 3 * d_model)
        self.out_proj = Linear(d_model, d_model)  # W^O

    def forward(
        self,
        x: Tensor,
        memory: Tensor | None = None,
        mask: Tensor | None = None,
        cache: SelfAttentionKV | dict[str, Tensor] | None = None,
    ) -> Tensor:
        # x (B, T, D) queries; memory (B', S, D) encoder output; mask: SDPA's attn_mask over
        # the keys, broadcast over heads (and queries): boolean (True = may attend) or
        # additive (0 or -inf). B = B' * g: g consecutive query rows may share a memory row
        # (beam search's hypotheses of one sentence), and attend to it as its g * T queries.
        q, k, v = self._project(x, memory, cache)  # (B, h, T, d_k), (B', h, S, d_k) x 2
        q = q.unflatten(0, (k.size(0), -1)).transpose(1, 2).flatten(2, 3)  # (B', h, g*T, d_k)
        # Section 3.2.3: a position sees no later one. Without a cache that is SDPA's own
        # triangle (which lets the flash kernel run on GPU); the cache knows each row's past.
        is_causal = self.causal and cache is None
        if self.causal and cache is not None:
            mask = cache.mask  # (B', 1, g*T, slots)
        drop = self.attn_dropout if self.training else 0.0
        y = attention(q, k, v, mask, drop, is_causal)  # SDPA; (B', h, g*T, d_k)
        y = y.unflatten(2, (-1, x.size(1))).permute(0, 2, 3, 1, 4)  # (B', g, T, h, d_k)
        return self.out_proj(y.reshape(x.shape))  # heads concatenated: (B, T, D)

    def _project(
        self, x: Tensor, memory: Tensor | None, cache: SelfAttentionKV | dict[str, Tensor] | None
    ):
        if memory is None:
            qkv = self._heads(self.in_proj(x))  # (3, B, h, T, d_k)
            if cache is not None:  # the earlier positions' keys and values are cached
                return qkv[0], *cache.extend(qkv[1:])  # (B, h, T, d_k), 2 x (B', h, slots, d_k)
            return qkv.unbind(0)
        d = x.size(-1)
        w, b = self.in_proj.weight, self.in_proj.bias
        q = self._heads(linear(x, w[:d], b[:d], self.in_proj.panels(x, d)))[0]  # (B, h, T, d_k)
        if cache:  # encoder-decoder keys and values: computed once per sentence
            return q, cache["k"], cache["v"]
        k, v = self._heads(linear(memory, w[d:], b[d:]))  # 2 x (B', h, S, d_k)
        if cache is not None:  # contiguous once, rather than copied by each step's products
            k, v = stored_keys(k.contiguous()), v.contiguous()
            cache.update(k=k, v=v)
        return q, k, v

    def _heads(self, y: Tensor) -> Tensor:
        b, t, _ = y.shape  # (B, T, n * D) -> (n, B, h, T, d_k)
        return y.view(b, t, -1, self.n_heads, self.d_k).permute(2, 0, 3, 1, 4)


class FeedForward(nn.Module):
    """Section 3.3: FFN(x) = max(0, x W1 + b1) W2 + b2, the same at every position."""

    def __init__(self, d_model: int, d_ff: int, relu_dropout: float):
        super().__init__()
        self.w1, self.w2 = Linear(d_model, d_ff), Linear(d_ff, d_model)
        self.dropout = Dropout(relu_dropout)

    def forward(self, x: Tensor) -> Tensor:
        # Out of place where autograd records (in place on the product's output would make
        # it copy the output back); in place when decoding, one (B, T, d_ff) tensor fewer.
        h = F.relu(self.w1(x), inplace=not torch.is_grad_enabled())
        return self.w2(self.dropout(h))  # -> (B, T, D)


class Residual(nn.Module):
    """Sections 3.1 and 5.4: LayerNorm(x + Dropout(Sublayer(x))) (post-norm, the paper's),
    or with norm_first x + Dropout(Sublayer(LayerNorm(x))) (pre-norm, easier to train deep)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.norm = nn.LayerNorm(cfg.d_model)
        self.dropout = Dropout(cfg.dropout)
        self.norm_first = cfg.norm_first

    def forward(self, x: Tensor, sublayer) -> Tensor:
        if self.norm_first:
            return x + self.dropout(sublayer(self.norm(x)))
        return add_norm(x, self.dropout(sublayer(x)), self.norm)


class EncoderLayer(nn.Module):
    """Section 3.1: self-attention, then the feed-forward network."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self_attn = MultiHeadAttention(cfg.d_model, cfg.n_heads, cfg.attn_dropout)
        self.ffn = FeedForward(cfg.d_model, cfg.d_ff, cfg.relu_dropout)
        self.sub = nn.ModuleList(Residual(cfg) for _ in range(2))

    def forward(self, x: Tensor, src_mask: Tensor) -> Tensor:
        x = self.sub[0](x, lambda h: self.self_attn(h, mask=src_mask))
        return self.sub[1](x, self.ffn)  # (B, S, D)


class DecoderLayer(nn.Module):
    """Section 3.1: masked self-attention, encoder-decoder attention (queries from the
    decoder, keys and values from the encoder output), then the feed-forward network."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self_attn = MultiHeadAttention(cfg.d_model, cfg.n_heads, cfg.attn_dropout, causal=True)
        self.cross_attn = MultiHeadAttention(cfg.d_model, cfg.n_heads, cfg.attn_dropout)
        self.ffn = FeedForward(cfg.d_model, cfg.d_ff, cfg.relu_dropout)
        self.sub = nn.ModuleList(Residual(cfg) for _ in range(3))

    def forward(self, x, memory, src_mask, self_cache=None, cross_cache=None) -> Tensor:
        x = self.sub[0](x, lambda h: self.self_attn(h, cache=self_cache))
        x = self.sub[1](x, lambda h: self.cross_attn(h, memory, src_mask, cross_cache))
        return self.sub[2](x, self.ffn)  # (B, T, D)


class Transformer(nn.Module):
    """The encoder-decoder of Figure 1. `forward(src, tgt_in)` gives logits (B, T, V) for
    teacher forcing; `encode()` then `decode()` with a `new_cache()` decodes step by step."""

    def __init__(self, cfg: ModelConfig, vocab_size: int, pad_id: int = 0):
        super().__init__()
        self.cfg, self.pad_id = cfg, pad_id
        d = cfg.d_model
        # Section 3.4: one matrix for source embedding, target embedding and pre-softmax layer.
        embedding = lambda: nn.Embedding(vocab_size, d, padding_idx=pad_id)
        self.src_embed = embedding()
        self.tgt_embed = self.src_embed if cfg.share_embeddings else embedding()
        self.out_proj = Linear(d, vocab_size, bias=False)
        if cfg.share_embeddings:
            self.out_proj.weight = self.src_embed.weight
        # Table 3 row (E): learned positions instead of sinusoids, one table per side.
        learned = cfg.positional == "learned"
        self.src_pos = nn.Embedding(cfg.max_positions, d) if learned else None
        self.tgt_pos = nn.Embedding(cfg.max_positions, d) if learned else None
        # The sinusoids once, not at every forward; not saved (a function of the config).
        table = None if learned else sinusoidal(torch.arange(cfg.max_positions), d)
        self.register_buffer("sinusoids", table, persistent=False)
        self.dropout = Dropout(cfg.dropout)
        self.encoder = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.n_layers))
        self.decoder = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.n_layers))
        # Pre-norm leaves the residual stream unnormalised: normalise each stack's output.
        self.enc_norm = nn.LayerNorm(d) if cfg.norm_first else nn.Identity()
        self.dec_norm = nn.LayerNorm(d) if cfg.norm_first else nn.Identity()
        self._init_weights()

    def _init_weights(self) -> None:
        for m in self.modules():
            if isinstance(m, nn.Linear):
                # On the fused (3D, D) in_proj this bound equals fairseq's per-matrix Xavier
                # with gain 1/sqrt(2) for W^Q, W^K, W^V.
                nn.init.xavier_uniform_(m.weight)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
        # Embeddings N(0, D^-0.5): scaled by sqrt(D) (3.4) the input has unit scale, and a
        # logit, the dot product of a unit-scale (LayerNorm-ed) D-vector with a row, has
        # unit scale too; the tied matrix plays both roles. Learned positions: as fairseq.
        tables = [self.src_embed, self.tgt_embed, self.out_proj, self.src_pos, self.tgt_pos]
        for w in {t.weight for t in tables if t is not None}:
            nn.init.normal_(w, std=self.cfg.d_model**-0.5)
        with torch.no_grad():
            self.src_embed.weight[self.pad_id].zero_()
            self.tgt_embed.weight[self.pad_id].zero_()

    def _embed(self, tokens: Tensor, table: nn.Embedding, pos_table, offset: int | Tensor):
        # Section 3.4: embeddings times sqrt(D); 3.5: plus positions; 5.4: dropout on the sum.
        pe = self._positions(pos_table, offset, tokens.size(1))  # (T, D)
        return self.dropout(table(tokens) * self.cfg.d_model**0.5 + pe)  # (B, T, D)

    def _positions(self, pos_table, offset: int | Tensor, t: int) -> Tensor:
        """Rows offset .. offset + t - 1 of the position table (T, D). `offset` may be a 0-dim
        device tensor (a decoding step replayed as a CUDA graph): rows by index, no sync."""
        rows = self.sinusoids if pos_table is None else pos_table.weight
        if isinstance(offset, Tensor):  # a decoding step's one row: no arange
            index = offset.view(1) if t == 1 else offset + torch.arange(t, device=offset.device)
            return rows.index_select(0, index)
        if offset + t <= rows.size(0):
            return rows[offset : offset + t]
        if pos_table is not None:
            raise ValueError(
                f"sequence of {offset + t} positions exceeds model.max_positions "
                f"({self.cfg.max_positions}) of the learned position table"
            )
        return sinusoidal(torch.arange(offset, offset + t, device=rows.device), rows.size(1))

    def encode(self, src: Tensor) -> Tensor:
        src_mask = key_mask(src == self.pad_id, additive=False)
        x = self._embed(src, self.src_embed, self.src_pos, 0)
        for layer in self.encoder:
            x = layer(x, src_mask)
        return self.enc_norm(x)  # memory (B, S, D)

    def decode(
        self,
        tgt_in: Tensor,
        memory: Tensor,
        src_padding: Tensor,
        cache: KVCache | None = None,
        project: bool = True,
    ) -> Tensor:
        # Targets are right-padded, so the causal mask alone keeps real positions off the
        # padding; the loss ignores the outputs at padded positions. memory (B', S, D) and
        # src_padding (B', S) may have fewer rows than tgt_in (B, T): B = B' * g, and each
        # source row serves g consecutive target rows (beam search's hypotheses).
        offset = 0 if cache is None else cache.length
        x = self._embed(tgt_in, self.tgt_embed, self.tgt_pos, offset)  # (B, T, D)
        caches = [(None, None)] * len(self.decoder)
        if cache is not None:  # the new positions take their slots in the cache
            caches = cache.layers(tgt_in, memory)
        # The cache builds the source mask once for all steps.
        src_mask = key_mask(src_padding, False) if cache is None else cache.src_mask(src_padding)
        for layer, (self_cache, cross_cache) in zip(self.decoder, caches, strict=True):
            x = layer(x, memory, src_mask, self_cache, cross_cache)
        x = self.dec_norm(x)
        return self.out_proj(x) if project else x  # logits (B, T, V), or (B, T, D)

    def forward(self, src: Tensor, tgt_in: Tensor, project: bool = True) -> Tensor:
        """Teacher forcing: logits (B, T, V); with project=False the decoder's output
        (B, T, D), which the training loss projects chunk by chunk (loss.py)."""
        return self.decode(tgt_in, self.encode(src), src == self.pad_id, project=project)

    def set_dropout(self, p: float) -> None:
        """model.dropout's rate (embeddings, residuals) from the next forward pass on: the
        trainer sets train.cooldown_dropout for the cooldown."""
        residuals = (m.dropout for m in self.modules() if isinstance(m, Residual))
        for dropout in (self.dropout, *residuals):
            dropout.p = p

    def new_cache(self, max_len: int = 0, arena: Arena | None = None) -> KVCache:
        """An empty cache with room for `max_len` target positions (it grows past them),
        its buffers from `arena` if given (kv_cache.Arena)."""
        return KVCache(self.cfg.n_layers, max_len, arena)
