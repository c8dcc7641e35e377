"""The model on tiny configs: masks, cached decoding, attention, sizes, embeddings, training."""

from pathlib import Path

import pytest
import torch
from torch import nn

from transformer.config import ModelConfig, TrainConfig, load_params
from transformer.nn.kv_cache import Shrink
from transformer.nn.loss import label_smoothed_loss
from transformer.nn.model import MultiHeadAttention, Transformer, key_mask
from transformer.tokens import BOS, PAD
from transformer.training.optim import build_optimizer

PARAMS = Path(__file__).resolve().parents[1] / "params"
V = 50


# Tiny models gain nothing from threads (see conftest.one_thread).
pytestmark = pytest.mark.usefixtures("one_thread")


def tiny(**overrides) -> Transformer:
    cfg = ModelConfig(n_layers=2, d_model=32, n_heads=4, d_ff=64, **overrides)
    torch.manual_seed(0)
    return Transformer(cfg, V, pad_id=PAD).eval()


def tokens(*shape: int) -> torch.Tensor:
    return torch.randint(4, V, shape)  # no special ids, so no accidental padding


@torch.no_grad()
def test_future_target_tokens_do_not_change_earlier_logits():
    model, src, tgt = tiny(), tokens(2, 7), tokens(2, 6)
    changed = tgt.clone()
    changed[:, 3:] = tokens(2, 3)
    a, b = model(src, tgt), model(src, changed)
    torch.testing.assert_close(a[:, :3], b[:, :3])
    assert not torch.allclose(a[:, 3:], b[:, 3:])


