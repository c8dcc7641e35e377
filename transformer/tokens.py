"""The special token ids, the same in every vocabulary (data/vocab.py trains sentencepiece
with them), model and decoder: nothing needs a vocabulary object to know them."""

PAD, UNK, BOS, EOS = 0, 1, 2, 3
SPECIAL_IDS = {"pad": PAD, "unk": UNK, "bos": BOS, "eos": EOS}
