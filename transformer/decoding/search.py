"""Greedy and beam search over a batch of sentences, with the decoder's key/value cache.

The paper (section 6.1): beam size 4, length penalty alpha = 0.6, maximum output length =
input length + 50, "terminate early when possible". The length penalty is GNMT's,
lp(Y) = ((5 + |Y|) / 6)^alpha, and a finished hypothesis scores sum(log p) / lp(Y), where
|Y| counts the output tokens plus the final EOS and sum(log p) includes EOS's log-probability
(as tensor2tensor, the paper's code, counts them).

Rules of the search, per sentence (each is a choice among the standard ones):
- Lengths: src_len is the real source length (its subwords plus EOS, padding excluded); an
  output holds at most int(max_len_a * src_len + max_len_b) tokens besides EOS (and at most
  `max_len`, if given); at that length only EOS may follow, with the log-probability the
  model gives it (fairseq).
- Each step ranks the beam * V extensions of the live hypotheses by sum(log p). An EOS
  extension within the top beam_size is finished and kept aside (fairseq's rule, which
  makes beam 1 with alpha 0 exactly greedy search); the best beam_size non-EOS extensions
  stay live. PAD and BOS are never generated.
- Early stop (tensor2tensor's bound): with alpha >= 0 and log p <= 0, a live hypothesis of
  raw score s can at best finish with s / lp(limit + 1) (limit: the sentence's most output
  tokens), so a sentence is done once its n_best-th best finished score is at least the
  best live s / lp(limit + 1); then no live hypothesis can enter the returned n-best.
  It is also done at its maximum length.
  With early_stop="beam", a sentence is also done once beam_size of its hypotheses have
  finished, as fairseq, Marian and CTranslate2 (patience 1) stop: cheaper, and a longer
  hypothesis that would have won is then never found.

An ensemble (a list of models sharing the vocabulary) predicts the log of the mean of its
members' next-token probabilities, as fairseq and Marian do.

Two ways to run the same beam search, with the same rules and the same bookkeeping
(beams.py: the decoder over the hypotheses, `Beams`, `History`):
- shrinking: done sentences leave the batch and the cache (kv_cache.KVCache), and each
  step asks the host one question, which sentences are done. Under CUDA the model runs in
  bf16 autocast. The faster one on a CPU, where a step's work is mostly arithmetic that
  shrinks with the batch, and the host's reads cost nothing.
- static: every shape is fixed for the whole batch (kv_cache.StaticKVCache; done sentences
  stay, their n-best frozen), the step number is a 0-dim device tensor, and each step's
  bookkeeping runs on the device, so the host only asks "all done?" every few steps. Each
  step is then the same work on the same buffers: on CUDA it is captured in CUDA graphs
  and replayed (a GPU otherwise waits for a host issuing ~200 ops a step), in bf16
  autocast as the shrinking search. torch.compile compiles it once per batch shape
  (static_search.py).
`beam_search` picks one per device (`_static_by_default`).

Either way the encoder output and the encoder-decoder keys and values stay one row per
sentence, shared by its hypotheses, and the self-attention keys and values never move as
hypotheses are reordered; the finished n-best stay on the device, and the tokens of a
hypothesis are traced back through each step's parents once, at the end. Scores are fp32.
"""

from __future__ import annotations

import torch
from torch import Tensor

from transformer.decoding.beams import (
    Beams,
    Decoder,
    History,
    Hypothesis,
    decoding_context,
    output_limits,
    pick_n_best,
)
from transformer.decoding.static_search import StaticSearch
from transformer.nn.kv_cache import Arena, Shrink
from transformer.tokens import BOS, EOS


def _split(done: Tensor) -> Shrink | None:
    """The step's one host sync: None if no sentence is done, else which rows stay, in
    which order (the sentences' order changes: see Shrink), and which leave."""
    flags = done.tolist()
    return Shrink(flags, done.device) if any(flags) else None


def greedy_search(
    model,
    src: Tensor,
    max_len_a: float,
    max_len_b: int,
    max_len: int | None = None,
    cached: bool = True,
    arena: Arena | None = None,
) -> list[list[int]]:
    """The most probable next token until EOS, for each sentence of `src` (B, S), with a
    model or an ensemble (a list of models).

    Returns each sentence's output tokens without BOS/EOS, in the order of `src`.
    `cached=False` re-runs the decoder over the whole prefix each step (the reference).
    `arena`: memory for the cache that the caller keeps from batch to batch (kv_cache.Arena).
    """
    dev = src.device
    with decoding_context(dev):
        limit, shortest, longest = output_limits(src, max_len_a, max_len_b, max_len)
        out = torch.full((src.size(0), longest + 1), EOS, device=dev)  # tokens, EOS-padded
        sent = torch.arange(src.size(0), device=dev)  # sentence of each live row
        decoder = Decoder(model, src, longest, cached, arena=arena)
        tok = torch.full((src.size(0),), BOS, device=dev)
        for t in range(longest + 1):
            lprobs = decoder.log_probs(tok)  # (N, V)
            decoder.ban(lprobs, limit <= t if t >= shortest else None)
            tok = lprobs.argmax(dim=-1)  # (N,)
            out[sent, t] = tok
            shrink = _split(tok == EOS)
            if shrink is None:
                continue
            kept = shrink.kept
            if kept.numel() == 0:
                break
            tok, sent, limit = tok[kept], sent[kept], limit[kept]
            decoder.select(kept, shrink)
        return [row[: row.index(EOS)] for row in out.tolist()]


