"""Export a model file for serving: a CTranslate2 model folder, or a Hugging Face
MarianMTModel folder with its tokenizer.

    python -m transformer.export model.pt --format ctranslate2 --out ct2/ [--quantization int8]
    python -m transformer.export model.pt --format huggingface --out hf/

Serving a CTranslate2 folder (the model appends </s> to the source pieces itself):

    sp = sentencepiece.SentencePieceProcessor(model_file="ct2/spm.model")
    translator = ctranslate2.Translator("ct2/", intra_threads=4)
    out = translator.translate_batch(sp.encode(lines, out_type=str), beam_size=4)
    text = [sp.decode(r.hypotheses[0]) for r in out]

and a Hugging Face folder: `MarianTokenizer.from_pretrained("hf/")`,
`MarianMTModel.from_pretrained("hf/").generate(**tokenizer(lines, return_tensors="pt",
padding=True))`. Each folder has `export.json`: the model file it came from (its sha256 and
meta: steps averaged, data fingerprint), the params' model section, the decoding defaults
of the params' decode section, and how this format's decoding differs from ours.

The conversion is the same function, weight for weight: the fused in_proj splits into Q, K,
V (cross-attention: rows [:D] are Q, [D:] the fused K, V), the post- or pre-norm layer
norms map to their sublayers, embeddings are scaled by sqrt(d_model) and tied as in the
model, and the positions are written out as a table of model.max_positions rows (this
model's sinusoids interleave sin and cos; CTranslate2's built-in ones do not). Marian
always computes its own [sin | cos] sinusoids at load time, so that export permutes the
hidden dimensions (even ones first, then odd ones): the network computes the same function
and its positions become Marian's. transformer.decoding.search never generates PAD or BOS; Marian's
`generation_config.suppress_tokens` does the same, while CTranslate2 has no per-model
decoding settings and its logits are left as ours: pass `suppress_sequences=[["<pad>"],
["<s>"]]` to translate_batch to be certain (a trained model gives them little mass, but
suppressing them renormalizes the other log-probabilities, which ours does not).

A model a format cannot represent exactly is refused (ExportError, naming the setting):
Marian is post-norm with fixed sinusoids, so `model.norm_first` and `model.positional:
learned` are refused there; CTranslate2 takes every model this library trains.

One module past the ~450 lines the library keeps to: the two formats share the reading of
the model (the projections split, the norms mapped, the positions written out), the
refusals and the report; split by format, those would sit in a third file both read.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from importlib.metadata import version
from itertools import product
from pathlib import Path
from typing import get_args

import torch
from torch import Tensor, nn

from transformer.cli import ArgumentParser, existing_file
from transformer.config import ExportConfig, ExportFormat, Quantization
from transformer.decoding.translate import load_translator
from transformer.files import SPM_MODEL, OutputError, atomic_dir, check_output, file_sha256
from transformer.model_file import CheckpointError, load_file
from transformer.nn.model import Transformer, sinusoidal
from transformer.tokens import BOS, EOS, PAD, SPECIAL_IDS, UNK

FORMATS = get_args(ExportFormat)
QUANTIZATIONS = get_args(Quantization)
EXPORT_REPORT = "export.json"


class ExportError(ValueError):
    """A model this format cannot represent, or an export option or folder that is wrong."""


def export_model(
    model_path: str | os.PathLike,
    fmt: str,
    out_dir: str | os.PathLike,
    quantization: str | None = None,
) -> Path:
    """Write the model file `model_path` to the folder `out_dir` in format `fmt`, atomically.

    Raises CheckpointError for an unreadable model file, ExportError for anything else the
    caller can fix (format, quantization, an unsupported model, an unwritable folder).
    """
    _check_options(fmt, quantization)
    model, sp, params = load_translator(model_path, "cpu")
    refused = unsupported(model, fmt)
    if refused:
        raise ExportError(f"{model_path}: cannot export to {fmt}: {'; '.join(refused)}")
    meta = load_file(model_path, mmap=True)["meta"]  # mmap: the tensors are not read again
    report = _report(model_path, meta, params, fmt, quantization)
    try:
        with atomic_dir(out_dir) as tmp:
            if fmt == "ctranslate2":
                write_ctranslate2(model, vocabulary(sp), tmp, quantization)
                (tmp / SPM_MODEL).write_bytes(sp.serialized_model_proto())
            else:
                _write_huggingface(model, sp, params.decode, tmp)
            (tmp / EXPORT_REPORT).write_text(json.dumps(report, indent=2) + "\n")
    except OSError as err:
        raise ExportError(f"{out_dir}: cannot write the export: {err.strerror or err}") from None
    return Path(out_dir)


def export_formats(model_path: str | os.PathLike, cfg: ExportConfig, out_dir: Path) -> dict:
    """The pipeline's export stage: each format of `cfg` in its own subfolder of `out_dir`,
    all written atomically together."""
    with atomic_dir(out_dir) as tmp:
        for fmt in cfg.formats:
            quantization = cfg.quantization if fmt == "ctranslate2" else None
            export_model(model_path, fmt, tmp / fmt, quantization)
    return {"formats": list(cfg.formats), "quantization": cfg.quantization}


def _check_options(fmt: str, quantization: str | None) -> None:
    if fmt not in FORMATS:
        raise ExportError(f"--format {fmt!r}: choose one of {', '.join(FORMATS)}")
    if quantization is None:
        return
    if fmt != "ctranslate2":
        raise ExportError(f"--quantization {quantization}: only --format ctranslate2 quantizes")
    if quantization not in QUANTIZATIONS:
        raise ExportError(
            f"--quantization {quantization!r}: choose one of {', '.join(QUANTIZATIONS)}"
        )


def vocabulary(sp) -> list[str]:
    """The sentencepiece model's pieces, in id order: the token strings both formats use."""
    return [sp.id_to_piece(i) for i in range(sp.get_piece_size())]


