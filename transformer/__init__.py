"""The Transformer of "Attention Is All You Need": a pure PyTorch library.

No Prefect, no MLflow here: the pipeline (tasks/, flows/) calls into this package. Four
wings over a ground floor (config/, files.py, model_file.py, tokens.py, console.py,
cli.py): nn/ (the network), data/ (corpus to shards), decoding/ and training/; the
commands (`python -m transformer.train`, `.translate`, `.average`, `.export`, `.evaluate`,
`.config`) are the modules of those names here.
"""
