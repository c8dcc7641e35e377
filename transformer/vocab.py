"""The joint sentencepiece vocabulary and its fixed special ids.

The ids are fixed (not read from each model) so that shards, checkpoints and decoders agree
without passing a vocabulary object around; `learn_vocab` trains sentencepiece with them.
"""

PAD, UNK, BOS, EOS = 0, 1, 2, 3
SPECIAL_IDS = {"pad": PAD, "unk": UNK, "bos": BOS, "eos": EOS}
