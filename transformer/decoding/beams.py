"""What the searches share (search.py's greedy and shrinking beam search, static_search.py):
the decoder over the live hypotheses with its cache, the beams' bookkeeping on the device,
and each step's parents, from which the finished hypotheses are traced back at the end.

The rules these implement (lengths, EOS, the length penalty, the early stop) are
search.py's docstring. Scores are fp32.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from transformer.nn import cpu_decoding
from transformer.nn.attention import attention_context
from transformer.nn.kernels import c_path, log_softmax_
from transformer.nn.kv_cache import Shrink, StaticKVCache
from transformer.tokens import BOS, EOS, PAD


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


class Decoder:
    """The decoder over the live hypotheses: one new token per row and step in, fp32
    log-probabilities of the next out. The encoder output stays one row per sentence;
    the sentence's hypotheses are consecutive rows that share it. Without the cache the
    decoder re-runs over the whole prefix every step (the reference the cache is tested
    against). An ensemble's members each have their memory and cache, its buffers from
    `arena` (kv_cache.Arena) where given. `static`: the static search's (beam size, step
    counter), for StaticKVCache."""

    def __init__(self, model, src: Tensor, longest: int, cached: bool, static=None, arena=None):
        self.models = model if isinstance(model, list | tuple) else [model]
        self.pad = src == PAD  # (N, S)
        self.memory = [m.encode(src) for m in self.models]  # (N, S, D) each
        if arena is not None:
            arena.rewind()
        # BOS and up to `longest` tokens
        self.caches = [m.new_cache(longest + 1, arena) if cached else None for m in self.models]
        if static is not None:
            k, step = static
            self.caches = [
                StaticKVCache(m.cfg.n_layers, src.size(0), k, longest + 1, step, _dtype(memory))
                for m, memory in zip(self.models, self.memory, strict=True)
            ]
        self.prefix: Tensor | None = None  # without the cache: the tokens so far (R, t)
        self.never = torch.tensor([PAD, BOS], device=src.device)  # never generated
        self.banned: Tensor | None = None  # (2, V): never generated; all but EOS

    def log_probs(self, last: Tensor) -> Tensor:
        """last (R,): each row's newest token -> (R, V) log p of the next token."""
        tgt = last.unsqueeze(1)  # (R, 1)
        if self.caches[0] is None:
            tgt = self.prefix = tgt if self.prefix is None else torch.cat([self.prefix, tgt], 1)
        lprobs = [
            _log_softmax_(_fp32(m.decode(tgt, memory, self.pad, cache)[:, -1]))
            for m, memory, cache in zip(self.models, self.memory, self.caches, strict=True)
        ]  # (R, V) each
        if len(lprobs) == 1:
            return lprobs[0]
        # The log of the mean probability; at most 0, as the early stop's bound assumes
        # (rounding could otherwise make it a hair positive where all members say EOS).
        mean = torch.logsumexp(torch.stack(lprobs), dim=0) - math.log(len(lprobs))
        return mean.clamp_(max=0.0)

    def ban(self, lprobs: Tensor, at_max: Tensor | None) -> None:
        """In place: PAD and BOS are never generated, and the rows of sentences at their
        maximum length (at_max (N,), or None for none; a sentence's rows are consecutive)
        may only end, keeping EOS's log-probability."""
        if at_max is None:
            lprobs.index_fill_(1, self.never, float("-inf"))
            return
        if self.banned is None:
            vocab = torch.arange(lprobs.size(1), device=lprobs.device)
            self.banned = torch.stack([(vocab == PAD) | (vocab == BOS), vocab != EOS])
        banned = torch.where(at_max[:, None, None], self.banned[1], self.banned[0])  # (N, 1, V)
        lprobs.view(at_max.size(0), -1, lprobs.size(1)).masked_fill_(banned, float("-inf"))

    def select(self, rows: Tensor, shrink: Shrink | None) -> None:
        """Continue from rows `rows` (R',); `shrink` when sentences left the batch. (The
        static caches take each new row's parent among its sentence's rows, (N, k).)"""
        for cache in self.caches:
            if cache is not None:
                cache.reorder(rows, shrink)
        if self.prefix is not None:
            self.prefix = self.prefix[rows]
        if shrink is not None:
            self.memory = [shrink.apply(memory) for memory in self.memory]
            self.pad = shrink.apply(self.pad)


def _log_softmax_(logits: Tensor) -> Tensor:
    """log_softmax over the vocabulary, in place: a step's (R, V) logits are the largest
    tensor it makes, and on a CPU writing a new one costs more than the pass itself. The
    uncached search's last position (a strided view) is copied first, so that both searches
    round alike: cpu_decoding's passes and torch's differ in the last bits on some CPUs."""
    return log_softmax_(logits.contiguous())


