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

Two ways to run the same beam search, with the same rules and the same bookkeeping (`_Beams`):
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
  (`_StaticSearch`).
`beam_search` picks one per device (`_static_by_default`).

Either way the encoder output and the encoder-decoder keys and values stay one row per
sentence, shared by its hypotheses, and the self-attention keys and values never move as
hypotheses are reordered; the finished n-best stay on the device, and the tokens of a
hypothesis are traced back through each step's parents once, at the end. Scores are fp32.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from transformer.nn import cpu_decoding
from transformer.nn.attention import attention_context
from transformer.nn.kernels import c_path, log_softmax_
from transformer.nn.kv_cache import Arena, Shrink, StaticKVCache
from transformer.tokens import BOS, EOS, PAD

# The static search asks the host whether all sentences are done once per this many steps
# on CUDA: each check is a sync, after which the GPU idles until the host launches again,
# and the steps run past a batch's last done sentence are wasted (base, H200: every 8
# steps ran 633 steps where 562 were needed, 11% wasted). On a CPU the read is free, and
# a wasted step is not: every step.
CHECK_EVERY = 4
CPU_CHECK_EVERY = 1


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
    """log_softmax over the vocabulary, in place where the logits are one block: a step's
    (R, V) logits are the largest tensor it makes, and on a CPU writing a new one costs
    more than the pass itself."""
    if not logits.is_contiguous():
        return F.log_softmax(logits, dim=-1)
    return log_softmax_(logits)


def _fp32(logits: Tensor) -> Tensor:
    return logits if logits.dtype == torch.float32 else logits.float()


def _dtype(memory: Tensor) -> torch.dtype:
    """The attention's dtype, for the static cache's masks: autocast's (a mask of another
    dtype would be cast at every attention call), else the memory's."""
    device = memory.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else memory.dtype


def _inference(device: torch.device, restrict_attention: bool = True):
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
    arena: Arena | None = None,
) -> list[list[int]]:
    """The most probable next token until EOS, for each sentence of `src` (B, S), with a
    model or an ensemble (a list of models).

    Returns each sentence's output tokens without BOS/EOS, in the order of `src`.
    `cached=False` re-runs the decoder over the whole prefix each step (the reference).
    `arena`: memory for the cache that the caller keeps from batch to batch (kv_cache.Arena).
    """
    dev = src.device
    with _inference(dev):
        limit, shortest, longest = _limits(src, max_len_a, max_len_b, max_len)
        out = torch.full((src.size(0), longest + 1), EOS, device=dev)  # tokens, EOS-padded
        sent = torch.arange(src.size(0), device=dev)  # sentence of each live row
        decoder = _Decoder(model, src, longest, cached, arena=arena)
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


