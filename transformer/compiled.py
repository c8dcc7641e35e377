"""train.compile: each encoder and decoder layer compiled on its own (fullgraph), and the
loss's softmax and gradient per chunk (loss.py), as torchtitan compiles per block.

A layer is the unit that repeats: six layers of one kind share one compiled graph (the
parameters are the graph's inputs, not constants), so compiling is short and a new batch
shape recompiles two small graphs, not a whole model. Inside a layer the compiler fuses
what eager runs op by op: dropout, residual addition and LayerNorm; bias, ReLU and dropout;
the casts around each product. Between layers and around the loss the host still launches
the graphs one by one, which is what a CUDA graph of the whole update would remove.

Shapes: the first batch compiles its exact shape; the next shape recompiles once with the
batch and length dimensions symbolic (torch's automatic dynamic shapes), which then serve
every later shape. Without duck shaping: sizes equal in that batch (a source and a target
length, often, with length buckets) would become one symbol, and the next batch where they
differ would compile again.
"""

from __future__ import annotations

from torch import nn
from torch.fx.experimental import _config as fx_config  # private: the only switch for duck shaping


def compile_layers(net: nn.Module) -> None:
    """Compile `net`'s encoder and decoder layers in place (the module, its parameters and
    its state_dict keys unchanged); the loss compiles when called with compiled=True."""
    fx_config.use_duck_shape = False  # process-wide: read when dynamo traces
    for layer in [*net.encoder, *net.decoder]:
        layer.compile(fullgraph=True)


def compile_stats() -> dict[str, int]:
    """Dynamo's counts so far in this process: graphs compiled, recompilations of a frame
    already compiled, graph breaks."""
    from torch._dynamo.utils import counters

    return {
        "graphs": int(counters["stats"]["unique_graphs"]),
        "recompiles": int(sum(counters["recompiles"].values())),
        "graph_breaks": int(sum(counters["graph_break"].values())),
    }