def unsupported(model: Transformer, fmt: str) -> list[str]:
    """The settings of `model` that format `fmt` cannot represent exactly (empty: none)."""
    if fmt == "ctranslate2":
        return []  # TransformerSpec has pre-norm, explicit position tables, untied weights
    cfg, refused = model.cfg, []
    if cfg.norm_first:
        refused.append("model.norm_first: true (MarianMTModel is post-norm only)")
    if cfg.positional == "learned":
        refused.append(
            "model.positional: learned (MarianMTModel computes fixed sinusoids at load time)"
        )
    return refused


def _report(model_path, meta: dict, params, fmt: str, quantization: str | None) -> dict:
    decode = params.decode.model_dump(exclude={"max_tokens"})
    library = "ctranslate2" if fmt == "ctranslate2" else "transformers"
    return {
        "format": fmt,
        "quantization": quantization,
        "exported_from": {
            "path": str(Path(model_path).resolve()),
            "sha256": file_sha256(model_path),
            "meta": meta,
        },
        "model": params.model.model_dump(),
        "special_ids": SPECIAL_IDS,
        "decode": decode,
        "decoding_differences": NOTES[fmt] + LOWERCASE_NOTE * params.clean.lowercase,
        "versions": {"torch": torch.__version__, library: version(library)},
    }


NOTES = {
    "ctranslate2": [
        "Give sentencepiece pieces of spm.model without </s>: the model appends it, and the "
        "decoder starts from <s>.",
        "Same settings as transformer.translate: beam_size = decode.beam_size, "
        "max_decoding_length = int(max_len_a * (pieces + 1) + max_len_b), per batch here "
        "where ours is per sentence, and max_input_length <= model.max_positions.",
        "Length penalty: CTranslate2 divides a finished score by len^length_penalty (len "
        "without </s>), ours by GNMT's ((5 + len + 1) / 6)^alpha; CTranslate2 ends a "
        "sentence once beam_size hypotheses finished, ours once none can still win. So beam "
        "outputs can differ; greedy outputs (beam_size=1) are ours.",
        "transformer.decoding.search never generates <pad> or <s>; CTranslate2 may, in principle: "
        "pass suppress_sequences=[['<pad>'], ['<s>']] to forbid them (this renormalizes "
        "the other log-probabilities, which ours does not).",
    ],
    "huggingface": [
        "Hidden dimensions are stored permuted (even ones, then odd ones) so that Marian's "
        "[sin | cos] positions equal this model's interleaved ones: logits are unchanged.",
        "MarianTokenizer appends </s>; generate() starts from <s> and never generates <pad> "
        "or <s> (generation_config.suppress_tokens), as transformer.decoding.search.",
        "generate() has no max_len_a/b: pass max_new_tokens = int(max_len_a * source "
        "tokens + max_len_b). Its length_penalty divides by len^alpha, not GNMT's "
        "((5 + len) / 6)^alpha, and it stops beams differently, so beam outputs can "
        "differ from transformer.translate; greedy outputs (num_beams=1) are ours.",
    ],
}

