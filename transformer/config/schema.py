"""The params schema: one typed, validated section per stage, and `Params`, their tree.

Every key is declared here once, with a comment saying what it does, as identity-bearing
(the default: it changes a stage's output) or operational (`operational(...)`: cadence,
logging, workers, how long to train, where files are); `added(...)` marks a key added after
work dirs existed. `transformer.config.identities` reads these declarations. Key names
follow the paper (`n_layers` = N, `d_model`, `d_ff`, `n_heads` = h, ...).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.fields import FieldInfo


class Section(BaseModel):
    # Unknown keys are errors (a typo must never silently fall back to a default); strict
    # types (`max_steps: true` is no 1, `"3"` no 3); no float is .inf or .nan (no key means
    # either, and each fails far from its key: an IndexError in search, a run of non-finite
    # updates); a loaded tree is immutable, so the identities (identities.py) describe what
    # actually ran.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


def operational(default: Any, added: bool = False, **constraints: Any) -> Any:
    """Declare a key operational: it changes how a stage runs (cadence, logging, workers,
    how long to train, where files are), never what a finished stage holds. Every other key
    is identity-bearing. This one declaration is what stage folders, the trainer's resume
    check and the data fingerprint all read (`identity`, `operational_keys`). `added`: as
    for `added` below (operational keys are in the run's params hash)."""
    extra = {"operational": True, "added": added}
    return Field(default, json_schema_extra=extra, **constraints)


def added(default: Any, **constraints: Any) -> Any:
    """Declare an identity-bearing key (a plain value, not a section) added to a schema that
    work dirs already used, its default being what every run did before it existed. At that
    default it is left out of every identity (stage folders, the data fingerprint, the run's
    params hash), so adding it renames no finished stage: a work dir made before it resumes
    instead of training again. Its default can therefore never change."""
    return Field(default, json_schema_extra={"added": True}, **constraints)


def is_operational(info: FieldInfo) -> bool:
    return _marked(info, "operational")


def is_added(info: FieldInfo) -> bool:
    return _marked(info, "added")


def _marked(info: FieldInfo, mark: str) -> bool:
    extra = info.json_schema_extra
    return isinstance(extra, dict) and bool(extra.get(mark))


# Every seed fits every generator seeded from it: numpy's Generator and its legacy
# np.random.seed (given seed % 2**32) take no negative seed, torch.manual_seed no seed past
# 2**64 - 1; [0, 2**32) leaves room for the trainer's seed + rank and the cooldown branches'
# seed + i (Params checks those) and is the range fairseq's and Marian's --seed take.
SEEDS = 2**32


def seed_field() -> Any:
    return Field(1, ge=0, lt=SEEDS)


# --------------------------------------------------------------------------- data


class SourceConfig(Section):
    """Either a Hugging Face hub dataset at a pinned revision or a local path."""

    hub: str | None = None  # e.g. "wmt/wmt14"
    config: str | None = None  # e.g. "de-en"
    revision: str | None = None  # a commit of the hub repo, so the data cannot drift
    # A local folder of text files, or parquet/jsonl files, relative to the directory the
    # pipeline runs in. Where the files are is no identity: their sha256 is.
    path: str | None = operational(None)
    format: Literal["text", "parquet", "jsonl"] = "text"

    @model_validator(mode="after")
    def _one_source(self) -> SourceConfig:
        if (self.hub is None) == (self.path is None):
            raise ValueError("give exactly one of 'hub' (with config, revision) or 'path'")
        if self.hub is not None and (self.config is None or self.revision is None):
            missing = "config" if self.config is None else "revision"
            raise ValueError(f"{missing}: a hub source needs 'config' and a pinned 'revision'")
        return self


class SplitsConfig(Section):
    """Split names as the source spells them (hub: train/validation/test)."""

    train: str = "train"
    valid: str = "validation"
    test: str = "test"


class CleanConfig(Section):
    """Filters for the training split (valid/test are never filtered, only checked)."""

    min_len: int = Field(1, ge=1)  # whitespace tokens per side
    max_len: int = Field(250, ge=1)  # the usual WMT14 recipe (clean-corpus-n.perl)
    max_ratio: float = Field(1.5, gt=1.0)  # longer/shorter side, in tokens
    dedup: bool = False
    # Lowercase every split, both sides: a lowercased model (as the published Multi30k
    # systems), scored against lowercased references; translate lowercases its input.
    lowercase: bool = False

    @model_validator(mode="after")
    def _range(self) -> CleanConfig:
        if self.min_len > self.max_len:
            raise ValueError(f"min_len: {self.min_len} > max_len ({self.max_len})")
        return self


class DataConfig(Section):
    source: SourceConfig
    src_lang: str  # language codes as the source spells them (and sacremoses knows them)
    tgt_lang: str
    splits: SplitsConfig = SplitsConfig()
    # Mismatched line counts are always an error; a bad line (invalid UTF-8) either stops
    # the run, naming the file and the line, or is dropped and counted.
    on_invalid: Literal["error", "drop"] = "error"

    @model_validator(mode="after")
    def _langs(self) -> DataConfig:
        if self.src_lang == self.tgt_lang:
            raise ValueError(f"tgt_lang: src_lang and tgt_lang are both '{self.src_lang}'")
        return self


# --------------------------------------------------------------------------- vocab, shards


class VocabConfig(Section):
    size: int = Field(37000, ge=16)  # joint source-target vocabulary (paper: ~37k EN-DE)
    model_type: Literal["bpe", "unigram"] = "bpe"
    sample_size: int = Field(2_000_000, ge=1)  # sentences sampled to learn the BPE merges
    character_coverage: float = Field(1.0, gt=0.0, le=1.0)
    seed: int = seed_field()


class ShardConfig(Section):
    """Length-bucketed Arrow shards: a bucket holds pairs whose longer side (in subwords)
    falls in [k * bucket_width, (k + 1) * bucket_width)."""

    bucket_width: int = Field(8, ge=1)
    rows_per_shard: int = Field(200_000, ge=1)
    workers: int = operational(0, ge=0)  # encoding processes; 0 = all cores (at most the chunks)
    # BPE-dropout (Provilkov et al., 2020), a rate per side as OpenNMT's src/tgt_subword_alpha
    # and Marian's --sentencepiece-alphas: the training split is encoded `copies` times, each
    # merge skipped with that probability, every copy a fresh draw (not replayable: see
    # transformer/data/shard.py); valid and test as the decoder sees text.
    src_bpe_dropout: float = Field(0.0, ge=0.0, lt=1.0)
    tgt_bpe_dropout: float = Field(0.0, ge=0.0, lt=1.0)
    copies: int = Field(1, ge=1)

    @model_validator(mode="after")
    def _sampled(self) -> ShardConfig:
        if self.copies > 1 and not self.src_bpe_dropout and not self.tgt_bpe_dropout:
            raise ValueError(
                f"copies: {self.copies} identical copies; set src_bpe_dropout or "
                "tgt_bpe_dropout > 0"
            )
        return self


# --------------------------------------------------------------------------- model


class ModelConfig(Section):
    n_layers: int = Field(6, ge=1)  # N, encoder and decoder alike
    d_model: int = Field(512, ge=1)
    d_ff: int = Field(2048, ge=1)
    n_heads: int = Field(8, ge=1)  # h; d_k = d_v = d_model / h
    dropout: float = Field(0.1, ge=0.0, lt=1.0)  # P_drop: residual and embedding dropout
    attn_dropout: float = Field(0.0, ge=0.0, lt=1.0)  # on attention weights (not in paper)
    relu_dropout: float = Field(0.0, ge=0.0, lt=1.0)  # inside the FFN (not in paper)
    norm_first: bool = False  # False = the paper's post-norm LayerNorm(x + Sublayer(x))
    positional: Literal["sinusoidal", "learned"] = "sinusoidal"
    max_positions: int = Field(1024, ge=1)  # table size for learned positions
    share_embeddings: bool = True  # src emb = tgt emb = pre-softmax weights (paper 3.4)

    @model_validator(mode="after")
    def _heads(self) -> ModelConfig:
        if self.d_model % self.n_heads:
            raise ValueError(
                f"d_model: {self.d_model} is not divisible by n_heads ({self.n_heads})"
            )
        return self


# --------------------------------------------------------------------------- training


class TrainConfig(Section):
    # Paper 5.1: about 25k source + 25k target tokens per update. `batch_tokens` is that
    # update, all GPUs together (padding counted); `max_tokens` bounds one forward pass on
    # one GPU (memory). update_freq = ceil(batch_tokens / (GPUs x max_tokens)) micro-batches
    # of batch_tokens / (GPUs x update_freq) tokens: the same update on 1 GPU or 8.
    batch_tokens: int = Field(32768, ge=1)
    max_tokens: int = operational(32768, ge=1)
    max_steps: int = operational(100_000, ge=1)  # optimizer updates; raising it extends a run
    warmup_steps: int = Field(4000, gt=0)
    # Multiplies d_model^-0.5 * min(...) (paper: 1); past 100 no Transformer trains.
    lr_scale: float = Field(1.0, gt=0.0, le=100.0)
    # After the warmup: the paper's 1/sqrt(step) decay, or "constant" at the peak, which
    # with a cooldown is warmup-stable-decay (torchtitan's; Hagele et al. 2024): a run whose
    # length is set by its compute budget learns at the peak lr, then anneals at the end.
    decay: Literal["inverse_sqrt", "constant"] = "inverse_sqrt"
    # The last fraction of max_steps over which the lr falls to ~0 (paper: 0, none), linearly
    # or as 1 - sqrt (torchtitan's decay_type "sqrt"). It follows max_steps: raising
    # max_steps on resume moves the cooldown to the new end.
    cooldown: float = Field(0.0, ge=0.0, lt=1.0)
    cooldown_shape: Literal["linear", "1-sqrt"] = added("linear")
    # model.dropout (embeddings, residuals) during the cooldown; None: model.dropout to the
    # end. Lower, the anneal fits the data rather than regularises (Liu et al. 2023's
    # "early dropout", for models that underfit).
    cooldown_dropout: float | None = added(None, ge=0.0, lt=1.0)
    adam_betas: list[float] = Field([0.9, 0.98], min_length=2, max_length=2)
    adam_eps: float = Field(1e-9, gt=0.0)
    weight_decay: float = Field(0.0, ge=0.0)
    label_smoothing: float = Field(0.1, ge=0.0, lt=1.0)
    # R-Drop (Liang et al., 2021): each batch goes through the model twice, under two
    # dropout masks, and the loss adds rdrop_alpha / 4 times the symmetric KL of the two
    # passes' distributions (fairseq's --rdrop-alpha, its loss halved; 0: off). A step
    # costs what a batch twice as large does: batch_tokens and max_tokens count distinct
    # tokens, and a forward pass carries twice max_tokens.
    rdrop_alpha: float = added(0.0, ge=0.0)
    clip_norm: float = Field(0.0, ge=0.0)  # 0 = no clipping (the paper clips nothing)
    precision: Literal["fp32", "bf16"] = "bf16"  # bf16 autocast, fp32 masters; a CPU without
    # bf16 instructions (AVX512_BF16, AMX) trains in fp32 (transformer/nn/kernels.py)
    compile: bool = operational(False)  # torch.compile per layer, and the loss (compiled.py)
    # Static batch shapes, what torch.compile without recompiling and CUDA-graph capture
    # need: every training batch padded to one of at most this many (B, S, T) shapes, length
    # bands chosen from the corpus' lengths, source and target padded apart, a band's last
    # batch filled with padding rows (transformer/data/shape_classes.py). It pads
    # more than the length buckets (WMT-like lengths: 16 shapes, 0.87 of the padded tokens
    # real, against ~270 shapes and 0.94), so it pays only where static shapes make the step
    # faster. 0: the buckets' batches, each padded to its own longest source and target.
    # Operational, as max_tokens: it changes how the updates are cut, not the recipe; a
    # resume across a change continues at the same point of the epoch, with a warning.
    shape_classes: int = operational(0, added=True, ge=0)
    seed: int = seed_field()
    save_every: int = operational(1000, ge=1)  # steps between checkpoints
    keep_last: int = operational(5, ge=1)  # model snapshots kept for averaging
    keep_best: int = operational(1, ge=0)  # and the best ones by best_metric
    valid_every: int = operational(1000, ge=1)  # steps between validations
    valid_bleu: bool = operational(False)  # also decode the valid split for a BLEU curve
    valid_beam: int = operational(1, ge=1)  # its beam size: 1 is greedy (fast)
    # "Best" (the snapshots kept as best, early stopping, average.select=best): lowest
    # valid/loss or highest valid/bleu, as fairseq's --best-checkpoint-metric.
    best_metric: Literal["loss", "bleu"] = operational("loss")
    patience: int = operational(0, ge=0)  # stop after this many validations with no new best
    log_every: int = operational(100, ge=1)  # steps between training metrics
    max_bad_steps: int = operational(10, ge=1)  # non-finite updates in a row before stopping

    @model_validator(mode="after")
    def _checks(self) -> TrainConfig:
        if not all(0.0 <= b < 1.0 for b in self.adam_betas):
            raise ValueError(f"adam_betas: must lie in [0, 1), got {list(self.adam_betas)}")
        if self.best_metric == "bleu" and not self.valid_bleu:
            raise ValueError("best_metric: 'bleu' needs train.valid_bleu: true")
        if self.cooldown_dropout is not None and not self.cooldown:
            raise ValueError("cooldown_dropout: needs a cooldown (train.cooldown > 0)")
        return self


class AverageConfig(Section):
    last_n: int = Field(5, ge=1)  # paper: last 5 checkpoints (base), last 20 (big)
    select: Literal["last", "best"] = "last"  # the last N snapshots, or the N best
    # Cooldowns to average over (a model soup; Wortsman et al. 2022): 1, the run's own; k,
    # also k - 1 more, each a branch of the run from its state at the cooldown's start with
    # train.seed + i (another batch order), N snapshots from each. Each costs the cooldown's
    # updates again.
    cooldowns: int = added(1, ge=1)


class DecodeConfig(Section):
    beam_size: int = Field(4, ge=1)
    len_penalty: float = Field(0.6, ge=0.0)  # GNMT alpha: lp(Y) = ((5 + |Y|) / 6)^alpha
    # Max output length = a * src_len + b: search holds a cache of that many positions, so
    # the bounds keep it to what a translation can need (paper: a = 1, b = 50).
    max_len_a: float = Field(1.0, ge=0.0, le=10.0)
    max_len_b: int = Field(50, ge=0, le=4096)
    # When a sentence's beam search ends: "exact" once no live hypothesis can beat its best
    # finished ones (tensor2tensor, the paper's code); "beam" also once beam_size hypotheses
    # have finished (fairseq, Marian, CTranslate2): faster, may miss a longer better one.
    early_stop: Literal["exact", "beam"] = "exact"
    max_tokens: int = operational(8000, ge=1)  # source tokens per decoding batch


class ScoreConfig(Section):
    """What the decode stage reports beside sacreBLEU (cased, and lowercased) and chrF."""

    # The paper's EN-DE convention (tensor2tensor's get_ende_bleu.sh): tokenized BLEU with
    # compounds split. Only meaningful for German references.
    compound_split: bool = False
    # A folder holding the corpus's own tokenized references, `{split}.lc.norm.tok.{lang}`
    # (gzip allowed): BLEU on lowercased, punctuation-normalised, Moses-tokenized output, the
    # scale papers on that corpus quote (Multi30k). Relative to where the pipeline runs;
    # where it is is no identity: the files' sha256 is.
    tokenized_refs: str | None = operational(None)


ExportFormat = Literal["ctranslate2", "huggingface"]
# CTranslate2's weight types (ctranslate2.specs.model_spec.ACCEPTED_MODEL_TYPES).
Quantization = Literal[
    "int8", "int8_float32", "int8_float16", "int8_bfloat16", "int16", "float16", "bfloat16",
    "float32",
]  # fmt: skip


class ExportConfig(Section):
    """Serving formats written from the averaged model (transformer/decoding/export.py)."""

    formats: list[ExportFormat] = []
    quantization: Quantization | None = None  # CTranslate2 only; None: fp32, as trained


class TeachersConfig(Section):
    """The teachers of a distillation: seeds of one params file, each a pipeline run of its
    own (train, cooldowns, average, decode), or model files. Operational: what a teacher is
    reaches the student's stages through its model's fingerprint, not through these keys
    (a params file moved, or a model file renamed, is the same teacher)."""

    # A params file, relative to the one that names it (as `extends`); its runs are found
    # in (or added to) the same work dir, so students of the same teachers share them.
    params: str | None = operational(None)
    seeds: list[int] = operational([])  # train.seed of each run of `params`
    overrides: list[str] = operational([])  # dotted.key=value for every run of `params`
    # Exported model files, or registered ones (models:/NAME/VERSION, models:/NAME@ALIAS)
    # fetched from the run's MLflow registry.
    models: list[str] = operational([])

    @model_validator(mode="after")
    def _which(self) -> TeachersConfig:
        if (self.params is None) == (not self.models):
            raise ValueError("params: give the teachers as params (with seeds) or as models, "
                             "one of the two")  # fmt: skip
        if self.params is not None and not self.seeds:
            raise ValueError("seeds: a teacher a seed; none given")
        if self.params is None and (self.seeds or self.overrides):
            raise ValueError("seeds: seeds and overrides are for teachers given as params")
        if len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"seeds: {self.seeds} repeats a seed (the same teacher twice)")
        for seed in self.seeds:
            if not 0 <= seed < SEEDS:
                raise ValueError(f"seeds: {seed} is not in [0, {SEEDS})")
        return self


