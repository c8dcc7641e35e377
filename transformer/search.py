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
  It is also done at its maximum length. Done sentences leave the batch and the cache.
  With early_stop="beam", a sentence is also done once beam_size of its hypotheses have
  finished, as fairseq, Marian and CTranslate2 (patience 1) stop: cheaper, and a longer
  hypothesis that would have won is then never found.

Under CUDA the model runs in bf16 autocast; log_softmax and all scores are fp32.

An ensemble (a list of models sharing the vocabulary) predicts the log of the mean of its
members' next-token probabilities, as fairseq and Marian do.

How it stays fast: the encoder output and the encoder-decoder keys and values stay one row
per sentence, shared by its hypotheses, and the self-attention keys and values never move
as hypotheses are reordered (kv_cache.KVCache); each step asks the host one question, which
sentences are done; the finished n-best stay on the device, and the tokens of a hypothesis
are traced back through each step's parents once, at the end.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from transformer.attention import attention_context
from transformer.kv_cache import Shrink
from transformer.vocab import BOS, EOS, PAD


@dataclass(frozen=True)
class Hypothesis:
    tokens: list[int]  # without BOS and EOS
    score: float  # logprob / lp(len(tokens) + 1): what the search ranks by
    logprob: float  # sum of the token log-probabilities, EOS included


def length_penalty(length: Tensor | float, alpha: float) -> Tensor | float:
    """GNMT lp(Y) = ((5 + |Y|) / 6)^alpha; |Y| counts EOS."""
    return ((5.0 + length) / 6.0) ** alpha


def max_lengths(src: Tensor, max_len_a: float, max_len_b: int, cap: int | None) -> Tensor:
    """Per sentence: the most output tokens (EOS not counted), from the real source length;
    `cap` bounds them all (a learned position table has no row past its size)."""
    src_len = (src != PAD).sum(dim=1)
    limit = (max_len_a * src_len.double() + max_len_b).long()
    return limit if cap is None else limit.clamp(max=cap)


class _Decoder:
    """The decoder over the live hypotheses: one new token per row and step in, fp32
    log-probabilities of the next out. The encoder output stays one row per sentence;
    the sentence's hypotheses are consecutive rows that share it. Without the cache the
    decoder re-runs over the whole prefix every step (the reference the cache is tested
    against). An ensemble's members each have their memory and cache."""

    def __init__(self, model, src: Tensor, longest: int, cached: bool):
        self.models = model if isinstance(model, list | tuple) else [model]
        self.pad = src == PAD  # (N, S)
        self.memory = [m.encode(src) for m in self.models]  # (N, S, D) each
        # BOS and up to `longest` tokens
        self.caches = [m.new_cache(longest + 1) if cached else None for m in self.models]
        self.prefix: Tensor | None = None  # without the cache: the tokens so far (R, t)
        self.never = torch.tensor([PAD, BOS], device=src.device)  # never generated

    def log_probs(self, last: Tensor) -> Tensor:
        """last (R,): each row's newest token -> (R, V) log p of the next token."""
        tgt = last.unsqueeze(1)  # (R, 1)
        if self.caches[0] is None:
            tgt = self.prefix = tgt if self.prefix is None else torch.cat([self.prefix, tgt], 1)
        lprobs = [
            F.log_softmax(m.decode(tgt, memory, self.pad, cache)[:, -1].float(), dim=-1)
            for m, memory, cache in zip(self.models, self.memory, self.caches, strict=True)
        ]  # (R, V) each
        if len(lprobs) > 1:  # log of the mean probability
            lprobs = [torch.logsumexp(torch.stack(lprobs), dim=0) - math.log(len(lprobs))]
        return lprobs[0].index_fill_(1, self.never, float("-inf"))

    def select(self, rows: Tensor, shrink: Shrink | None) -> None:
        """Continue from rows `rows` (R',); `shrink` when sentences left the batch."""
        for cache in self.caches:
            if cache is not None:
                cache.reorder(rows, shrink)
        if self.prefix is not None:
            self.prefix = self.prefix[rows]
        if shrink is not None:
            self.memory = [shrink.apply(memory) for memory in self.memory]
            self.pad = shrink.apply(self.pad)


def _inference(device: torch.device):
    stack = contextlib.ExitStack()
    stack.enter_context(attention_context(device))  # no cuDNN plan per new key length
    if device.type == "cuda":
        # no_grad, not inference_mode: under inference_mode autocast keeps no cast weights
        # and would cast every weight to bf16 again at every step (tests/test_search.py).
        stack.enter_context(torch.no_grad())
        stack.enter_context(torch.autocast("cuda", dtype=torch.bfloat16))
    else:
        stack.enter_context(torch.inference_mode())
    return stack