LOWERCASE_NOTE = [
    "Trained on lowercased text (clean.lowercase): lowercase the input before encoding it "
    "(transformer.translate does); the output is lowercase."
]


class _Weights(dict):
    """A state dict that records which entries a conversion read: one it never read would be
    a part of the model (say, a bias added to model.py later) that the export drops."""

    def __init__(self, weights: dict):
        super().__init__(weights)
        self.read: set[str] = set()

    def __getitem__(self, name: str):
        self.read.add(name)
        return super().__getitem__(name)

    def check_all_read(self, fmt: str) -> None:
        if unread := sorted(self.keys() - self.read):
            raise ExportError(f"{fmt}: no mapping for the model's {', '.join(unread)}")


# --------------------------------------------------------------------------- CTranslate2


def write_ctranslate2(
    model: Transformer, pieces: list[str], out: Path, quantization: str | None = None
) -> None:
    """CTranslate2's files for `model` (model.bin, config.json, the vocabulary) in `out`,
    which the converter empties first; `pieces[i]` is the token of id i."""
    from ctranslate2.converters import Converter

    class _Converter(Converter):
        def _load(self):
            return transformer_spec(model, pieces)

    _Converter().convert(str(out), quantization=quantization, force=True)


def transformer_spec(model: Transformer, pieces: list[str]):
    """The ctranslate2 TransformerSpec of `model`, with its vocabulary and special tokens."""
    from ctranslate2.specs import TransformerSpec

    cfg = model.cfg
    spec = TransformerSpec.from_config(cfg.n_layers, cfg.n_heads, pre_norm=cfg.norm_first)
    w = _Weights({k: t.detach().float().cpu().numpy() for k, t in model.state_dict().items()})
    enc, dec = spec.encoder, spec.decoder
    enc.embeddings[0].weight, dec.embeddings.weight = w["src_embed.weight"], w["tgt_embed.weight"]
    enc.position_encodings.encodings, dec.position_encodings.encodings = _positions(model, w)
    for i, layer in enumerate(enc.layer):
        _attention(layer.self_attention, w, f"encoder.{i}.self_attn", f"encoder.{i}.sub.0")
        _ffn(layer.ffn, w, f"encoder.{i}.ffn", f"encoder.{i}.sub.1")
    for i, layer in enumerate(dec.layer):
        _attention(layer.self_attention, w, f"decoder.{i}.self_attn", f"decoder.{i}.sub.0")
        _attention(layer.attention, w, f"decoder.{i}.cross_attn", f"decoder.{i}.sub.1")
        _ffn(layer.ffn, w, f"decoder.{i}.ffn", f"decoder.{i}.sub.2")
    if cfg.norm_first:
        _norm(enc.layer_norm, w, "enc_norm")
        _norm(dec.layer_norm, w, "dec_norm")
    dec.projection.weight = w["out_proj.weight"]
    w.check_all_read("ctranslate2")
    spec.register_source_vocabulary(pieces)
    spec.register_target_vocabulary(pieces)
    c = spec.config
    c.unk_token, c.bos_token, c.eos_token = pieces[UNK], pieces[BOS], pieces[EOS]
    c.decoder_start_token, c.add_source_eos = pieces[BOS], True
    c.layer_norm_epsilon = next(m.eps for m in model.modules() if isinstance(m, nn.LayerNorm))
    return spec


def _positions(model: Transformer, w: dict):
    if model.cfg.positional == "learned":
        return w["src_pos.weight"], w["tgt_pos.weight"]
    table = sinusoidal(torch.arange(model.cfg.max_positions), model.cfg.d_model).numpy()
    return table, table


def _attention(spec, w: dict, name: str, residual: str) -> None:
    """Self-attention keeps the fused (3D, D) QKV; cross-attention has Q apart from K, V."""
    weight, bias = w[f"{name}.in_proj.weight"], w[f"{name}.in_proj.bias"]
    if len(spec.linear) == 2:  # self-attention: [QKV, out]
        _linear(spec.linear[0], weight, bias)
    else:  # [Q, KV, out]
        d = weight.shape[1]
        _linear(spec.linear[0], weight[:d], bias[:d])
        _linear(spec.linear[1], weight[d:], bias[d:])
    _linear(spec.linear[-1], w[f"{name}.out_proj.weight"], w[f"{name}.out_proj.bias"])
    _norm(spec.layer_norm, w, f"{residual}.norm")