def _fp32(logits: Tensor) -> Tensor:
    return logits if logits.dtype == torch.float32 else logits.float()


def _dtype(memory: Tensor) -> torch.dtype:
    """The attention's dtype, for the static cache's masks: autocast's (a mask of another
    dtype would be cast at every attention call), else the memory's."""
    device = memory.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else memory.dtype


def decoding_context(device: torch.device, restrict_attention: bool = True):
    stack = contextlib.ExitStack()
    if restrict_attention:
        stack.enter_context(attention_context(device))  # no cuDNN plan per new key length
    if device.type == "cuda":
        # no_grad, not inference_mode: under inference_mode autocast keeps no cast weights
        # and would cast every weight to bf16 again at every step (tests/test_search.py).
        stack.enter_context(torch.no_grad())
        stack.enter_context(torch.autocast("cuda", dtype=torch.bfloat16))
    else:
        stack.enter_context(torch.inference_mode())
    return stack


def output_limits(src: Tensor, max_len_a: float, max_len_b: int, cap: int | None):
    """Each sentence's most output tokens (N,), and their minimum and maximum on the host."""
    limit = max_lengths(src, max_len_a, max_len_b, cap)
    shortest, longest = torch.stack([limit.min(), limit.max()]).tolist()
    return limit, shortest, longest


class Beams:
    """The sentences' beams: for each, its live hypotheses' sum of log p (`scores`: BOS
    alone at first, then k hypotheses) and newest tokens (`tok`), and the scores of its
    `n_best` best finished ones so far (`best`, for the early-stop bound). Each step's
    finished candidates go to a table (`advance`'s record) and each sentence's n-best is
    picked from it once, at the end (`pick_n_best`): the same as keeping it up to date, as a
    candidate that would not have entered the n-best then has n_best earlier ones at
    least as good, and cannot enter it later. Everything stays on the device.

    The shrinking search keeps the sentences still in the batch (`sent`: their index in
    it) and `best` up to date. The static search keeps them all, and finds `best` in its
    record when it checks for done sentences (`track_best` False: two ops a step saved);
    a done sentence's candidates cannot enter its n-best (the bound: scores only fall),
    except with `stop_at`, where they are masked. After its first step it `pin`s the
    state: each step then writes it in place, the same buffers."""

    def __init__(
        self,
        limit: Tensor,
        k: int,
        n_best: int,
        alpha: float,
        stop_at: int | None,
        steps: int,
        track_best: bool = True,
    ):
        n, dev = limit.size(0), limit.device
        self.k, self.stop_at, self.track_best = k, stop_at, track_best
        # lp(t + 1) of each step t: Python floats for a Python t, and, rounded to fp32 as a
        # Python scalar divisor is, a device table for a device t (the static search)
        self.lps = [length_penalty(t + 1.0, alpha) for t in range(steps)]
        self.lp = torch.tensor(self.lps, dtype=torch.float32, device=dev)
        self.sent = torch.arange(n, device=dev)  # the batch index of each sentence here
        self.limit = limit  # (N,) most output tokens
        self.best_lp = self.lp[limit]  # (N,) lp of the longest output
        self.scores = torch.zeros(n, 1, device=dev)  # (N, beams): BOS's, log 1
        self.tok = torch.full((n,), BOS, device=dev)  # (N * beams,)
        self.best = torch.full((n, n_best), float("-inf"), device=dev)
        self.finished = torch.zeros(n, dtype=torch.long, device=dev)  # EOS extensions taken
        self.minus_inf = torch.tensor(float("-inf"), device=dev)  # no op to make it a step
        self.pinned = False
        self.ranks: dict[int, tuple[Tensor, Tensor]] = {}  # for _live, per width

    def pin(self) -> None:
        """From now on, write the state in place (a CUDA graph replays fixed addresses)."""
        self.pinned = True

    def _out(self, t: Tensor) -> Tensor | None:
        return t if self.pinned else None

    def advance(self, lprobs: Tensor, t: int | Tensor) -> tuple[Tensor, ...]:
        """Rank the extensions of step t (a Python int, or a 0-dim device tensor).
        Returns each new live hypothesis' parent among its sentence's rows of this step
        (N, k), and the record of the EOS extensions among the best k: score (-inf for
        those not finished), sum of log p, parent (N, k) each."""
        k = self.k
        top, beam, tok = _expand(self.scores, lprobs, k)  # (N, 2k) each, best first
        eos = tok == EOS
        score = self._finish(top[:, :k], eos[:, :k], t)
        live = _live(eos, k, self.ranks)  # (N, k)
        self.scores = torch.gather(top, 1, live, out=self._out(self.scores))
        new = self.tok.view(live.shape) if self.pinned else None
        self.tok = torch.gather(tok, 1, live, out=new).view(-1)
        return beam.gather(1, live), score, top[:, :k], beam[:, :k]

    def _finish(self, top: Tensor, eos: Tensor, t: int | Tensor) -> Tensor:
        """The scores of the EOS extensions among the best k (-inf elsewhere); `best`
        takes them in."""
        if isinstance(t, int):
            score = top / self.lps[t]  # |Y| = t tokens + EOS
        else:
            score = top / self.lp.index_select(0, t.view(1))
        if self.stop_at is not None:  # a sentence done so stays as it is
            eos = eos & (self.finished < self.stop_at)[:, None]
            taken = (eos & (top > float("-inf"))).sum(1)
            self.finished = torch.add(self.finished, taken, out=self._out(self.finished))
        score = torch.where(eos, score, self.minus_inf)
        if self.track_best:
            both = torch.cat([self.best, score], dim=1)  # (N, n_best + k)
            self.best = both.topk(self.best.size(1), dim=1).values
        return score

    def going_on(self, best: Tensor | None = None) -> Tensor:
        """(N,) not done: a live hypothesis may still enter the n-best (at its maximum
        length a sentence's live hypotheses score -inf), and (with `stop_at`) fewer
        hypotheses than that have finished. `best`: the n_best-th best finished scores
        (N,), where `best` is not kept."""
        best = self.best[:, -1] if best is None else best
        going = self.scores[:, 0] / self.best_lp > best
        return going if self.stop_at is None else going & (self.finished < self.stop_at)

    def keep(self, kept: Tensor) -> None:
        """The sentences `kept` stay in the batch, in that order."""
        self.sent, self.limit, self.best_lp = self.sent[kept], self.limit[kept], self.best_lp[kept]
        self.scores, self.best = self.scores[kept], self.best[kept]
        self.finished = self.finished[kept]
        self.tok = self.tok.view(-1, self.k)[kept].view(-1)


