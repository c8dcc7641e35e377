"""Training-step throughput of transformer.nn.model beside torch.nn.Transformer and Hugging
Face's MarianMTModel of the same dimensions.

A step is forward, the label-smoothed loss, backward (with --optimizer also the trainer's
Adam update) on synthetic batches shaped like WMT14 EN-DE training batches. The three models
get the same batches and the same loss, the trainer's (transformer.nn.loss: the output
projection fused with the loss over the non-pad targets), fed with each model's decoder
output and its own tied embedding matrix; embeddings are scaled by sqrt(D) with sinusoidal
positions in all three. So the ratios compare the encoder-decoder stacks. On CUDA the step
runs in bf16 autocast, as the trainer does (on a CPU with `--precision bf16`), and the table
adds MFU against PEAK_TFLOPS; all three run under transformer.nn.attention's choice of attention
kernels. Ours' update goes through transformer.training.precision.ComputeWeights (bf16 copies of the
matrix weights, with bf16), as the trainer's does.

    python -m benchmarks.model_step                             # smoke and base, CPU
    python -m benchmarks.model_step --configs base,big --max-tokens 8192,32768 --optimizer
    python -m benchmarks.model_step --configs multi30k --max-tokens 2048 --optimizer \
        --precision bf16                                        # a CPU with bf16 instructions
"""

from __future__ import annotations

import argparse
import functools
import gc
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor, nn

from benchmarks.measure import PEAK_TFLOPS, failure, print_columns, sync
from transformer.config import ModelConfig, Params, load_params
from transformer.nn.attention import attention_context
from transformer.nn.loss import label_smoothed_loss
from transformer.nn.model import Transformer, sinusoidal
from transformer.tokens import BOS, EOS, PAD
from transformer.training.optim import build_optimizer
from transformer.training.precision import ComputeWeights

PARAMS = Path(__file__).resolve().parents[1] / "params"
PEERS = ("ours", "torch", "marian")
# src (B, S), tgt_in (B, T), tgt_out (B, T), flat indices of the non-pad targets (N,)
Batch = tuple[Tensor, Tensor, Tensor, Tensor]


class Ours(nn.Module):
    """transformer.nn.model, returning the decoder's output as the trainer's loss takes it."""

    def __init__(self, cfg: ModelConfig, vocab_size: int):
        super().__init__()
        self.model = Transformer(cfg, vocab_size, PAD)
        self.out_weight = self.model.out_proj.weight

    def forward(self, src: Tensor, tgt_in: Tensor) -> Tensor:
        return self.model(src, tgt_in, project=False)  # (B, T, D)


class TorchTransformer(nn.Module):
    """torch.nn.Transformer with the same embeddings and output matrix as ours."""

    def __init__(self, cfg: ModelConfig, vocab_size: int):
        super().__init__()
        self.d_model = cfg.d_model
        self.embed = nn.Embedding(vocab_size, cfg.d_model, padding_idx=PAD)
        nn.init.normal_(self.embed.weight, std=cfg.d_model**-0.5)
        self.out_weight = self.embed.weight
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
        return self.core(
            self._embed(src),
            self._embed(tgt_in),
            tgt_mask=causal,
            tgt_is_causal=True,
            src_key_padding_mask=src_padding,
            memory_key_padding_mask=src_padding,
        )  # (B, T, D)


class Marian(nn.Module):
    """MarianMTModel, the architecture transformer.export writes, of the same dimensions."""

    def __init__(self, cfg: ModelConfig, vocab_size: int):
        super().__init__()
        from transformers import MarianMTModel

        from transformer.decoding.export import marian_config

        with torch.device("meta"):  # marian_config reads the sizes off a model
            shape = Transformer(cfg, vocab_size, PAD)
        self.marian = MarianMTModel(marian_config(shape))
        self.out_weight = self.marian.lm_head.weight

    def forward(self, src: Tensor, tgt_in: Tensor) -> Tensor:
        mask = (src != PAD).long()
        out = self.marian.model(input_ids=src, attention_mask=mask, decoder_input_ids=tgt_in)
        return out.last_hidden_state  # (B, T, D)


BUILD = {"ours": Ours, "torch": TorchTransformer, "marian": Marian}
LABELS = {"ours": "ours", "torch": "torch.nn.Transformer", "marian": "MarianMTModel"}


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
    tgt_out = tgt[:, 1:]  # y_1 .. y_n EOS
    return src, tgt_in, tgt_out, (tgt_out.flatten() != PAD).nonzero().squeeze(1)


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
    src, _, tgt_out, _ = batch
    s, t = (src != PAD).sum(1).double(), (tgt_out != PAD).sum(1).double()
    d, v, n_layers = model.cfg.d_model, model.out_proj.weight.size(0), model.cfg.n_layers
    count = lambda m: sum(p.numel() for p in m.parameters())
    linear = 6 * (count(model.encoder) * s.sum() + (count(model.decoder) + d * v) * t.sum())
    pairs = (s * s + t * (t + 1) / 2 + t * s).sum()
    return float(linear + 12 * d * n_layers * pairs)