def _ffn(spec, w: dict, name: str, residual: str) -> None:
    _linear(spec.linear_0, w[f"{name}.w1.weight"], w[f"{name}.w1.bias"])
    _linear(spec.linear_1, w[f"{name}.w2.weight"], w[f"{name}.w2.bias"])
    _norm(spec.layer_norm, w, f"{residual}.norm")


def _linear(spec, weight, bias) -> None:
    spec.weight, spec.bias = weight, bias


def _norm(spec, w: dict, name: str) -> None:
    spec.gamma, spec.beta = w[f"{name}.weight"], w[f"{name}.bias"]


# --------------------------------------------------------------------------- Hugging Face


def _write_huggingface(model: Transformer, sp, decode, out: Path) -> None:
    from transformers import MarianTokenizer

    marian_model(model, decode).save_pretrained(out)
    for weights in out.glob("*.safetensors"):  # written 0600: give them the umask's mode
        weights.chmod((out / "config.json").stat().st_mode)
    vocab = vocabulary(sp)
    for name in ("source.spm", "target.spm"):  # one joint model serves both sides
        (out / name).write_bytes(sp.serialized_model_proto())
    (out / "vocab.json").write_text(json.dumps({p: i for i, p in enumerate(vocab)}))
    tokenizer = MarianTokenizer(
        str(out / "source.spm"),
        str(out / "target.spm"),
        str(out / "vocab.json"),
        unk_token=vocab[UNK],
        eos_token=vocab[EOS],
        pad_token=vocab[PAD],
        bos_token=vocab[BOS],  # special, so decode(skip_special_tokens=True) drops it
        model_max_length=model.cfg.max_positions,
    )
    tokenizer.save_pretrained(out)


def marian_model(model: Transformer, decode):
    """Hugging Face's MarianMTModel with `model`'s weights, generating as `decode` says."""
    from transformers import GenerationConfig, MarianMTModel

    marian = MarianMTModel(marian_config(model))
    marian.load_state_dict(marian_weights(model), strict=True)
    marian.generation_config = GenerationConfig(
        decoder_start_token_id=BOS,
        bos_token_id=BOS,
        eos_token_id=EOS,
        pad_token_id=PAD,
        suppress_tokens=[PAD, BOS],
        num_beams=decode.beam_size,
        length_penalty=decode.len_penalty,
        max_length=model.cfg.max_positions,  # Marian has no position past its table
    )
    return marian


def marian_config(model: Transformer):
    from transformers import MarianConfig

    cfg = model.cfg
    return MarianConfig(
        vocab_size=model.out_proj.weight.shape[0],
        decoder_vocab_size=model.out_proj.weight.shape[0],
        d_model=cfg.d_model,
        encoder_layers=cfg.n_layers,
        decoder_layers=cfg.n_layers,
        encoder_attention_heads=cfg.n_heads,
        decoder_attention_heads=cfg.n_heads,
        encoder_ffn_dim=cfg.d_ff,
        decoder_ffn_dim=cfg.d_ff,
        activation_function="relu",
        dropout=cfg.dropout,
        attention_dropout=cfg.attn_dropout,
        activation_dropout=cfg.relu_dropout,
        max_position_embeddings=cfg.max_positions,
        scale_embedding=True,
        share_encoder_decoder_embeddings=cfg.share_embeddings,
        tie_word_embeddings=cfg.share_embeddings,
        pad_token_id=PAD,
        bos_token_id=BOS,
        eos_token_id=EOS,
        decoder_start_token_id=BOS,
        forced_eos_token_id=None,
    )


def residual_permutation(d_model: int) -> Tensor:
    """Hidden dimensions reordered even ones first: our interleaved sinusoid rows
    [sin f0, cos f0, sin f1, ...] become Marian's [sin f0, sin f1, ..., cos f0, ...]."""
    return torch.cat([torch.arange(0, d_model, 2), torch.arange(1, d_model, 2)])


# Per layer, in order: our sublayer (its Residual is sub.<index>), Marian's module for it and
# Marian's layer norm after it.
MARIAN_SUBLAYERS = {
    "encoder": [
        ("self_attn", "self_attn", "self_attn_layer_norm"),
        ("ffn", "", "final_layer_norm"),
    ],
    "decoder": [
        ("self_attn", "self_attn", "self_attn_layer_norm"),
        ("cross_attn", "encoder_attn", "encoder_attn_layer_norm"),
        ("ffn", "", "final_layer_norm"),
    ],
}


