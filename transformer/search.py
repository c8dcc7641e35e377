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

Under CUDA the model runs in bf16 autocast; log_softmax and all scores are fp32.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

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


class _Stepper:
    """Feeds one new token per row to the decoder and returns fp32 log-probabilities;
    without the cache it re-runs the decoder over the whole prefix every step."""

    def __init__(self, model, src: Tensor, rows: Tensor, cached: bool):
        self.model, self.cached = model, cached
        pad = src == PAD
        memory = model.encode(src)  # (B, S, D)
        self.memory, self.pad = memory[rows], pad[rows]  # (N, S, D), (N, S)
        self.cache = model.new_cache() if cached else None

    def log_probs(self, tokens: Tensor) -> Tensor:
        tgt = tokens[:, -1:] if self.cached else tokens
        logits = self.model.decode(tgt, self.memory, self.pad, self.cache)[:, -1]  # (N, V)
        lprobs = F.log_softmax(logits.float(), dim=-1)
        lprobs[:, [PAD, BOS]] = float("-inf")
        return lprobs

    def select(self, index: Tensor, shrink: bool) -> None:
        """Reorder rows; beams of one sentence share memory, so it moves only on shrink."""
        if self.cache is not None:
            self.cache.reorder(index)
        if shrink:
            self.memory, self.pad = self.memory[index], self.pad[index]


def _inference(device: torch.device):
    stack = contextlib.ExitStack()
    stack.enter_context(torch.inference_mode())
    if device.type == "cuda":
        stack.enter_context(torch.autocast("cuda", dtype=torch.bfloat16))
    return stack


def _force_eos(lprobs: Tensor, at_max: Tensor) -> None:
    """Rows at their maximum length may only end (in place, keeping EOS's log-probability)."""
    eos = lprobs[at_max, EOS].clone()
    lprobs[at_max] = float("-inf")
    lprobs[at_max, EOS] = eos


def greedy_search(
    model,
    src: Tensor,
    max_len_a: float,
    max_len_b: int,
    max_len: int | None = None,
    cached: bool = True,
) -> list[list[int]]:
    """The most probable next token until EOS, for each sentence of `src` (B, S).

    Returns each sentence's output tokens without BOS/EOS, in the order of `src`.
    `cached=False` re-runs the decoder over the whole prefix each step (the reference).
    """
    with _inference(src.device):
        out: list[list[int]] = [[] for _ in range(src.size(0))]
        sent = torch.arange(src.size(0), device=src.device)  # sentence of each live row
        limit = max_lengths(src, max_len_a, max_len_b, max_len)
        shortest = int(limit.min())
        step = _Stepper(model, src, sent, cached)
        tokens = torch.full((src.size(0), 1), BOS, dtype=torch.long, device=src.device)
        for t in range(int(limit.max()) + 1):
            lprobs = step.log_probs(tokens)  # (N, V)
            if t >= shortest:
                _force_eos(lprobs, limit <= t)
            tokens = torch.cat([tokens, lprobs.argmax(dim=-1, keepdim=True)], dim=1)
            done = tokens[:, -1] == EOS
            if not done.any():
                continue
            for s, toks in zip(sent[done].tolist(), tokens[done, 1:-1].tolist(), strict=True):
                out[s] = toks
            keep = (~done).nonzero().flatten()
            if keep.numel() == 0:
                break
            step.select(keep, shrink=True)
            tokens, sent, limit = tokens[keep], sent[keep], limit[keep]
            shortest = int(limit.min())
        return out


