"""Speed measurements, ours beside a peer in the same run. Each runs from the repository
root as a module, where the library is importable without installing the project (as on a
GPU machine's image, which has the checkout but not the package):

    python -m benchmarks.model_step        # a training step: ours, torch.nn.Transformer, Marian
    python -m benchmarks.decode            # beam search: ours, CTranslate2, MarianMTModel
    python -m benchmarks.train_throughput  # the real training loop
    python -m benchmarks.data_pipeline     # clean, encode + shard, batching
    python -m benchmarks.cpu_gemm          # the CPU's two matrix-product libraries
    python -m benchmarks.gpu_report        # on a GPU machine: the report (--plan proof: #47's)

results/ keeps what they measured, each folder with its NOTES. multi30k_sweep.py and
rdrop_sweep.sh are the drivers of two of those folders' GPU runs.
"""
