"""Decoding: beam and greedy search, translating with an exported model, scoring a test
set, attention maps, export to serving formats. Uses nn/ and data/'s vocabulary; never the
trainer (an exported model is model_file.py's, on the ground floor)."""
