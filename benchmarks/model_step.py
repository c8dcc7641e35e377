"""Training-step throughput of transformer.model beside torch.nn.Transformer.

A step is forward, label-smoothed loss, backward (with --optimizer also an Adam update) on
synthetic batches shaped like WMT14 EN-DE training batches. Both models get the same
batches, loss, embeddings (tied, scaled by sqrt(D), sinusoidal positions) and output
projection, so the ratio compares the encoder-decoder stacks. On CUDA the step runs in
bf16 autocast, as the trainer does, and the table adds MFU against --peak-tflops.

    python benchmarks/model_step.py                             # smoke and base
    python benchmarks/model_step.py --configs base,big --device cuda --steps 50
"""

from __future__ import annotations

import argparse
import time
import warnings
from pathlib import Path

import torch
from torch import Tensor, nn

from transformer.config import ModelConfig, load_params
from transformer.loss import label_smoothed_nll
from transformer.model import Transformer, sinusoidal
from transformer.optim import build_optimizer
from transformer.vocab import BOS, EOS, PAD

PARAMS = Path(__file__).resolve().parents[1] / "params"
Batch = tuple[Tensor, Tensor, Tensor]  # src (B, S), tgt_in (B, T), tgt_out (B, T)


class TorchTransformer(nn.Module):
    """torch.nn.Transformer with the same embeddings and output projection as ours."""

    def __init__(self, cfg: ModelConfig, vocab_size: int):
        super().__init__()
        self.d_model = cfg.d_model
        self.embed = nn.Embedding(vocab_size, cfg.d_model, padding_idx=PAD)
        nn.init.normal_(self.embed.weight, std=cfg.d_model**-0.5)
        self.dropout = nn.Dropout(cfg.dropout)
        self.core = nn.Transformer(
            cfg.d_model,
            cfg.n_heads,
            cfg.n_layers,
            cfg.n_layers,
            cfg.d_ff,
            cfg.dropout,
            batch_first=True,
            norm_first=cfg.norm_first,
        )

    def _embed(self, tokens: Tensor) -> Tensor:
        pe = sinusoidal(torch.arange(tokens.size(1), device=tokens.device), self.d_model)
        return self.dropout(self.embed(tokens) * self.d_model**0.5 + pe)

    def forward(self, src: Tensor, tgt_in: Tensor) -> Tensor:
        src_padding = src == PAD
        causal = nn.Transformer.generate_square_subsequent_mask(tgt_in.size(1), src.device)
        h = self.core(
            self._embed(src),
            self._embed(tgt_in),
            tgt_mask=causal,
            tgt_is_causal=True,
            src_key_padding_mask=src_padding,
            memory_key_padding_mask=src_padding,
        )
        return h @ self.embed.weight.T  # (B, T, V)