def marian_weights(model: Transformer) -> dict[str, Tensor]:
    """MarianMTModel's state dict for `model`, in the permuted hidden basis: a matrix that
    reads the residual stream has its columns permuted; one that writes to it, its rows, as
    do its bias and the layer norms."""
    w, cfg = _Weights(model.state_dict()), model.cfg
    perm = residual_permutation(cfg.d_model)
    # Marian recomputes this table at load time (in float64): it agrees to 2e-5 for the
    # first 256 positions, 7e-5 for the first 1024.
    pe = sinusoidal(torch.arange(cfg.max_positions), cfg.d_model)[:, perm]
    out = {
        "model.encoder.embed_tokens.weight": w["src_embed.weight"][:, perm],
        "model.decoder.embed_tokens.weight": w["tgt_embed.weight"][:, perm],
        "model.encoder.embed_positions.weight": pe,
        "model.decoder.embed_positions.weight": pe,
        "lm_head.weight": w["out_proj.weight"][:, perm],
        "final_logits_bias": torch.zeros(1, w["out_proj.weight"].shape[0]),
    }
    if cfg.share_embeddings:
        out["model.shared.weight"] = out["model.encoder.embed_tokens.weight"]
    for side, sublayers in MARIAN_SUBLAYERS.items():
        for i, (j, (sub, module, norm)) in product(range(cfg.n_layers), enumerate(sublayers)):
            ours, theirs = f"{side}.{i}", f"model.{side}.layers.{i}"
            out[f"{theirs}.{norm}.weight"] = w[f"{ours}.sub.{j}.norm.weight"][perm]
            out[f"{theirs}.{norm}.bias"] = w[f"{ours}.sub.{j}.norm.bias"][perm]
            if sub == "ffn":
                _marian_ffn(out, w, f"{ours}.ffn", theirs, perm)
            else:
                _marian_attention(out, w, f"{ours}.{sub}", f"{theirs}.{module}", perm)
    w.check_all_read("huggingface")
    return out


def _marian_attention(out: dict, w: dict, ours: str, theirs: str, perm: Tensor) -> None:
    weights = w[f"{ours}.in_proj.weight"].chunk(3)  # W^Q, W^K, W^V, each (D, D)
    biases = w[f"{ours}.in_proj.bias"].chunk(3)
    for proj, weight, bias in zip(("q_proj", "k_proj", "v_proj"), weights, biases, strict=True):
        out[f"{theirs}.{proj}.weight"], out[f"{theirs}.{proj}.bias"] = weight[:, perm], bias
    out[f"{theirs}.out_proj.weight"] = w[f"{ours}.out_proj.weight"][perm]
    out[f"{theirs}.out_proj.bias"] = w[f"{ours}.out_proj.bias"][perm]


def _marian_ffn(out: dict, w: dict, ours: str, theirs: str, perm: Tensor) -> None:
    out[f"{theirs}.fc1.weight"] = w[f"{ours}.w1.weight"][:, perm]
    out[f"{theirs}.fc1.bias"] = w[f"{ours}.w1.bias"]
    out[f"{theirs}.fc2.weight"] = w[f"{ours}.w2.weight"][perm]
    out[f"{theirs}.fc2.bias"] = w[f"{ours}.w2.bias"][perm]


# --------------------------------------------------------------------------- command line


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(prog="python -m transformer.export", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("model", type=existing_file("a model file"),
                   help="exported model file (transformer.average)")  # fmt: skip
    p.add_argument("--format", required=True, help=" or ".join(FORMATS))
    p.add_argument("--out", required=True, help="output folder (an earlier export's is replaced)")
    p.add_argument("--quantization", help=f"ctranslate2 only: {', '.join(QUANTIZATIONS)}")
    p.add_argument("--force", action="store_true", help="replace a folder of something else")
    args = p.parse_args(argv)
    try:
        check_output(args.out, [args.model], marker=EXPORT_REPORT, force=args.force)
        out = export_model(args.model, args.format, args.out, args.quantization)
    except (CheckpointError, ExportError, OutputError) as err:
        # One line: torch's unpickling errors run to paragraphs; the first names the cause.
        print(f"error: {str(err).splitlines()[0]}", file=sys.stderr)
        return 2
    print(out)
    return 0
