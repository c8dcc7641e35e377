"""Which kernels run F.scaled_dot_product_attention: a deliberate choice, not torch's default.

SDPA takes, per call, the first backend in its priority order that is enabled and whose
constraints the inputs meet. Since torch 2.9 (pytorch/pytorch#162073) that order puts cuDNN
attention first on sm90/sm100 (H100, B200) with a recent cuDNN. cuDNN builds an execution
plan per exact problem (batch, heads, query and key lengths, strides, mask, causal flag:
aten/src/ATen/native/cudnn/MHA.cpp caches plans under all of them, per thread), host time
at every new shape (what its first call costs on an H200: docs/results/gpu.md). This model
calls SDPA with a new shape all the time: a WMT epoch has ~280 (batch, length) shapes x 3
attention calls x forward and backward, and beam search has a new key length at every
step, so plan building would dominate training and decoding.

So on CUDA the order is fixed here (`CUDA_BACKENDS`), by what each call of model.py needs:
- flash: calls without a mask, the decoder's causal self-attention in training (SDPA's
  own triangle) and a beam of one; bf16/fp16 only;
- memory-efficient: calls with a mask (source padding in encoder self-attention and
  cross-attention, boolean; additive where decoding with the KV cache, and its
  visibility in beam search), and fp32 on GPU;
- math: anything else (a dtype or head size the fused kernels refuse), never an error.
cuDNN is left out. It is to be admitted only if the GPU report's attention section
(`benchmarks/gpu_report/attention_backends.py`) measures it faster at every call kind with
the cost of new shapes counted; then it goes into CUDA_BACKENDS at its place in the order,
with the measurement cited.

On CPU there is no cuDNN and torch's choice (its flash kernel, else math) stands: the
context is a no-op there.
"""

from __future__ import annotations

import contextlib
import inspect

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

# The deliberate choice, in priority order. Revise only with the GPU report's measurement
# on the GPU in question (benchmarks/gpu_report/attention_backends.py names the faster
# backend per call kind).
CUDA_BACKENDS = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)
# torch's CPU kernels: listed for `describe`, never restricted.
CPU_BACKENDS = (SDPBackend.FLASH_ATTENTION, SDPBackend.MATH)

NAMES = {
    SDPBackend.FLASH_ATTENTION: "flash",
    SDPBackend.EFFICIENT_ATTENTION: "memory-efficient",
    SDPBackend.CUDNN_ATTENTION: "cuDNN",
    SDPBackend.MATH: "math",
}

# torch < 2.6 has no set_priority: there the backends are only restricted, in torch's order.
_PRIORITY = "set_priority" in inspect.signature(sdpa_kernel).parameters


def backends(device: torch.device | str) -> list[SDPBackend]:
    """The SDPA backends for `device`, in priority order."""
    return list(CUDA_BACKENDS if torch.device(device).type == "cuda" else CPU_BACKENDS)


def attention_context(device: torch.device | str):
    """Enter around everything that runs the model on `device` (training, validation,
    decoding; under torch.compile, its first call too: the choice is traced then).
    A no-op off CUDA. The flags are process-wide, so the backward pass sees them too."""
    if torch.device(device).type != "cuda":
        return contextlib.nullcontext()
    if _PRIORITY:
        return sdpa_kernel(backends(device), set_priority=True)
    return sdpa_kernel(backends(device))


def describe(device: torch.device | str) -> str:
    """One line for a log: which backends, and why."""
    order = " > ".join(NAMES[b] for b in backends(device))
    if torch.device(device).type != "cuda":
        return f"attention: torch's CPU kernels ({order}); nothing to restrict off CUDA"
    cudnn = (
        "cuDNN admitted as measured faster"
        if SDPBackend.CUDNN_ATTENTION in CUDA_BACKENDS
        else "cuDNN left out: it builds a plan per exact shape, and every batch and "
        "beam-search step brings new shapes"
    )
    return f"attention: SDPA restricted to {order} (transformer/nn/attention.py); {cudnn}"
