"""The report's checkpoint: seconds to write a training state (model, Adam's moments,
schedule) and a model snapshot of the plan's model, as the trainer writes them."""

from __future__ import annotations

import shutil
import time

import torch

from benchmarks.gpu_report.plan import config
from benchmarks.gpu_report.section import Ctx
from transformer.config import to_dict
from transformer.nn.model import Transformer
from transformer.tokens import PAD
from transformer.training.checkpoint import CheckpointManager
from transformer.training.optim import build_optimizer


def checkpoint(ctx: Ctx) -> None:
    name = ctx.sizes.checkpoint
    params = config(name)
    torch.manual_seed(1)
    model = Transformer(params.model, params.vocab.size, PAD).to(ctx.device)
    adam, schedule = build_optimizer(model, params.train, params.model.d_model)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    adam.step()  # Adam's moments exist, as in any state after step 1
    manager = CheckpointManager(ctx.work / "checkpoints", 1, 0, higher_is_better=False)
    state = {
        "params": to_dict(params),
        "model": model.state_dict(),
        "optimizer": adam.state_dict(),
        "scheduler": schedule.state_dict(),
    }
    writes = {
        "training state": lambda: manager.save_state(1, state),
        "model snapshot": lambda: manager.snapshot(1, {}, model.state_dict(), None),
    }
    for what, write in writes.items():
        start = time.perf_counter()
        path = write()
        seconds = time.perf_counter() - start
        size = path.stat().st_size / 1e9
        row = {"config": name, "file": what, "GB": size, "seconds": seconds}
        ctx.add("", {**row, "GB/s": size / seconds})
    n_params = sum(p.numel() for p in model.parameters())
    shutil.rmtree(ctx.work / "checkpoints")  # gigabytes, in the report folder
    ctx.note(
        f"{n_params:,} parameters on {ctx.device.type}, written to {ctx.work} "
        "(inside the report folder: that disk) through transformer.training.checkpoint's "
        "CheckpointManager (atomic_save: torch.save, fsync, rename); the time includes the "
        "copy off the GPU"
    )