def make_step(
    net: nn.Module, optimizer, bf16: bool, compile_layers: Callable | None = None
) -> Callable[[Batch], Tensor]:
    """One training step as the trainer's forward_loss makes it; returns the summed loss.
    Ours runs as the trainer runs it: forward and backward through ComputeWeights' net (bf16
    copies of its matrix weights with bf16 on), the loss against the fp32 tied matrix, the
    gradients back to the fp32 masters, Adam on those, the copies refreshed.
    `compile_layers` (ours only): compiles, in place, the module
    that runs the passes (transformer/training/compiled.py's), and the loss runs compiled."""
    device, ours = net.out_weight.device.type, isinstance(net, Ours)
    weights = ComputeWeights(net.model, enabled=bf16) if ours else None
    forward = net if weights is None else functools.partial(weights.net, project=False)
    if compile_layers is not None:
        if not ours:
            raise ValueError(f"compile_layers: ours only, not {type(net).__name__}")
        compile_layers(net.model if weights is None else weights.net)
    compiled = compile_layers is not None  # the loss's chunks too

    def step(batch: Batch) -> Tensor:
        src, tgt_in, tgt_out, positions = batch
        with torch.autocast(device, dtype=torch.bfloat16, enabled=bf16):
            hidden = forward(src, tgt_in)  # (B, T, D)
            rows = hidden.flatten(0, 1).index_select(0, positions)  # (N, D)
            targets = tgt_out.flatten().index_select(0, positions)
            loss, _ = label_smoothed_loss(rows, net.out_weight, targets, 0.1, compiled=compiled)
        (loss / positions.numel()).backward()
        if weights is not None:
            weights.grads_to_master()
        if optimizer is not None:
            optimizer.step()
        if weights is not None:
            weights.refresh()
        net.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def time_steps(steps: dict[str, Callable], batches: list[Batch], warmup: int, device):
    """Seconds each step function spends on batches[warmup:], or why it could not finish.
    The models take turns batch by batch, so that the changing load of a shared machine
    falls on all of them alike; one that fails (out of memory, or an error of its own)
    drops out, the others go on."""
    seconds: dict[str, float | str] = dict.fromkeys(steps, 0.0)
    for i, batch in enumerate(batches):
        for label, step in steps.items():
            if isinstance(seconds[label], str):
                continue
            try:
                sync(device)
                start = time.perf_counter()
                step(batch)
                sync(device)
            except Exception as err:
                seconds[label] = failure(err, batch)
            else:
                seconds[label] += (time.perf_counter() - start) * (i >= warmup)
                continue
            gc.collect()  # the failed step's activations, its traceback gone
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return seconds