class _Beams:
    """The sentences' beams: for each, its live hypotheses' sum of log p (`scores`: BOS
    alone at first, then k hypotheses) and newest tokens (`tok`), and the scores of its
    `n_best` best finished ones so far (`best`, for the early-stop bound). Each step's
    finished candidates go to a table (`advance`'s record) and each sentence's n-best is
    picked from it once, at the end (`_n_best`): the same as keeping it up to date, as a
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


def _n_best(record: Tensor, n_best: int) -> Tensor:
    """record (T, 3, N, k): each step's EOS extensions (score, -inf if not finished; sum
    of log p; row in the step's batch) -> each sentence's n best as (score, sum of log p,
    step, row) (N, n_best, 4), best first, the earlier first among equal scores."""
    steps, _, n, k = record.shape
    found = record.permute(2, 0, 3, 1).reshape(n, steps * k, 3)  # in the order they came
    order = found[..., 0].sort(dim=1, descending=True, stable=True).indices[:, :n_best]
    best = found.gather(1, order[..., None].expand(-1, -1, 3))  # (N, n_best, 3)
    step = (order // k).to(best.dtype)
    return torch.stack([best[..., 0], best[..., 1], step, best[..., 2]], dim=-1)


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
        return _StaticSearch.run(model, *args, restrict_attention=restrict_attention)
    return _shrinking_beam_search(model, *args, cached, restrict_attention, arena)


def _static_by_default(device: torch.device) -> bool:
    """The search `beam_search` runs unless told, chosen here alone: static on CUDA, where
    the shrinking search's GPU waits on its host (209 ops and a sync a step) and a CUDA
    graph replays a static step in one launch: 2.6-2.9x the sentences/s (base, 2000
    WMT-like sentences, H200: 1391-1418 against 477-547). Shrinking on a CPU, where the
    host's ops cost little beside the arithmetic, which shrinks as sentences leave and as
    KVCache drops the slots no hypothesis sees (the static step attends over all written
    ones): `python -m benchmarks.decode --threads 1 --modes beam,beam-static` compares them."""
    return device.type == "cuda"


def _shrinking_beam_search(
    model, src, k, alpha, max_len_a, max_len_b, n_best, max_len, stop_at, cached, restrict, arena
):
    dev, n = src.device, src.size(0)
    with _inference(dev, restrict):
        limit, shortest, longest = _limits(src, max_len_a, max_len_b, max_len)
        beams, history = _Beams(limit, k, n_best, alpha, stop_at, longest + 1), _History()
        decoder = _Decoder(model, src, longest, cached, arena=arena)
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
        return history.hypotheses(_n_best(record[: t + 1], n_best))


class _StaticSearch:
    """One batch's static beam search. After the first step (one row per sentence: BOS
    once) its state has fixed shapes and lives in fixed buffers: `step()` advances it by
    one step in place, from device tensors only (the step number `t` too), so that each
    call is the same work on the same memory: a CUDA graph replays it, torch.compile
    compiles it once (`run`'s `compile`)."""

    def __init__(self, model, src, k, alpha, limit, longest, n_best, stop_at):
        dev, n = src.device, src.size(0)
        self.t = torch.zeros((), dtype=torch.long, device=dev)  # the step; = cache.length
        self.k, self.n_best = k, n_best
        self.beams = _Beams(limit, k, n_best, alpha, stop_at, longest + 1, track_best=False)
        self.decoder = _Decoder(model, src, longest, True, static=(k, self.t))
        # Each step's new live hypotheses' parent and token, and its EOS extensions' score,
        # sum of log p and parent (parents among their sentence's rows): (steps, 5, N, k)
        self.record = torch.empty(longest + 1, 5, n, k, device=dev)

    def step(self) -> None:
        beams, t = self.beams, self.t
        lprobs = self.decoder.log_probs(beams.tok)  # (N * beams, V)
        self.decoder.ban(lprobs, beams.limit <= t)
        live, score, top, parent = beams.advance(lprobs, t)  # (N, k) each
        new = torch.stack([live, beams.tok.view(live.shape), score, top, parent])  # as floats
        self.record.index_copy_(0, t.view(1), new[None])
        self.decoder.select(live, None)
        t.add_(1)

    def results(self, steps: int) -> list[list[Hypothesis]]:
        """The hypotheses after `steps` steps: parents as rows of their step's batch (one row
        per sentence at step 0, k after), for _n_best and _History."""
        record = self.record[:steps]
        n, k = record.shape[2:]
        first = torch.arange(n, device=record.device)[:, None] * k  # (N, 1)
        first = torch.stack([first // k if s == 0 else first for s in range(steps)])
        history = _History()
        rows = (first[:, None] + record[:, [0, 4]]).long().flatten(2)  # (T, 2, N * k)
        tokens = record[:, 1].long().flatten(1)
        history.steps = list(torch.stack([rows[:, 0], tokens], dim=1).unbind(0))
        ended = torch.cat([record[:, 2:4], rows[:, 1, None].view(steps, 1, n, k).float()], 1)
        return history.hypotheses(_n_best(ended, self.n_best))

    def going_on(self, steps: int) -> Tensor:
        """(N,) the sentences not done after `steps` steps."""
        finished = self.record[:steps, 2].transpose(0, 1).flatten(1)  # (N, steps * k)
        return self.beams.going_on(finished.topk(self.n_best, dim=1).values[:, -1])

    def in_use(self, slots: int | None) -> None:
        """Steps attend over the first `slots` slots (None: all)."""
        for cache in self.decoder.caches:
            cache.in_use = slots

    def eager_step(self, t: int) -> None:
        """Step t, attending over the slots written so far only (its shapes change)."""
        self.in_use(1 + t * self.k)
        self.step()

    @classmethod
    def run(
        cls,
        model,
        src,
        k,
        alpha,
        max_len_a,
        max_len_b,
        n_best,
        max_len,
        stop_at,
        compile=None,
        restrict_attention=True,
    ):
        """The search; `compile`: torch.compile's backend for steps 1.. (tests count its
        compilations), instead of the device's way: eager steps on a CPU (attending over
        the slots written so far), a CUDA graph on CUDA."""
        dev = src.device
        cuda = dev.type == "cuda" and compile is None
        with _inference(dev, restrict_attention):  # on CUDA: bf16 autocast, as the shrinking search
            limit, _, longest = _limits(src, max_len_a, max_len_b, max_len)
            search = cls(model, src, k, alpha, limit, longest, n_best, stop_at)
            if cuda:
                step, every = _Replays(search), CHECK_EVERY
            elif compile is not None:
                compiled = torch.compile(
                    search.step, fullgraph=True, dynamic=False, backend=compile
                )
                step, every = lambda t: compiled(), 1
            else:
                step, every = search.eager_step, CPU_CHECK_EVERY
            if compile is None:
                step(0)  # fills the encoder-decoder keys and values: not replayable
            else:
                search.step()
            search.beams.pin()
            t = 1
            while t <= longest and search.going_on(t).any():  # the host's read
                for _ in range(min(every, longest + 1 - t)):
                    step(t)
                    t += 1
            return search.results(t)


class _Replays:
    """A static search's steps on CUDA, `step(t)`, as replays of one CUDA graph: one launch
    a step instead of a host issuing every op. Step 0 (its own shapes) and step 1 (the
    warm-up torch.cuda.graphs asks for before a capture: lazy initialisations, workspaces)
    run eagerly; then the step is captured (which runs nothing) and replayed. One graph of
    all slots: a graph per window of slots (attending over fewer) captured ~4 a batch and
    was 4% slower (base, H200: each capture costs an eager step's host time)."""

    def __init__(self, search: _StaticSearch):
        self.search, self.steps = search, 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self.side = torch.cuda.Stream()

    def __call__(self, t: int) -> None:
        self.steps += 1
        if self.steps == 1:
            self.search.step()
        elif self.steps == 2:
            self._on_side(self.search.step)
        else:
            if self.graph is None:
                self.graph = self._capture()
            self.graph.replay()

    def _on_side(self, work) -> None:
        """`work` on a side stream (a capture may not run on the default stream)."""
        self.side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.side):
            work()
        torch.cuda.current_stream().wait_stream(self.side)

    def _capture(self) -> torch.cuda.CUDAGraph:
        """torch.cuda.graph's capture without its synchronize and empty_cache (the host
        would wait for the GPU, and the allocator ask the driver for memory again)."""
        graph = torch.cuda.CUDAGraph()

        def capture() -> None:
            graph.capture_begin()
            try:
                self.search.step()
            finally:
                graph.capture_end()

        self._on_side(capture)
        return graph


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
