"""The proof's cuda-graphs: a whole update (forward, loss, backward, gradients to the fp32
masters, Adam with capturable=True, the bf16 copies refreshed) captured once per shape class
for two (B, S, T) classes, then replayed. Off CUDA the same update runs eagerly on the two
classes (so that it cannot rot) and the section says it is skipped."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from benchmarks.gpu_report.fixed_shapes import (
    batch_shapes,
    cycle,
    prepare,
    rates,
    rates_note,
    release,
)
from benchmarks.gpu_report.section import Ctx, Skipped
from benchmarks.measure import timed

GRAPH_LR = 1e-4  # the captured updates' constant learning rate (a graph holds its value)


def cuda_graphs(ctx: Ctx) -> None:
    """The whole update captured per shape class, replayed in turn."""
    for name in ctx.sizes.configs:
        ctx.add("", graph_case(ctx, name))
        release()
    ctx.note(
        "each class's update captured once (after two eager updates per class on a side "
        "stream), the classes' graphs sharing one memory pool, each replay on its class's one "
        f"batch; Adam fused and capturable, its learning rate a constant {GRAPH_LR:g}; loss: "
        "per target token, the first class's, before the timed updates and after them; "
        "eager tgt tok/s: the same update run eagerly on the same classes, after the graphs",
        rates_note(ctx),
    )
    if not ctx.cuda:
        raise Skipped(
            "CUDA graphs need a GPU (the rows: the same update run eagerly on the two classes)"
        )


def graph_case(ctx: Ctx, name: str) -> dict:
    params, batches, net = prepare(ctx, name)
    train = params.train
    adam = torch.optim.Adam(
        net.parameters(),
        lr=GRAPH_LR,
        betas=tuple(train.adam_betas),
        eps=train.adam_eps,
        fused=ctx.cuda,
        capturable=ctx.cuda,
    )
    step = ctx.tree.model_step.make_step(net, adam, ctx.cuda)
    ordered = sorted(batches, key=lambda b: (b[1].size(1), b[0].size(1)))
    classes = [ordered[0], ordered[-1]]  # the shortest and the longest
    start = time.perf_counter()
    with ctx.tree.model_step.attention_context(ctx.device):
        update = captured(step, classes) if ctx.cuda else cycle(step, classes)
    row = {"config": name, **batch_shapes(classes)}
    row["capture s"] = time.perf_counter() - start if ctx.cuda else None
    loss = lambda: update(0).item() / classes[0][3].numel()
    row["loss at start"] = loss()
    row.update(rates(ctx, update, classes, params, progress=f"{name}, graphs"))
    row["loss at end"] = loss()
    # The graphs' gain alone: the same update, eager, on the same classes (off CUDA both are).
    row["eager tgt tok/s"] = eager_rate(ctx, cycle(step, classes), classes)
    row["graphs / eager"] = row["tgt tok/s"] / row["eager tgt tok/s"]
    return row


def eager_rate(ctx: Ctx, update: Callable, classes: list) -> float:
    """Target tokens/s of `update` run eagerly: a warm-up round, then sizes.steps updates."""
    s = ctx.sizes
    with ctx.tree.model_step.attention_context(ctx.device):
        for i in range(len(classes)):
            update(i)
        seconds = timed(lambda: [update(i) for i in range(s.steps)], ctx.device)
    return sum(classes[i % len(classes)][3].numel() for i in range(s.steps)) / seconds


def captured(step: Callable, classes: list) -> Callable[[int], torch.Tensor]:
    """update(i): the graph of classes[i % n] replayed; its loss (the graph's output)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # Adam's state, the kernels' choices, the allocator's pools
        for batch in classes * 2:
            step(batch)
    torch.cuda.current_stream().wait_stream(side)
    graphs, pool = [], None
    for batch in classes:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            loss = step(batch)
        graphs.append((graph, loss))
        pool = graph.pool()

    def update(i: int) -> torch.Tensor:
        graph, loss = graphs[i % len(graphs)]
        graph.replay()
        return loss

    return update
