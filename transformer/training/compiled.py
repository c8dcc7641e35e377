"""train.compile: each encoder and decoder layer compiled on its own (fullgraph), and the
loss's softmax and gradient per chunk (loss.py), as torchtitan compiles per block.

A layer is the unit that repeats: six layers of one kind share one compiled graph (the
parameters are the graph's inputs, not constants), so compiling is short and a new batch
shape recompiles two small graphs, not a whole model. Inside a layer the compiler fuses
what eager runs op by op: dropout, residual addition and LayerNorm; bias, ReLU and dropout;
the casts around each product. Between layers and around the loss the host still launches
the graphs one by one, which is what a CUDA graph of the whole update would remove.

Shapes: symbolic batch and length dimensions from the first batch (dynamic=True), so one
compilation serves every shape (length buckets' ~270 an epoch, or train.shape_classes'
16); static shapes would compile the first shape, then again with symbols at the second
(torch's automatic dynamic shapes): twice the compile time for the same kernels. A batch of
one row, and validation (no gradient), each compile once more. Without duck shaping: sizes
equal in the first batch (a source and a target length, often, with length buckets) would
become one symbol, and the next batch where they differ would compile again.
"""

from __future__ import annotations

from torch import nn
from torch.fx.experimental import _config as fx_config  # private: the only switch for duck shaping


def compile_layers(net: nn.Module) -> None:
    """Compile `net`'s encoder and decoder layers in place (the module, its parameters and
    its state_dict keys unchanged); the loss compiles when called with compiled=True."""
    fx_config.use_duck_shape = False  # process-wide: read when dynamo traces
    for layer in [*net.encoder, *net.decoder]:
        layer.compile(fullgraph=True, dynamic=True)


# What train.compile compiles: the encoder layer, the decoder layer, the loss's chunk.
COMPILED = 3


def compile_stats() -> dict[str, int]:
    """Dynamo's counts so far in this process: graphs compiled, recompilations (the graphs
    beyond one for each of the COMPILED functions; with no graph break each compilation
    makes one graph), graph breaks."""
    from torch._dynamo.utils import counters

    graphs = int(counters["stats"]["unique_graphs"])
    return {
        "graphs": graphs,
        "recompiles": max(0, graphs - COMPILED),
        "graph_breaks": int(sum(counters["graph_break"].values())),
    }