def _force_eos(lprobs: Tensor, at_max: Tensor) -> None:
    """Rows at their maximum length may only end (in place, keeping EOS's log-probability)."""
    not_eos = torch.arange(lprobs.size(1), device=lprobs.device) != EOS  # (V,)
    lprobs.masked_fill_(at_max.unsqueeze(1) & not_eos, float("-inf"))


def _limits(src: Tensor, max_len_a: float, max_len_b: int, cap: int | None):
    """Each sentence's most output tokens (N,), and their minimum and maximum on the host."""
    limit = max_lengths(src, max_len_a, max_len_b, cap)
    shortest, longest = torch.stack([limit.min(), limit.max()]).tolist()
    return limit, shortest, longest


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
) -> list[list[int]]:
    """The most probable next token until EOS, for each sentence of `src` (B, S), with a
    model or an ensemble (a list of models).

    Returns each sentence's output tokens without BOS/EOS, in the order of `src`.
    `cached=False` re-runs the decoder over the whole prefix each step (the reference).
    """
    dev = src.device
    with _inference(dev):
        limit, shortest, longest = _limits(src, max_len_a, max_len_b, max_len)
        out = torch.full((src.size(0), longest + 1), EOS, device=dev)  # tokens, EOS-padded
        sent = torch.arange(src.size(0), device=dev)  # sentence of each live row
        decoder = _Decoder(model, src, longest, cached)
        tok = torch.full((src.size(0),), BOS, device=dev)
        for t in range(longest + 1):
            lprobs = decoder.log_probs(tok)  # (N, V)
            if t >= shortest:
                _force_eos(lprobs, limit <= t)
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


class _Beams:
    """The live sentences' beams: for each, its live hypotheses' sum of log p (BOS alone
    at first, then k hypotheses), and its best finished ones, best first, as (score,
    logprob, step, row) in float64 rows: the step it ended at and its row in that step's
    batch, from which `_History` traces its tokens. Finished hypotheses stay on the
    device; `final` holds those of done sentences."""

    def __init__(self, limit: Tensor, k: int, n_best: int, alpha: float, stop_at: int | None):
        n, dev = limit.size(0), limit.device
        self.k, self.alpha, self.stop_at = k, alpha, stop_at
        self.finished = torch.zeros(n, dtype=torch.long, device=dev)  # EOS extensions taken
        self.sent = torch.arange(n, device=dev)  # the batch index of each live sentence
        self.limit = limit  # (N,) most output tokens
        self.best_lp = length_penalty(limit.double() + 1, alpha).float()  # longest output's
        self.scores = torch.zeros(n, 1, device=dev)  # (N, beams): BOS's, log 1
        self.kept = torch.full((n, n_best, 4), float("-inf"), dtype=torch.float64, device=dev)
        self.final = self.kept.clone()

    def advance(self, lprobs: Tensor, t: int) -> tuple[Tensor, Tensor]:
        """Rank the extensions of step t; finish the EOS ones that enter the n-best.
        Returns the live hypotheses' rows in this step's batch, and their new tokens."""
        k = self.k
        top, rows, tok = _expand(self.scores, lprobs, k)  # (N, 2k) each, best first
        self._finish(top[:, :k], rows[:, :k], tok[:, :k], t)
        live = _live(tok, k)  # (N, k)
        self.scores = top.gather(1, live)
        return rows.gather(1, live), tok.gather(1, live)

    def _finish(self, top: Tensor, rows: Tensor, tok: Tensor, t: int) -> None:
        """Merge the EOS extensions among the best k into each sentence's n-best; a stable
        sort puts earlier ones first among equal scores."""
        score = top / length_penalty(t + 1.0, self.alpha)  # (N, k); |Y| = t tokens + EOS
        if self.stop_at is not None:
            self.finished += ((tok == EOS) & (top > float("-inf"))).sum(1)
        ends = (tok == EOS) & (score > self.kept[:, -1:, 0])  # -inf never enters
        score = score.masked_fill(~ends, float("-inf"))
        new = torch.stack([score, top, torch.full_like(top, t), rows.float()], dim=-1)
        both = torch.cat([self.kept, new.double()], dim=1)  # (N, n_best + k, 4)
        order = both[..., 0].sort(dim=1, descending=True, stable=True).indices
        n_best = self.kept.size(1)
        self.kept = both.gather(1, order[:, :n_best, None].expand(-1, -1, 4))

    def done(self, t: int) -> Tensor:
        """(N,) at the maximum length, or no live hypothesis can enter the n-best, or (with
        `stop_at`) that many hypotheses have finished."""
        bound = self.scores[:, 0] / self.best_lp
        done = (self.limit <= t) | (bound <= self.kept[:, -1, 0])
        return done if self.stop_at is None else done | (self.finished >= self.stop_at)

    def keep(self, kept: Tensor, gone: Tensor) -> None:
        self.final[self.sent[gone]] = self.kept[gone]
        self.sent, self.limit, self.best_lp = self.sent[kept], self.limit[kept], self.best_lp[kept]
        self.scores, self.kept = self.scores[kept], self.kept[kept]
        self.finished = self.finished[kept]