def pick_n_best(record: Tensor, n_best: int) -> Tensor:
    """record (T, 3, N, k): each step's EOS extensions (score, -inf if not finished; sum
    of log p; row in the step's batch) -> each sentence's n best as (score, sum of log p,
    step, row) (N, n_best, 4), best first, the earlier first among equal scores."""
    steps, _, n, k = record.shape
    found = record.permute(2, 0, 3, 1).reshape(n, steps * k, 3)  # in the order they came
    order = found[..., 0].sort(dim=1, descending=True, stable=True).indices[:, :n_best]
    best = found.gather(1, order[..., None].expand(-1, -1, 3))  # (N, n_best, 3)
    step = (order // k).to(best.dtype)
    return torch.stack([best[..., 0], best[..., 1], step, best[..., 2]], dim=-1)


class History:
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


def _expand(scores: Tensor, lprobs: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor]:
    """The best 2k of the beams * V extensions of each sentence's live hypotheses (beams:
    1 at the first step, which extends BOS alone, then k).

    Each beam has one EOS extension, so the best 2k hold at least k that are not EOS.
    Returns their sum of log p, their parent's row among its sentence's rows (its beam),
    and their new token. `lprobs` may be overwritten (with the extensions' sums). On a CPU
    one pass in C (cpu_decoding.best_extensions), torch's add and topk elsewhere.
    """
    (n, beams), vocab = scores.shape, lprobs.size(-1)
    width = min(2 * k, beams * vocab)
    best = cpu_decoding.best_extensions(lprobs, scores, width) if c_path(lprobs) else None
    if best is None:
        cand = lprobs.view(n, beams, vocab).add_(scores.unsqueeze(-1))  # (N, beams, V), in place
        best = cand.view(n, -1).topk(width, dim=1)  # (N, 2k), best first
    top, idx = best
    return top, idx // vocab, idx % vocab


def _live(eos: Tensor, k: int, ranks: dict[int, tuple[Tensor, Tensor]]) -> Tensor:
    """Positions of the best k non-EOS extensions among the 2k (eos (N, 2k)), in order.
    `ranks` keeps each width's ranks, made once."""
    width = eos.size(1)
    if width not in ranks:
        order = torch.arange(width, device=eos.device)
        ranks[width] = (order, order + width)  # EOS ones after all others
    rank = torch.where(eos, ranks[width][1], ranks[width][0])
    return rank.topk(k, dim=1, largest=False).indices  # (N, k)
