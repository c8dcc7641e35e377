"""The static beam search: every shape fixed for the whole batch, so that a step is the
same work on the same buffers, captured in a CUDA graph and replayed on CUDA, or compiled
once by torch.compile. The same rules and bookkeeping (beams.py) as the shrinking search
(search.py, whose docstring has the rules); `search.beam_search` picks one per device.
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

# The static search asks the host whether all sentences are done once per this many steps
# on CUDA: each check is a sync, after which the GPU idles until the host launches again,
# and the steps run past a batch's last done sentence are wasted (every 8 steps wasted
# too many: benchmarks/results/2026-11-27-h200-static-search/NOTES.md). On a CPU the read
# is free, and a wasted step is not: every step.
CHECK_EVERY = 4
CPU_CHECK_EVERY = 1


class StaticSearch:
    """One batch's static beam search. After the first step (one row per sentence: BOS
    once) its state has fixed shapes and lives in fixed buffers: `step()` advances it by
    one step in place, from device tensors only (the step number `t` too), so that each
    call is the same work on the same memory: a CUDA graph replays it, torch.compile
    compiles it once (`run`'s `compile`)."""

    def __init__(self, model, src, k, alpha, limit, longest, n_best, stop_at):
        dev, n = src.device, src.size(0)
        self.t = torch.zeros((), dtype=torch.long, device=dev)  # the step; = cache.length
        self.k, self.n_best = k, n_best
        self.beams = Beams(limit, k, n_best, alpha, stop_at, longest + 1, track_best=False)
        self.decoder = Decoder(model, src, longest, True, static=(k, self.t))
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
        per sentence at step 0, k after), for pick_n_best and History."""
        record = self.record[:steps]
        n, k = record.shape[2:]
        first = torch.arange(n, device=record.device)[:, None] * k  # (N, 1)
        first = torch.stack([first // k if s == 0 else first for s in range(steps)])
        history = History()
        rows = (first[:, None] + record[:, [0, 4]]).long().flatten(2)  # (T, 2, N * k)
        tokens = record[:, 1].long().flatten(1)
        history.steps = list(torch.stack([rows[:, 0], tokens], dim=1).unbind(0))
        ended = torch.cat([record[:, 2:4], rows[:, 1, None].view(steps, 1, n, k).float()], 1)
        return history.hypotheses(pick_n_best(ended, self.n_best))

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
        # On CUDA: bf16 autocast, as the shrinking search.
        with decoding_context(dev, restrict_attention):
            limit, _, longest = output_limits(src, max_len_a, max_len_b, max_len)
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
    all slots: a graph per window of slots (attending over fewer) was slower, each capture
    costing an eager step's host time (benchmarks/results/2026-11-27-h200-static-search/)."""

    def __init__(self, search: StaticSearch):
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
