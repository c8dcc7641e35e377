"""The data stages before the vocabulary: a source's splits to parquet, then cleaning.

`sources.prepare_source` turns a hub dataset or local files into `{train,valid,test}.parquet`
with string columns `src` and `tgt`; `clean.clean_corpus` filters the training split. Both
write their output directory atomically (`transformer.files.atomic_dir`), so a killed run
leaves no directory that a rerun would trust.
"""

from transformer.cli import UserError

ROLES = ("train", "valid", "test")


class DataError(UserError, ValueError):
    """Input data is missing or malformed; the message names the file (and line)."""