class _Finished:
    """The best n finished hypotheses of each sentence, kept aside (Python bookkeeping:
    only the few hypotheses that end at a step pass through here)."""

    def __init__(self, n_sentences: int, n_best: int, device: torch.device):
        self.n_best = n_best
        self.hyps: list[list[Hypothesis]] = [[] for _ in range(n_sentences)]
        # Per live sentence, the n_best-th best finished score; -inf while there are fewer.
        self.worst = torch.full((n_sentences,), float("-inf"), device=device)

    def add(self, live: list[int], sent: list[int], hyps: list[Hypothesis]) -> None:
        """hyps[j] ends sentence sent[j], which is live sentence (row of `worst`) live[j]."""
        changed: dict[int, float] = {}
        for i, s, hyp in zip(live, sent, hyps, strict=True):
            kept = self.hyps[s]
            kept.append(hyp)
            kept.sort(key=lambda h: -h.score)
            del kept[self.n_best :]
            if len(kept) == self.n_best:
                changed[i] = kept[-1].score
        if changed:
            rows = torch.tensor(list(changed), device=self.worst.device)
            self.worst[rows] = torch.tensor(list(changed.values()), device=self.worst.device)

    def keep(self, index: Tensor) -> None:
        self.worst = self.worst[index]


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
) -> list[list[Hypothesis]]:
    """Beam search for each sentence of `src` (B, S), PAD-padded, each ending with EOS.

    Returns, in the order of `src`, each sentence's best `n_best` hypotheses, best first
    (fewer only if the model gives EOS probability 0). The module docstring has the rules.
    `cached=False` re-runs the decoder over the whole prefix each step (the reference).
    """
    if not 1 <= n_best <= beam_size:
        raise ValueError(f"n_best ({n_best}) must lie in [1, beam_size ({beam_size})]")
    if len_penalty < 0:
        raise ValueError(f"len_penalty ({len_penalty}) < 0: the early-stop bound needs >= 0")
    k, dev = beam_size, src.device
    with _inference(dev):
        sent = torch.arange(src.size(0), device=dev)  # sentence of each live sentence
        limit = max_lengths(src, max_len_a, max_len_b, max_len)
        best_lp = length_penalty(limit.double() + 1, len_penalty).float()  # longest output's
        shortest = int(limit.min())
        finished = _Finished(src.size(0), n_best, dev)
        step = _Stepper(model, src, sent.repeat_interleave(k), cached)
        tokens = torch.full((src.size(0) * k, 1), BOS, dtype=torch.long, device=dev)  # (N*k, t)
        scores = torch.zeros(src.size(0), k, device=dev)  # (N, k) sum of log p, live ones
        scores[:, 1:] = float("-inf")  # at first the k beams are one: BOS
        for t in range(int(limit.max()) + 1):
            lprobs = step.log_probs(tokens)  # (N*k, V)
            if t >= shortest:
                _force_eos(lprobs, (limit <= t).repeat_interleave(k))
            top, rows, tok = _expand(scores, lprobs, k)  # (N, 2k) each, best first
            _finish(finished, top[:, :k], rows[:, :k], tok[:, :k], tokens, sent, t, len_penalty)
            live = _live(tok, k)  # (N, k)
            scores, rows, tok = top.gather(1, live), rows.gather(1, live), tok.gather(1, live)
            done = (limit <= t) | (scores[:, 0] / best_lp <= finished.worst)
            shrink = bool(done.any())
            if shrink:
                keep = (~done).nonzero().flatten()
                if keep.numel() == 0:
                    break
                scores, rows, tok = scores[keep], rows[keep], tok[keep]
                sent, limit, best_lp = sent[keep], limit[keep], best_lp[keep]
                finished.keep(keep)
                shortest = int(limit.min())
            step.select(rows.flatten(), shrink)
            tokens = torch.cat([tokens[rows.flatten()], tok.reshape(-1, 1)], dim=1)
        return finished.hyps


def _expand(scores: Tensor, lprobs: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor]:
    """The best 2k of the k * V extensions of each sentence's live hypotheses.

    Each beam has one EOS extension, so the best 2k hold at least k that are not EOS.
    Returns their sum of log p, their row in the (N * k) batch, and their new token.
    """
    n, vocab = scores.size(0), lprobs.size(-1)
    cand = scores.unsqueeze(-1) + lprobs.view(n, k, vocab)  # (N, k, V)
    top, idx = cand.view(n, k * vocab).topk(2 * k, dim=1)  # (N, 2k), best first
    rows = torch.arange(n, device=scores.device).unsqueeze(1) * k + idx // vocab
    return top, rows, idx % vocab


def _live(tok: Tensor, k: int) -> Tensor:
    """Positions of the best k non-EOS extensions among the 2k, in their order."""
    rank = (tok == EOS).long() * tok.size(1) + torch.arange(tok.size(1), device=tok.device)
    return rank.topk(k, dim=1, largest=False).indices  # (N, k)


def _finish(finished, top, rows, tok, tokens, sent, t: int, alpha: float) -> None:
    """Keep aside the EOS extensions among the best k that enter a sentence's n-best."""
    score = top / length_penalty(t + 1.0, alpha)  # (N, k); |Y| = t tokens + EOS
    ends = (tok == EOS) & (score > finished.worst.unsqueeze(1))  # -inf never enters
    if not ends.any():
        return
    live = ends.nonzero()[:, 0]
    hyps = [
        Hypothesis(tokens=toks, score=s, logprob=lp)
        for toks, s, lp in zip(
            tokens[rows[ends], 1:].tolist(), score[ends].tolist(), top[ends].tolist(), strict=True
        )
    ]
    finished.add(live.tolist(), sent[live].tolist(), hyps)