class DistillConfig(Section):
    """Sequence-level knowledge distillation (Kim & Rush, 2016): the student trains on the
    teachers' beam-search translations of the training split (transformer/decoding/
    distill.py)."""

    teachers: TeachersConfig
    # The training side the teachers' translations replace: "target" (their translations of
    # the sources, Kim & Rush's), or "source" (teachers of the reverse direction translate
    # the targets back).
    replace: Literal["target", "source"] = "target"
    keep_originals: bool = False  # the original pairs beside the distilled ones
    decode: DecodeConfig = DecodeConfig()  # the teachers' search (the ensemble's mean)
    # Lines translated and saved together: a stop loses at most one part. Identity, not
    # operational: a part's lines make its batches, and other batches may round otherwise.
    part_pairs: int = Field(2000, ge=1)


class Params(Section):
    data: DataConfig
    clean: CleanConfig = CleanConfig()
    vocab: VocabConfig = VocabConfig()
    shard: ShardConfig = ShardConfig()
    model: ModelConfig = ModelConfig()
    train: TrainConfig = TrainConfig()
    average: AverageConfig = AverageConfig()
    decode: DecodeConfig = DecodeConfig()
    score: ScoreConfig = ScoreConfig()
    export: ExportConfig = ExportConfig()
    distill: DistillConfig | None = added(None)  # None: trained on the corpus itself

    @model_validator(mode="after")
    def _consistent(self) -> Params:
        rates = (("src_bpe_dropout", self.shard.src_bpe_dropout),
                 ("tgt_bpe_dropout", self.shard.tgt_bpe_dropout))  # fmt: skip
        sampled = [key for key, rate in rates if rate]
        if sampled and self.vocab.model_type != "bpe":
            raise ValueError(f"shard.{sampled[0]}: needs vocab.model_type bpe, not "
                             f"{self.vocab.model_type}")  # fmt: skip
        if self.train.cooldown_dropout == self.model.dropout:  # a no-op that renames the run
            raise ValueError(f"train.cooldown_dropout: {self.train.cooldown_dropout} is "
                             "model.dropout already; leave it null")  # fmt: skip
        if self.average.cooldowns > 1 and not self.train.cooldown:
            raise ValueError("average.cooldowns: more than 1 needs a cooldown (train.cooldown > 0)")
        if self.train.seed + self.average.cooldowns - 1 >= SEEDS:  # branch i trains with seed + i
            raise ValueError(f"train.seed: {self.train.seed} + average.cooldowns - 1 must be "
                             f"below {SEEDS}")  # fmt: skip
        self._positions_fit()
        kept = self.train.keep_last if self.average.select == "last" else self.train.keep_best
        if self.average.last_n > kept:
            which = f"keep_{self.average.select}"
            raise ValueError(
                f"average.last_n: {self.average.last_n} > train.{which} ({kept}): "
                "the snapshots to average would be deleted"
            )
        return self

    def _positions_fit(self) -> None:
        """A learned position table (Table 3 row (E)) has max_positions rows and no more: it
        must hold the longest training side clean.max_len allows (every word at least one
        subword, plus EOS) and the longest output decoding may write for it (BOS, then
        max_len_a * source + max_len_b tokens), or training crashes, or decoding cuts its
        outputs short. A sentence of more subwords than words can still exceed it: the
        trainer checks the shards' own longest sequence (transformer/training/trainer.py)."""
        if self.model.positional != "learned":
            return
        source = self.clean.max_len + 1
        output = int(self.decode.max_len_a * source + self.decode.max_len_b) + 1
        need, why = max((source, "clean.max_len + EOS"), (output, "the decode max length"))
        if self.model.max_positions < need:
            raise ValueError(
                f"model.max_positions: {self.model.max_positions} learned positions, {why} "
                f"needs {need}: raise it, or lower clean.max_len or decode.max_len_a/b"
            )


# Top-level sections that belong to whoever orchestrates runs (tasks/settings.py validates
# them): the library reads its own sections and leaves these alone.
FOREIGN_SECTIONS = ("pipeline",)