def beam_search(
    model,
    src: Tensor,
    beam_size: int,
    len_penalty: float,
    max_len_a: float,
    max_len_b: int,
    n_best: int = 1,
    max_len: int | None = None,
    cached: bool = True,
    early_stop: str = "exact",
    static: bool | None = None,
    restrict_attention: bool = True,
    arena: Arena | None = None,
) -> list[list[Hypothesis]]:
    """Beam search for each sentence of `src` (B, S), PAD-padded, each ending with EOS, with
    a model or an ensemble (a list of models).

    Returns, in the order of `src`, each sentence's best `n_best` hypotheses, best first
    (fewer only if the model gives EOS probability 0). The module docstring has the rules.
    `cached=False` re-runs the decoder over the whole prefix each step (the reference).
    `early_stop`: "exact" (no live hypothesis can still win) or "beam" (also done once
    beam_size hypotheses finished: fairseq's, Marian's and CTranslate2's rule).
    `static`: the static search (True) or the shrinking one (False); by default the
    device's (`_static_by_default`). The uncached reference is always the shrinking one.
    `restrict_attention=False` leaves torch its own choice of attention kernels instead of
    transformer/nn/attention.py's (what the GPU report measures that choice against).
    `arena`: memory for the shrinking search's caches that the caller keeps from batch to
    batch (kv_cache.Arena).
    """
    if not 1 <= n_best <= beam_size:
        raise ValueError(f"n_best ({n_best}) must lie in [1, beam_size ({beam_size})]")
    if len_penalty < 0:
        raise ValueError(f"len_penalty ({len_penalty}) < 0: the early-stop bound needs >= 0")
    if static and not cached:
        raise ValueError("the static search decodes with its cache: cached=False is shrinking")
    stop_at = beam_size if early_stop == "beam" else None
    args = (src, beam_size, len_penalty, max_len_a, max_len_b, n_best, max_len, stop_at)
    if static is None:
        static = cached and _static_by_default(src.device)
    if static:
        return StaticSearch.run(model, *args, restrict_attention=restrict_attention)
    return _shrinking_beam_search(model, *args, cached, restrict_attention, arena)


def _static_by_default(device: torch.device) -> bool:
    """The search `beam_search` runs unless told, chosen here alone: static on CUDA, where
    the shrinking search's GPU waits on its host (209 ops and a sync a step) and a CUDA
    graph replays a static step in one launch: several times the sentences/s
    (benchmarks/results/2026-11-27-h200-static-search/NOTES.md). Shrinking on a CPU, where the
    host's ops cost little beside the arithmetic, which shrinks as sentences leave and as
    KVCache drops the slots no hypothesis sees (the static step attends over all written
    ones): `python -m benchmarks.decode --threads 1 --modes beam,beam-static` compares them."""
    return device.type == "cuda"


def _shrinking_beam_search(
    model, src, k, alpha, max_len_a, max_len_b, n_best, max_len, stop_at, cached, restrict, arena
):
    dev, n = src.device, src.size(0)
    with decoding_context(dev, restrict):
        limit, shortest, longest = output_limits(src, max_len_a, max_len_b, max_len)
        beams, history = Beams(limit, k, n_best, alpha, stop_at, longest + 1), History()
        decoder = Decoder(model, src, longest, cached, arena=arena)
        # each step's EOS extensions, by the sentence's index in `src`; -inf where it left
        record = torch.full((longest + 1, 3, n, k), float("-inf"), device=dev)
        for t in range(longest + 1):
            lprobs = decoder.log_probs(beams.tok)  # (N * beams, V)
            decoder.ban(lprobs, beams.limit <= t if t >= shortest else None)
            live, *ended = beams.advance(lprobs, t)  # (N, k) each
            first = torch.arange(live.size(0), device=dev)[:, None] * (1 if t == 0 else k)
            ended[2] = first + ended[2]  # rows in this step's batch
            record[t].index_copy_(1, beams.sent, torch.stack(ended).to(record.dtype))
            rows = first + live
            shrink = _split(~beams.going_on())
            if shrink is not None:
                beams.keep(shrink.kept)
                if shrink.kept.numel() == 0:
                    break
                rows = rows[shrink.kept]
            history.append(rows.flatten(), beams.tok)
            decoder.select(rows.flatten(), shrink)
        return history.hypotheses(pick_n_best(record[: t + 1], n_best))
