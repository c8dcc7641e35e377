"""The GPU report and the GPU proof: two plans of sections, measured in one run each on a
GPU machine beside the project's targets, written to one folder as report.md and
report.json (rewritten after each section: a run stopped from outside keeps what it
finished). From the repository root, on the torch the machine has (nothing is installed):

    python -m benchmarks.gpu_report [--out DIR] [--device cuda|cpu] [--tiny] [--budget S]
        [--only SECTION ...]                                    # the report: make gpu-report
    python -m benchmarks.gpu_report --plan proof [...] [--limit SECTION=S ...]
        [--best-overrides K=V ...] [--baseline DIR]             # the proof: make gpu-proof

The folder defaults to benchmarks/results/<date>-<device>[-proof]/ and is printed at the
end. `--device cpu --tiny` runs every section's code on toy sizes in under a minute
(tests/test_gpu_report.py, tests/test_gpu_proof.py), so neither can rot between the times a
GPU is lent. A section degrades to "skipped: <why>" where a package or a device feature is
missing (a peer's row likewise), and one that fails says so without stopping the others.

The report (report.py; sections run in this process, under 9 minutes on one H100):
- environment: versions, the device, the host, and for each kind of attention call the
  SDPA backend that runs it and every backend's time (attention_backends.py);
- gpu tests: `pytest -m gpu` in a subprocess (gpu_tests.py);
- train step: a training step of base and big beside torch.nn.Transformer and
  MarianMTModel (train_step.py);
- train loop: transformer.train's own loop on synthetic shards (train_loop.py);
- decode: beam-4 sentences/s beside CTranslate2 and MarianMTModel.generate (decode.py);
- bf16 vs fp32: the loss curves of both precisions overfitting one batch (precision.py);
- checkpoint: seconds to save a training state of big and a model snapshot (checkpoint.py);
- profile: torch.profiler's ops and kernels of a training step and of beam search
  (profiling.py);
- train loop, compiled: the real loop under train.compile=true, with the time left.

The proof (proof.py, issue #47; each section in a process of its own under a time limit,
at most 8 minutes on one H100 or H200; `make gpu-baseline` first writes the base commit's
tree into .baseline/):
- environment: versions, nvidia-smi's clocks and power (machine.py);
- eager-before, eager-after: base and big updates on fixed batch shapes, the base
  commit's own code and today's (fixed_shapes.py; tree.py says how "before" runs);
- compile: the same with each layer compiled (compiled.py);
- cuda-graphs: a whole update captured per shape class, replayed (cuda_graphs.py);
- real-loop: the real loop with today's settings and the best (train_loop.py);
- beam: each of ours' searches, and on the CPU CTranslate2 (decode.py).

The runner (runner.py) runs either plan (plan.py: what a plan and a section are); a
section gets a Ctx and adds rows and notes to it (section.py); process.py runs one in a
process of its own; targets.py and markdown.py make the report's top and its text.
"""