def build(label: str, params: Params, device: torch.device, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    with torch.device(device):  # initialised where it runs: big models build in seconds
        return BUILD[label](params.model, params.vocab.size).train()


def measure(
    name: str,
    params: Params,
    device: torch.device,
    max_tokens: int,
    steps: int,
    warmup: int,
    peers: tuple[str, ...] = PEERS,
    optimizer: bool = True,
    seed: int = 1,
    bf16: bool | None = None,
) -> list[dict]:
    """One row per peer: throughput of `params`' model at `max_tokens` padded tokens per
    batch; a peer that cannot run here has a row whose `status` says why."""
    batches = wmt_like_batches(warmup + steps, max_tokens, params.vocab.size, seed)
    batches = [tuple(x.to(device) for x in b) for b in batches]
    nets, missing = {}, {}
    for label in peers:
        try:
            nets[label] = build(label, params, device, seed)
        except ImportError as err:
            missing[label] = f"skipped: {err.name} not installed"
        except Exception as err:  # a peer that cannot be built here: a finding, not the end
            missing[label] = failure(err)
    bf16 = device.type == "cuda" if bf16 is None else bf16
    step_fns = {}
    for label, net in nets.items():
        adam = build_optimizer(net, params.train, params.model.d_model)[0] if optimizer else None
        step_fns[label] = make_step(net, adam, bf16)
    with attention_context(device):  # the trainer's kernels, for the peers' SDPA calls too
        seconds = {**time_steps(step_fns, batches, warmup, device), **missing}
    timed = batches[warmup:]
    with torch.device("meta"):  # shapes only, for the FLOP count of all three
        shape = Transformer(params.model, params.vocab.size)
    flops = sum(step_flops(shape, b) for b in timed)
    common = {
        "config": name,
        "device": device.type,
        "precision": "bf16" if bf16 else "fp32",
        "max_tok": max_tokens,
        "steps": steps,
        "tgt_tok/step": sum(b[3].numel() for b in timed) / steps,
    }
    rows = [
        result(common, LABELS[label], trainable(nets.get(label)), seconds[label], flops)
        for label in peers
    ]
    del nets, step_fns
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def trainable(net: nn.Module | None) -> int | None:
    """Trained parameters (Marian's sinusoid tables are parameters that never train)."""
    return None if net is None else sum(p.numel() for p in net.parameters() if p.requires_grad)


def result(
    common: dict, model: str, n_params: int | None, seconds: float | str, flops: float
) -> dict:
    row = {**common, "model": model, "params": n_params}
    if isinstance(seconds, str):
        return {**row, "status": seconds}
    steps, tflops = common["steps"], flops / seconds / 1e12
    return {
        **row,
        "ms/step": 1000 * seconds / steps,
        "tgt_tok/s": common["tgt_tok/step"] * steps / seconds,
        "TFLOP/s": tflops,
        "MFU": tflops / PEAK_TFLOPS if common["device"] == "cuda" else None,
    }


def print_table(rows: list[dict]) -> None:
    cols = [
        "config",
        "model",
        "params",
        "max_tok",
        "tgt_tok/step",
        "ms/step",
        "tgt_tok/s",
        "TFLOP/s",
        "MFU",
    ]
    fmt = {
        "params": "{:,}",
        "tgt_tok/step": "{:.0f}",
        "ms/step": "{:.1f}",
        "tgt_tok/s": "{:,.0f}",
        "TFLOP/s": "{:.3f}",
        "MFU": "{:.1%}",
    }
    cells = [
        [r.get("status", "-") if r.get(c) is None else fmt.get(c, "{}").format(r[c]) for c in cols]
        for r in rows
    ]
    print_columns(cols, cells, right=True)


def ratios(rows: list[dict]) -> list[str]:
    """'base 32768: ours / torch.nn.Transformer = 1.31x target tokens/s' per measured peer."""
    lines = []
    for ours in (r for r in rows if r["model"] == "ours" and "tgt_tok/s" in r):
        for peer in rows:
            same = (peer["config"], peer.get("max_tok")) == (ours["config"], ours["max_tok"])
            if same and peer is not ours and "tgt_tok/s" in peer:
                ratio = ours["tgt_tok/s"] / peer["tgt_tok/s"]
                lines.append(
                    f"{ours['config']} {ours['max_tok']}: ours / {peer['model']} = "
                    f"{ratio:.2f}x target tokens/s"
                )
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default="smoke,base", help="names of params/*.yaml")
    p.add_argument("--steps", type=int, help="timed steps (default: GPU 30, CPU 10 or 2)")
    p.add_argument("--warmup", type=int, help="untimed steps first (default: GPU 5, CPU 1)")
    p.add_argument(
        "--max-tokens",
        help="padded tokens per batch, comma-separated "
        "(default: train.max_tokens; 1024 for big models on CPU)",
    )
    p.add_argument("--peers", default=",".join(PEERS), help=f"comma-separated, of {PEERS}")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--optimizer", action="store_true", help="include the Adam update")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument(
        "--precision",
        choices=("fp32", "bf16"),
        help="bf16: autocast, as the trainer's train.precision (default: bf16 on GPU, fp32 on "
        "CPU, where it pays only with bf16 instructions: transformer.nn.kernels.CPU_BF16)",
    )
    args = p.parse_args()
    device = torch.device(args.device)
    bf16 = (args.precision or ("bf16" if device.type == "cuda" else "fp32")) == "bf16"
    # nn.Transformer warns that it cannot use nested tensors with norm_first; irrelevant here.
    warnings.filterwarnings("ignore", module="torch.nn.modules.transformer")
    rows = []
    for name in args.configs.split(","):
        params = load_params(PARAMS / f"{name}.yaml")
        small = params.model.d_model < 256
        cuda = device.type == "cuda"
        steps = args.steps or (30 if cuda else 10 if small else 2)
        warmup = args.warmup if args.warmup is not None else (5 if cuda else 1)
        default = params.train.max_tokens if cuda or small else 1024
        for max_tokens in map(int, (args.max_tokens or str(default)).split(",")):
            rows += measure(
                name,
                params,
                device,
                max_tokens,
                steps,
                warmup,
                tuple(args.peers.split(",")),
                args.optimizer,
                args.seed,
                bf16,
            )
    precision = "bf16 autocast" if bf16 else "fp32"
    print(
        f"device {device} ({precision}), torch {torch.__version__}, "
        f"threads {torch.get_num_threads()}, optimizer step: {args.optimizer}"
    )
    print_table(rows)
    print(
        "FLOPs: 6 * non-embedding params * real tokens + 6 * D * V per target token "
        "+ attention 12 * D * (query, key) pairs per layer (causal pairs halved)"
    )
    print("\n".join(ratios(rows)))


if __name__ == "__main__":
    main()
