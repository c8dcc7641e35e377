"""Training: the trainer and its parts (optimizer and schedule, validation, checkpoints,
metrics, the run folder's lifecycle, ranks, bf16 compute weights, compilation), and checkpoint
averaging. Uses nn/, data/ and decoding/ (validation decodes); nothing below imports it."""