class _History:
    """Each step's live hypotheses as (row of their parent in that step's batch, new
    token): the tokens of a finished hypothesis are traced back once, at the end, instead
    of being copied into each step's batch."""

    def __init__(self):
        self.steps: list[Tensor] = []  # (2, R) per step

    def append(self, parents: Tensor, tokens: Tensor) -> None:
        self.steps.append(torch.stack([parents, tokens]))

    def hypotheses(self, final: Tensor) -> list[list[Hypothesis]]:
        """final (B, n, 4): each sentence's n best (score, logprob, step, row), -inf empty."""
        parents, tokens = torch.cat(self.steps, dim=1).tolist() if self.steps else ([], [])
        start = [0]
        for step in self.steps:
            start.append(start[-1] + step.size(1))
        out = []
        for kept in final.tolist():
            hyps = []
            for score, logprob, t, row in kept:
                if score == float("-inf"):
                    break
                toks, row = [], int(row)
                for s in range(int(t) - 1, -1, -1):
                    toks.append(tokens[start[s] + row])
                    row = parents[start[s] + row]
                hyps.append(Hypothesis(tokens=toks[::-1], score=score, logprob=logprob))
            out.append(hyps)
        return out


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
) -> list[list[Hypothesis]]:
    """Beam search for each sentence of `src` (B, S), PAD-padded, each ending with EOS, with
    a model or an ensemble (a list of models).

    Returns, in the order of `src`, each sentence's best `n_best` hypotheses, best first
    (fewer only if the model gives EOS probability 0). The module docstring has the rules.
    `cached=False` re-runs the decoder over the whole prefix each step (the reference).
    `early_stop`: "exact" (no live hypothesis can still win) or "beam" (also done once
    beam_size hypotheses finished: fairseq's, Marian's and CTranslate2's rule).
    """
    if not 1 <= n_best <= beam_size:
        raise ValueError(f"n_best ({n_best}) must lie in [1, beam_size ({beam_size})]")
    if len_penalty < 0:
        raise ValueError(f"len_penalty ({len_penalty}) < 0: the early-stop bound needs >= 0")
    k, dev = beam_size, src.device
    with _inference(dev):
        limit, shortest, longest = _limits(src, max_len_a, max_len_b, max_len)
        stop_at = k if early_stop == "beam" else None
        beams, history = _Beams(limit, k, n_best, len_penalty, stop_at), _History()
        decoder = _Decoder(model, src, longest, cached)
        tok = torch.full((src.size(0),), BOS, device=dev)  # newest tokens: one beam at first
        for t in range(longest + 1):
            lprobs = decoder.log_probs(tok)  # (N * beams, V)
            if t >= shortest:
                _force_eos(lprobs, (beams.limit <= t).repeat_interleave(1 if t == 0 else k))
            rows, tok = beams.advance(lprobs, t)  # (N, k) each
            shrink = _split(beams.done(t))
            if shrink is not None:
                beams.keep(shrink.kept, shrink.gone)
                if shrink.kept.numel() == 0:
                    break
                rows, tok = rows[shrink.kept], tok[shrink.kept]
            rows, tok = rows.flatten(), tok.flatten()
            history.append(rows, tok)
            decoder.select(rows, shrink)
        return history.hypotheses(beams.final)


def _expand(scores: Tensor, lprobs: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor]:
    """The best 2k of the beams * V extensions of each sentence's live hypotheses (beams:
    1 at the first step, which extends BOS alone, then k).

    Each beam has one EOS extension, so the best 2k hold at least k that are not EOS.
    Returns their sum of log p, their row in the (N * beams) batch, and their new token.
    """
    (n, beams), vocab = scores.shape, lprobs.size(-1)
    cand = scores.unsqueeze(-1) + lprobs.view(n, beams, vocab)  # (N, beams, V)
    top, idx = cand.view(n, -1).topk(min(2 * k, beams * vocab), dim=1)  # (N, 2k), best first
    rows = torch.arange(n, device=scores.device).unsqueeze(1) * beams + idx // vocab
    return top, rows, idx % vocab


def _live(tok: Tensor, k: int) -> Tensor:
    """Positions of the best k non-EOS extensions among the 2k, in their order."""
    rank = (tok == EOS).long() * tok.size(1) + torch.arange(tok.size(1), device=tok.device)
    return rank.topk(k, dim=1, largest=False).indices  # (N, k)
