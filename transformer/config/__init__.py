"""One typed, validated params tree for the whole pipeline.

`load_params("params/base.yaml", ["model.dropout=0.2"])` reads a YAML file (which may
`extends:` another and state only what differs), applies `dotted.key=value` overrides and
validates the result. Every error names the file and the dotted key, and
`python -m transformer.config` turns it into one line on stderr and exit code 2.
Key names follow the paper (`n_layers` = N, `d_model`, `d_ff`, `n_heads` = h, ...).

Three concerns, a module each, their names importable from here:

- `schema`: the sections and their keys, each declared identity-bearing or operational;
- `loading`: params files, `extends:`, overrides, one-line errors, the printer (`main`);
- `identities`: what names a result (identities, fingerprints, the run's params hash).
"""

from transformer.config.identities import (
    fingerprint,
    flatten,
    identity,
    operational_keys,
    params_hash,
    to_dict,
    to_yaml,
)
from transformer.config.loading import (
    MAX_EXTENDS,
    MAX_YAML_BYTES,
    ParamsError,
    load_params,
    main,
    params_from_dict,
    read_yaml,
)
from transformer.config.schema import (
    FOREIGN_SECTIONS,
    SEEDS,
    AverageConfig,
    CleanConfig,
    DataConfig,
    DecodeConfig,
    DistillConfig,
    ExportConfig,
    ExportFormat,
    ModelConfig,
    Params,
    Quantization,
    ScoreConfig,
    Section,
    ShardConfig,
    SourceConfig,
    SplitsConfig,
    TeachersConfig,
    TrainConfig,
    VocabConfig,
    added,
    operational,
    seed_field,
)

__all__ = [
    "FOREIGN_SECTIONS",
    "MAX_EXTENDS",
    "MAX_YAML_BYTES",
    "SEEDS",
    "AverageConfig",
    "CleanConfig",
    "DataConfig",
    "DecodeConfig",
    "DistillConfig",
    "ExportConfig",
    "ExportFormat",
    "ModelConfig",
    "Params",
    "ParamsError",
    "Quantization",
    "ScoreConfig",
    "Section",
    "ShardConfig",
    "SourceConfig",
    "SplitsConfig",
    "TeachersConfig",
    "TrainConfig",
    "VocabConfig",
    "added",
    "fingerprint",
    "flatten",
    "identity",
    "load_params",
    "main",
    "operational",
    "operational_keys",
    "params_from_dict",
    "params_hash",
    "read_yaml",
    "seed_field",
    "to_dict",
    "to_yaml",
]
