"""The network: the model of the paper (model.py), the kernels its products, attention and
dropout run on (kernels.py, attention.py), a decoding step's C loops on a CPU
(cpu_decoding.py), the decoding caches (kv_cache.py) and the loss fused with the output
projection (loss.py). Imports the ground floor only."""
