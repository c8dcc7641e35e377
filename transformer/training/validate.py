"""Validation during training: loss and perplexity of the valid split, BLEU of its
decoding, and early stopping on the chosen metric.

valid/loss is the NLL per target token without label smoothing (natural log), over the
whole split shared out by rank; valid/ppl = exp(valid/loss), per subword as the paper's
4.92. valid/bleu is sacreBLEU of greedy (valid_beam 1) or beam decoding, scored on rank 0
and sent to every rank.
"""

from __future__ import annotations

import logging
import math
from contextlib import AbstractContextManager
from typing import Any

import torch

from transformer.config import Params
from transformer.console import PROGRESS_EVERY_S, Progress
from transformer.data.dataset import ShardDataset
from transformer.data.loader import BatchLoader
from transformer.data.sampler import TokenBatchSampler
from transformer.nn.kv_cache import Arena
from transformer.nn.loss import label_smoothed_loss
from transformer.nn.model import Transformer
from transformer.tokens import EOS, PAD
from transformer.training.distributed import (
    DistEnv,
    all_gather_objects,
    all_reduce_sum,
    broadcast_object,
)

log = logging.getLogger(__name__)


def validate(
    model: Transformer,
    valid: ShardDataset,
    sp,
    params: Params,
    env: DistEnv,
    autocast: AbstractContextManager,
    arena: Arena | None = None,
) -> dict[str, float]:
    model.eval()
    try:
        sums = torch.zeros(2, dtype=torch.float64, device=env.device)  # nll, tokens
        counted = 0  # target tokens, on the host: a tensor made of it each batch is a sync
        batches = valid_batches(valid, params, env)
        meter = progress("validation loss", batches, env)
        with torch.no_grad():
            for batch in batches:
                batch = batch.to(env.device)
                with autocast:
                    hidden = model(batch.src, batch.tgt_in, project=False)  # (B, T, D)
                rows = hidden.flatten(0, 1).index_select(0, batch.tgt_positions)
                targets = batch.tgt_out.flatten().index_select(0, batch.tgt_positions)
                _, nll = label_smoothed_loss(rows, model.out_proj.weight, targets, 0.0)
                sums[0] += nll.double()
                counted += batch.n_tgt_tokens
                meter.update(len(batch))
        meter.close()
        sums[1].fill_(counted)
        nll_sum, n_tokens = all_reduce_sum(sums).tolist()
        loss = nll_sum / n_tokens
        metrics = {"valid/loss": loss, "valid/ppl": math.exp(min(loss, 100.0))}
        if params.train.valid_bleu:
            metrics["valid/bleu"] = valid_bleu(model, valid, sp, params, env, arena)
        return metrics
    finally:
        model.train()


def valid_batches(valid: ShardDataset, params: Params, env: DistEnv) -> BatchLoader:
    # Valid sentences are not length-filtered: let the longest fit in a batch of its own.
    max_tokens = max(params.train.max_tokens, int(valid.lengths.max()))
    try:
        sampler = TokenBatchSampler.from_dataset(
            valid, max_tokens, shuffle=False, rank=env.rank, world_size=env.world_size
        )
    except ValueError as err:
        raise ValueError(f"valid split of {valid.shards_dir}: {err}") from None
    return BatchLoader(valid, sampler, epoch=0)


def progress(what: str, batches: BatchLoader, env: DistEnv) -> Progress:
    """Rank 0's progress through its share of the valid split: a line every
    PROGRESS_EVERY_S seconds (none for a quicker pass); silent on the other ranks."""
    total = sum(map(len, batches.sampler.epoch_batches(0))) if env.is_main else 0
    return Progress(what, total, "sentences", log, PROGRESS_EVERY_S)


def valid_bleu(
    model: Transformer, valid: ShardDataset, sp, params: Params, env: DistEnv, arena: Arena | None
) -> float:
    """Decode this rank's share (greedy, or beam train.valid_beam), gather, score on rank 0
    and send the score to every rank: each rank's early stopping and checkpoint choice read
    it, and must decide alike (a rank that stops alone leaves the others in a collective)."""
    from transformer.decoding.search import beam_search, greedy_search
    from transformer.decoding.translate import positions

    d, beam = params.decode, params.train.valid_beam
    max_len = positions([model]) - 1  # as translate: BOS, then at most this many tokens
    pairs, arena = [], Arena() if arena is None else arena  # the caches' memory, reused
    batches = valid_batches(valid, params, env)
    meter = progress("validation decoding", batches, env)
    for batch in batches:
        src = batch.src.to(env.device)
        if beam == 1:
            hyps = greedy_search(model, src, d.max_len_a, d.max_len_b, max_len, arena=arena)
        else:
            found = beam_search(
                model, src, beam, d.len_penalty, d.max_len_a, d.max_len_b, max_len=max_len,
                arena=arena,
            )  # fmt: skip
            hyps = [h[0].tokens if h else [] for h in found]
        refs = [[i for i in row if i not in (PAD, EOS)] for row in batch.tgt_out.tolist()]
        pairs += zip(batch.ids.tolist(), sp.decode(hyps), sp.decode(refs), strict=True)
        meter.update(len(batch))
    meter.close()
    return shared_bleu(pairs, env)


def shared_bleu(pairs: list[tuple[int, str, str]], env: DistEnv) -> float:
    """BLEU of every rank's (id, hypothesis, reference) pairs, in id order: scored on rank 0,
    the same number returned on every rank."""
    from transformer.decoding.evaluate import score  # sacrebleu: only when asked for

    gathered = all_gather_objects(pairs)
    bleu = None
    if env.is_main:
        ordered = sorted(p for part in gathered for p in part)
        bleu = float(score([h for _, h, _ in ordered], [r for _, _, r in ordered])["bleu"])
    return broadcast_object(bleu)


class EarlyStopping:
    """fairseq's --patience: training stops after `patience` validations in a row without a
    new best `valid/<metric>` (0: never). A stateful part of the trainer, so a resumed run
    keeps its counter and its best score."""

    def __init__(self, metric: str, patience: int):
        self.key, self.patience = f"valid/{metric}", patience
        self.higher_is_better = metric == "bleu"
        self.best: float | None = None
        self.best_step = 0
        self.bad = 0  # validations since the best

    @property
    def stopped(self) -> bool:
        return self.patience > 0 and self.bad >= self.patience

    def update(self, metrics: dict[str, float], step: int) -> bool:
        """Count a validation; True if it is a new best."""
        value = metrics[self.key]
        better = self.best is None or (
            value > self.best if self.higher_is_better else value < self.best
        )
        if better:
            self.best, self.best_step, self.bad = value, step, 0
        else:
            self.bad += 1
        return better

    def state_dict(self) -> dict[str, Any]:
        return {"key": self.key, "best": self.best, "best_step": self.best_step, "bad": self.bad}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["key"] != self.key:  # train.best_metric changed: its record means nothing
            log.warning("best metric is now %s (was %s): early stopping starts afresh",
                        self.key, state["key"])  # fmt: skip
            return
        self.best, self.best_step, self.bad = state["best"], state["best_step"], state["bad"]