def wmt_like_batches(n: int, max_tokens: int, vocab_size: int, seed: int) -> list[Batch]:
    """`n` batches as the trainer makes them: pairs bucketed by their longer side (buckets
    of 8 subwords) and packed up to `max_tokens` padded tokens, drawn at random so that a
    batch's length follows the corpus's token mass. Source lengths in subwords: lognormal,
    mean ~27, clipped to [1, 250] (WMT14 EN-DE after BPE); target/source ratio about 1."""
    g = torch.Generator().manual_seed(seed)
    src_len = torch.empty(50_000).log_normal_(3.12, 0.6, generator=g).clamp(1, 250).round()
    ratio = torch.empty(50_000).log_normal_(0.0, 0.15, generator=g)
    tgt_len = (src_len * ratio).clamp(1, 250).round()
    longest = torch.maximum(src_len, tgt_len).long() + 1  # + EOS (source), BOS/EOS (target)
    groups = []
    for width in range(0, 256, 8):
        idx = ((longest >= width) & (longest < width + 8)).nonzero().squeeze(1)
        groups += idx.split(max(1, max_tokens // (width + 7))) if len(idx) else []
    picks = torch.randint(len(groups), (n,), generator=g)
    return [make_batch(src_len[groups[i]], tgt_len[groups[i]], vocab_size, g) for i in picks]


def make_batch(src_len: Tensor, tgt_len: Tensor, vocab_size: int, g) -> Batch:
    src = random_sentences(src_len, vocab_size, g, bos=False)  # x_1 .. x_m EOS
    tgt = random_sentences(tgt_len, vocab_size, g, bos=True)  # BOS y_1 .. y_n EOS
    tgt_in = tgt[:, :-1].masked_fill(tgt[:, :-1] == EOS, PAD)  # BOS y_1 .. y_n
    return src, tgt_in, tgt[:, 1:]  # tgt_out: y_1 .. y_n EOS


def random_sentences(lengths: Tensor, vocab_size: int, g, bos: bool) -> Tensor:
    n = lengths.long() + 1 + int(bos)  # with EOS (and BOS)
    x = torch.randint(4, vocab_size, (len(n), int(n.max())), generator=g)  # (B, max n)
    x[torch.arange(len(x)), n - 1] = EOS
    if bos:
        x[:, 0] = BOS
    return x.masked_fill(torch.arange(x.size(1)) >= n[:, None], PAD)


def step_flops(model: Transformer, batch: Batch) -> float:
    """Model FLOPs of one training step on the batch's real (non-pad) tokens:
    6 * non-embedding params * tokens (encoder params on source tokens, decoder params on
    target tokens), plus 6 * D * V per target token for the output projection, plus
    attention, 12 * D per (query, key) pair per layer (QK^T and AV, 2 FLOPs per
    multiply-add, x3 for forward + backward): S^2 encoder, T(T+1)/2 masked, T*S cross."""
    src, _, tgt_out = batch
    s, t = (src != PAD).sum(1).double(), (tgt_out != PAD).sum(1).double()
    d, v, n_layers = model.cfg.d_model, model.out_proj.weight.size(0), model.cfg.n_layers
    count = lambda m: sum(p.numel() for p in m.parameters())
    linear = 6 * (count(model.encoder) * s.sum() + (count(model.decoder) + d * v) * t.sum())
    pairs = (s * s + t * (t + 1) / 2 + t * s).sum()
    return float(linear + 12 * d * n_layers * pairs)


def make_step(model: nn.Module, optimizer, device: torch.device):
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")

    def step(src: Tensor, tgt_in: Tensor, tgt_out: Tensor) -> None:
        with autocast:
            logits = model(src, tgt_in)
        loss, n = label_smoothed_nll(logits, tgt_out, 0.1, PAD)
        (loss / n).backward()
        if optimizer is not None:
            optimizer.step()
        model.zero_grad(set_to_none=True)

    return step


def time_steps(steps: list, batches: list[Batch], warmup: int, device) -> list[float]:
    """Seconds each step function spends on batches[warmup:]. The models take turns batch
    by batch, so that the changing load of a shared machine falls on all of them alike."""
    seconds = [0.0] * len(steps)
    for i, batch in enumerate(batches):
        for j, step in enumerate(steps):
            sync(device)
            start = time.perf_counter()
            step(*batch)
            sync(device)
            seconds[j] += (time.perf_counter() - start) * (i >= warmup)
    return seconds


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def bench_config(name: str, args, device: torch.device) -> list[dict]:
    params = load_params(PARAMS / f"{name}.yaml")
    cfg, vocab = params.model, params.vocab.size
    small = cfg.d_model < 256
    steps = args.steps or (30 if device.type == "cuda" else 10 if small else 2)
    warmup = args.warmup if args.warmup is not None else (5 if device.type == "cuda" else 1)
    max_tokens = args.max_tokens or (
        params.train.max_tokens if device.type == "cuda" or small else 1024
    )
    batches = wmt_like_batches(warmup + steps, max_tokens, vocab, args.seed)
    batches = [tuple(x.to(device) for x in b) for b in batches]
    timed = batches[warmup:]
    tokens = sum(int((b[2] != PAD).sum()) for b in timed)
    with torch.device("meta"):  # shapes only, for the FLOP count of both models
        shape = Transformer(cfg, vocab)
    flops = sum(step_flops(shape, b) for b in timed)
    models = {}
    for label, build in (("ours", Transformer), ("torch", TorchTransformer)):
        torch.manual_seed(args.seed)
        models[label] = build(cfg, vocab).to(device).train()
    optimizers = [
        build_optimizer(m, params.train, cfg.d_model)[0] if args.optimizer else None
        for m in models.values()
    ]
    step_fns = [make_step(m, o, device) for m, o in zip(models.values(), optimizers, strict=True)]
    timings = time_steps(step_fns, batches, warmup, device)
    rows = []
    for (label, model), seconds in zip(models.items(), timings, strict=True):
        tflops = flops / seconds / 1e12
        rows.append(
            {
                "config": name,
                "model": label,
                "params": sum(p.numel() for p in model.parameters()),
                "max_tok": max_tokens,
                "steps": steps,
                "tgt_tok/step": tokens / steps,
                "ms/step": 1000 * seconds / steps,
                "tgt_tok/s": tokens / seconds,
                "TFLOP/s": tflops,
                "MFU": tflops / args.peak_tflops,
            }
        )
    return rows


def print_table(rows: list[dict], show_mfu: bool) -> None:
    cols = [c for c in rows[0] if show_mfu or c != "MFU"]
    fmt = {
        "params": "{:,}",
        "tgt_tok/step": "{:.0f}",
        "ms/step": "{:.1f}",
        "tgt_tok/s": "{:,.0f}",
        "TFLOP/s": "{:.3f}",
        "MFU": "{:.1%}",
    }
    cells = [[fmt.get(c, "{}").format(r[c]) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    print("  ".join(c.rjust(w) for c, w in zip(cols, widths, strict=True)))
    for row in cells:
        print("  ".join(x.rjust(w) for x, w in zip(row, widths, strict=True)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default="smoke,base", help="names of params/*.yaml")
    p.add_argument("--steps", type=int, help="timed steps (default: GPU 30, CPU 10 or 2)")
    p.add_argument("--warmup", type=int, help="untimed steps first (default: GPU 5, CPU 1)")
    p.add_argument(
        "--max-tokens",
        type=int,
        help="padded tokens per batch (default: train.max_tokens; 1024 for big models on CPU)",
    )
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--optimizer", action="store_true", help="include the Adam update")
    p.add_argument("--peak-tflops", type=float, default=790.0, help="for MFU (bf16 dense)")
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args()
    device = torch.device(args.device)
    # nn.Transformer warns that it cannot use nested tensors with norm_first; irrelevant here.
    warnings.filterwarnings("ignore", module="torch.nn.modules.transformer")
    rows = [r for name in args.configs.split(",") for r in bench_config(name, args, device)]
    precision = "bf16 autocast" if device.type == "cuda" else "fp32"
    print(
        f"device {device} ({precision}), torch {torch.__version__}, "
        f"threads {torch.get_num_threads()}, optimizer step: {args.optimizer}"
    )
    print_table(rows, show_mfu=device.type == "cuda")
    print(
        "FLOPs: 6 * non-embedding params * real tokens + 6 * D * V per target token "
        "+ attention 12 * D * (query, key) pairs per layer (causal pairs halved)"
    )
    for ours, theirs in zip(rows[::2], rows[1::2], strict=True):
        ratio = ours["tgt_tok/s"] / theirs["tgt_tok/s"]
        print(f"{ours['config']}: ours / torch.nn.Transformer = {ratio:.2f}x target tokens/s")


if __name__ == "__main__":
    main()
