"""The Transformer of "Attention Is All You Need": a pure PyTorch library.

No Prefect, no MLflow here: the pipeline (tasks/, flows/) calls into this package.
"""
