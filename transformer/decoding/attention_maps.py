"""Pictures of what the model attends to (the paper's Figures 3-5): for a sentence and its
translation, the encoder's self-attention and the decoder's encoder-decoder attention of
every layer, one panel per head.

The model computes attention with F.scaled_dot_product_attention, which returns no
weights; here each attention call's inputs are caught with a forward hook and the weights
recomputed from the module's own projections, softmax(Q K^T / sqrt(d_k)) (one sentence:
no padding to mask).
"""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display on servers and CI
import matplotlib.pyplot as plt
import torch
from torch import Tensor

from transformer.nn.model import MultiHeadAttention, Transformer
from transformer.tokens import BOS, EOS, PAD


def attention_weights(model: Transformer, src: list[int], tgt: list[int]) -> dict[str, Tensor]:
    """{"encoder.L": (h, S, S), "cross.L": (h, T, S)} for one sentence pair, teacher-forced
    (src and tgt end with EOS; the decoder reads [BOS] + tgt[:-1])."""
    captured: dict[str, Tensor] = {}

    def catch(name: str):
        def hook(module: MultiHeadAttention, args, kwargs) -> None:
            x = args[0] if args else kwargs["x"]
            memory = args[1] if len(args) > 1 else kwargs.get("memory")
            q, k, _ = module._project(x, memory, None)  # (1, h, T, d_k), (1, h, S, d_k)
            scores = q @ k.transpose(-1, -2) / math.sqrt(module.d_k)  # (1, h, T, S)
            captured[name] = scores.softmax(-1)[0]

        return hook

    handles = [
        layer.self_attn.register_forward_pre_hook(catch(f"encoder.{i}"), with_kwargs=True)
        for i, layer in enumerate(model.encoder)
    ] + [
        layer.cross_attn.register_forward_pre_hook(catch(f"cross.{i}"), with_kwargs=True)
        for i, layer in enumerate(model.decoder)
    ]
    try:
        was_training = model.training
        model.eval()
        with torch.no_grad():
            device = next(model.parameters()).device
            s = torch.tensor([src], device=device)
            t = torch.tensor([[BOS, *tgt[:-1]]], device=device)
            model(s, t)
        model.train(was_training)
    finally:
        for handle in handles:
            handle.remove()
    return {k: v.float().cpu() for k, v in captured.items()}


def plot_attention(weights: dict[str, Tensor], src: list[str], tgt: list[str], out_dir: Path):
    """One PNG per layer and kind (encoder-L.png: source x source; cross-L.png: target x
    source), a panel per head; returns the paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, w in weights.items():  # (h, rows, cols)
        kind, layer = name.split(".")
        rows = src if kind == "encoder" else tgt
        h = w.size(0)
        cols = min(h, 4)
        grid = (math.ceil(h / cols), cols)
        size = (2.2 + 0.22 * len(src) * cols, 1.2 + 0.22 * len(rows) * grid[0])  # inches
        fig, axes = plt.subplots(*grid, squeeze=False, figsize=size)
        for head, ax in enumerate(axes.flat):
            if head >= h:
                ax.axis("off")
                continue
            ax.imshow(w[head].numpy(), cmap="Blues", vmin=0.0, vmax=1.0, aspect="auto")
            ax.set_title(f"head {head + 1}", fontsize=8)
            ax.set_xticks(range(len(src)), src, rotation=90, fontsize=6)
            ax.set_yticks(range(len(rows)), rows, fontsize=6)
        title = "encoder self-attention" if kind == "encoder" else "encoder-decoder attention"
        fig.suptitle(f"{title}, layer {int(layer) + 1}", fontsize=9)
        fig.tight_layout()
        path = out_dir / f"{kind}-{int(layer) + 1}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths


def draw_sentence(model: Transformer, sp, source: str, translation: str, out_dir: Path):
    """Attention maps of `source` and the model's `translation` of it into `out_dir`."""
    src = [i for i in sp.encode(source) if i != PAD] + [EOS]
    tgt = [i for i in sp.encode(translation) if i != PAD] + [EOS]
    pieces = lambda ids: [sp.id_to_piece(i) for i in ids]
    return plot_attention(attention_weights(model, src, tgt), pieces(src), pieces(tgt), out_dir)