@torch.no_grad()
@pytest.mark.parametrize("norm_first", [False, True])
def test_padding_leaves_real_positions_unchanged(norm_first):
    model, src, tgt = tiny(norm_first=norm_first), tokens(1, 5), tokens(1, 4)
    alone = model(src, tgt)
    pad = torch.full((1, 3), PAD)
    other_src, other_tgt = tokens(1, 8), tokens(1, 7)  # a longer neighbour forces padding
    batch = model(
        torch.cat([torch.cat([src, pad], 1), other_src]),
        torch.cat([torch.cat([tgt, pad], 1), other_tgt]),
    )
    torch.testing.assert_close(batch[:1, :4], alone, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(batch[1:], model(other_src, other_tgt), atol=1e-5, rtol=1e-5)


def decode_stepwise(model, src, tgt_in, chunks, reorder=None):
    """Decode `tgt_in` (B, T) with a cache, `chunks` positions per call; the B / B' rows of
    a source sentence (B' in `src`) share its memory. After the first call, optionally
    reorder the rows and the sources (rows, Shrink), as beam search does."""
    memory, src_padding = model.encode(src), src == PAD
    cache, out, start = model.new_cache(), [], 0  # no room reserved: the cache must grow
    for n in chunks:
        out.append(model.decode(tgt_in[:, start : start + n], memory, src_padding, cache))
        start += n
        assert cache.length == start
        if reorder is not None and len(out) == 1:
            rows, shrink = reorder
            cache.reorder(rows, shrink)
            kept = shrink.kept
            memory, src_padding, tgt_in = memory[kept], src_padding[kept], tgt_in[rows]
            out = [out[0][rows]]
    return torch.cat(out, dim=1)


@torch.no_grad()
@pytest.mark.parametrize(
    "overrides",
    [{}, {"norm_first": True}, {"positional": "learned", "max_positions": 16}],
    ids=["post-norm", "pre-norm", "learned-positions"],
)
def test_cached_decoding_equals_full_decoding(overrides):
    model = tiny(**overrides)
    src = tokens(3, 7)
    src[0, 5:] = PAD
    tgt_in = torch.cat([torch.full((3, 1), BOS), tokens(3, 5)], dim=1)
    full = model(src, tgt_in)
    for chunks in ([1] * 6, [3, 1, 2]):  # one position per call, or several (prefix forcing)
        torch.testing.assert_close(
            decode_stepwise(model, src, tgt_in, chunks), full, atol=1e-5, rtol=0
        )
    # Beam search: 2 hypotheses a sentence sharing its memory; then the middle sentence
    # leaves, the last one takes its place (its second hypothesis both of its places), and
    # the first one's two hypotheses swap.
    src2, tgt2 = src.repeat_interleave(2, dim=0), tgt_in.repeat_interleave(2, dim=0)
    tgt2[1::2, 2:] = tokens(3, 4)  # each sentence's two hypotheses differ after 2 positions
    shrink = Shrink([False, True, False], "cpu")
    assert shrink.kept.tolist() == [0, 2] and shrink.gone.tolist() == [1]
    rows = torch.tensor([1, 0, 5, 5])
    stepped = decode_stepwise(model, src, tgt2, [3, 1, 1, 1], reorder=(rows, shrink))
    torch.testing.assert_close(stepped, model(src2[rows], tgt2[rows]), atol=1e-5, rtol=0)


def test_sentences_leaving_move_only_the_rows_that_fill_their_places():
    """Rows 1 and 3 leave: the last two that stay take their places, in place; the rows
    before them stay where they are."""
    shrink = Shrink([False, True, False, True, False, False], "cpu")
    assert shrink.kept.tolist() == [0, 4, 2, 5] and shrink.gone.tolist() == [1, 3]
    t = torch.arange(2 * 6 * 3).view(2, 6, 3)
    expected = t[:, shrink.kept].clone()
    kept = shrink.apply(t, dim=1)
    assert torch.equal(kept, expected) and kept.data_ptr() == t.data_ptr()
    none_left = Shrink([True, True], "cpu")
    assert none_left.apply(torch.zeros(2, 5)).shape == (0, 5)


@torch.no_grad()
def test_target_rows_sharing_a_source_row_equal_their_own_copies():
    model, src, tgt = tiny(), tokens(3, 7), tokens(6, 5)
    src[1, 4:] = PAD
    memory, padding = model.encode(src), src == PAD
    shared = model.decode(tgt, memory, padding)  # rows 2i, 2i + 1 share source row i
    copies = model.decode(tgt, memory.repeat_interleave(2, 0), padding.repeat_interleave(2, 0))
    torch.testing.assert_close(shared, copies, atol=1e-5, rtol=0)


@torch.no_grad()
@pytest.mark.parametrize(
    "g, steps, reorder_until", [(3, 40, 40), (4, 160, 40)], ids=["short", "long"]
)
def test_cache_under_beam_search_reorders_equals_full_decoding(g, steps, reorder_until):
    """Two sentences of g rows. Each step (until `reorder_until`), every row continues a
    random row of its sentence, as beam search's hypotheses do: the cached step equals the
    full decoder over the rows' token histories. Dropped rows leave slots no row sees, which
    the cache compacts away; the long run passes 512 slots (SDPA's blocks of keys)."""
    model, src = tiny(), tokens(2, 6)
    memory, padding = model.encode(src), src == PAD
    history = torch.full((2 * g, 1), BOS)
    cache, gen = model.new_cache(steps), torch.Generator().manual_seed(0)
    for step in range(steps):
        out = model.decode(history[:, -1:], memory, padding, cache)[:, -1]  # (2g, V)
        if step % 11 == 0 or step == steps - 1:
            expected = model.decode(history, memory, padding)[:, -1]
            torch.testing.assert_close(out, expected, atol=1e-4, rtol=0)
        rows = torch.arange(2 * g)
        if step < reorder_until:
            rows = (torch.randint(0, g, (2, g), generator=gen) + torch.tensor([[0], [g]])).flatten()
            cache.reorder(rows)
        history = torch.cat([history[rows], torch.randint(4, V, (2 * g, 1), generator=gen)], 1)
    assert cache.length == steps and cache.compacted > 0 and (steps < 128 or cache.filled > 512)


@torch.no_grad()
def test_compaction_after_a_sentence_left_copies_only_the_slots_it_keeps():
    """A sentence leaves (its rows cut off the cache in place), then the cache compacts: the
    steps still equal the full decoder, and no copy is as large as a layer's keys and values
    together (index_select of a buffer that was no longer one block first copied it whole)."""
    from torch.profiler import profile

    model, src, g, steps = tiny(), tokens(3, 6), 2, 24
    memory, padding = model.encode(src), src == PAD
    history = torch.full((3 * g, 1), BOS)
    cache, gen = model.new_cache(steps), torch.Generator().manual_seed(0)
    with profile(record_shapes=True) as prof:
        for step in range(steps):
            out = model.decode(history[:, -1:], memory, padding, cache)[:, -1]
            shrink = Shrink([False, True, False], "cpu") if step == 2 else None  # 1 leaves
            kept = torch.arange(len(memory)) if shrink is None else shrink.kept
            memory, padding = memory[kept], padding[kept]
            pick = torch.randint(0, g, (len(kept), g), generator=gen)  # within each sentence
            rows = (kept[:, None] * g + pick).flatten()
            cache.reorder(rows, shrink)
            new = torch.randint(4, V, (len(rows), 1), generator=gen)
            history = torch.cat([history[rows], new], 1)
    assert cache.compacted > 0 and len(memory) == 2
    expected = model.decode(history[:, :-1], memory, padding)[:, -1]
    torch.testing.assert_close(out[rows], expected, atol=1e-4, rtol=0)
    whole = cache.self_attn[0].kv.numel()
    copied = [e.input_shapes[0] for e in prof.events() if e.name == "aten::copy_"]
    assert max(torch.Size(s).numel() for s in copied if s) <= whole // 2


@torch.no_grad()
def test_cached_steps_give_attention_keys_and_values_it_takes_without_a_copy(monkeypatch):
    """A step's batched attention products take the cache's keys and values as views: their
    (sentences, heads) dimensions merge into one. Keys interleaved with values per sentence,
    or heads left permuted, made every step copy every cached position first."""
    from transformer.nn import kernels
    from transformer.nn import model as model_module

    model, src, g = tiny(), tokens(2, 6), 4
    memory, padding = model.encode(src), src == PAD
    calls = []

    def spy(q, k, v, *args):
        for t in (k, v):
            t.view(-1, *t.shape[-2:])  # raises where the two dimensions do not merge
        calls.append(k.size(-2))
        return kernels.attention(q, k, v, *args)

    monkeypatch.setattr(model_module, "attention", spy)
    cache, swap = model.new_cache(8), torch.tensor([1, 0, 3, 2, 5, 4, 7, 6])  # within groups
    for _ in range(5):
        model.decode(torch.full((2 * g, 1), BOS), memory, padding, cache)
        cache.reorder(swap)
    assert len(calls) == 5 * 2 * len(model.decoder)  # self- and cross-attention, every layer


@torch.no_grad()
def test_attention_equals_torch_multihead_attention():
    torch.manual_seed(0)
    ours = MultiHeadAttention(32, 4, attn_dropout=0.0).eval()
    ref = nn.MultiheadAttention(32, 4, batch_first=True).eval()
    ref.in_proj_weight.copy_(ours.in_proj.weight)
    ref.in_proj_bias.copy_(ours.in_proj.bias)
    ref.out_proj.weight.copy_(ours.out_proj.weight)
    ref.out_proj.bias.copy_(ours.out_proj.bias)
    x, memory = torch.randn(2, 5, 32), torch.randn(2, 7, 32)
    padding = torch.tensor([[False] * 7, [False] * 4 + [True] * 3])
    expected, _ = ref(x, memory, memory, key_padding_mask=padding)
    for additive in (False, True):  # SDPA's mask kinds, both of which the model makes
        got = ours(x, memory, key_mask(padding, additive))
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    # Encoder self-attention (cross-attention's weight split must not matter) and masked.
    x_padding = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])
    expected, _ = ref(x, x, x, key_padding_mask=x_padding)
    got = ours(x, mask=key_mask(x_padding, additive=False))
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    ours.causal = True
    future = torch.ones(5, 5, dtype=torch.bool).triu(1)
    expected, _ = ref(x, x, x, attn_mask=future)
    torch.testing.assert_close(ours(x), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name, low, high", [("base", 61e6, 66e6), ("big", 208e6, 215e6)])
def test_parameter_counts_match_the_paper(name, low, high):
    cfg = load_params(PARAMS / f"{name}.yaml").model
    with torch.device("meta"):  # shapes only: no memory, no init cost
        model = Transformer(cfg, 37000)
    assert low <= sum(p.numel() for p in model.parameters()) <= high


def test_shared_embeddings_are_one_parameter():
    model = tiny()
    assert model.src_embed.weight is model.tgt_embed.weight is model.out_proj.weight
    assert model.src_embed.weight[PAD].abs().sum() == 0
    untied = tiny(share_embeddings=False)
    weights = {id(untied.src_embed.weight), id(untied.tgt_embed.weight), id(untied.out_proj.weight)}
    assert len(weights) == 3
    n_shared = sum(p.numel() for p in model.parameters())
    assert sum(p.numel() for p in untied.parameters()) == n_shared + 2 * V * 32


def test_learned_positions_reject_long_sequences():
    model = tiny(positional="learned", max_positions=8)
    with pytest.raises(ValueError, match="max_positions"):
        model(tokens(1, 9), tokens(1, 3))
    memory, cache = model.encode(tokens(1, 4)), model.new_cache()
    model.decode(tokens(1, 8), memory, torch.zeros(1, 4, dtype=torch.bool), cache)
    with pytest.raises(ValueError, match="max_positions"):
        model.decode(tokens(1, 1), memory, torch.zeros(1, 4, dtype=torch.bool), cache)


def smoothed_loss(model, src, tgt_in, tgt_out, eps):
    """(summed loss, number of target tokens), as the trainer computes them."""
    keep = tgt_out != PAD
    hidden = model(src, tgt_in, project=False)[keep]  # (N, D)
    loss, _ = label_smoothed_loss(hidden, model.out_proj.weight, tgt_out[keep], eps)
    return loss, keep.sum()


def test_bf16_autocast_trains():
    model = tiny(attn_dropout=0.1).train()
    src, tgt = tokens(2, 6), tokens(2, 5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert model(src, tgt).dtype == torch.bfloat16
        loss, n = smoothed_loss(model, src, tgt, tgt, eps=0.1)
    (loss / n).backward()
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_tiny_model_overfits_a_fixed_batch():
    model = tiny(dropout=0.0).train()
    src, tgt = tokens(4, 8), tokens(4, 8)
    tgt[2, 6:] = PAD
    tgt_in = torch.cat([torch.full((4, 1), BOS), tgt[:, :-1]], dim=1)
    cfg = TrainConfig(warmup_steps=30, lr_scale=0.5)
    optimizer, scheduler = build_optimizer(model, cfg, d_model=32)
    for _ in range(100):
        loss, n = smoothed_loss(model, src, tgt_in, tgt, eps=0.0)
        optimizer.zero_grad()
        (loss / n).backward()
        optimizer.step()
        scheduler.step()
    assert n == 30
    assert loss.item() / n.item() < 0.01  # from ln(50) = 3.9; reaches ~1e-3
