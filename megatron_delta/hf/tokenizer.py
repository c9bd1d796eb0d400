"""Export a SentencePiece model as a Hugging Face fast tokenizer (tokenizer.json).

``AutoTokenizer.from_pretrained(out_dir)`` then encodes text exactly as
``sentencepiece.SentencePieceProcessor(model_file=...).encode(text)`` (no BOS/EOS added):
transformers' ``SpmConverter.build_tokenizer_from_spm_proto`` (transformers >= 5) rebuilds the
model's own normalizer spec (precompiled charsmap, extra-whitespace removal, dummy prefix,
whitespace escaping), the BPE merges ranked by piece score (or the Unigram vocabulary), byte
fallback and user-defined pieces. It works offline (no slow tokenizer, no hub).

Caveat: the control/unk pieces (``<unk>``, ``<s>``, ``</s>``, ``<pad>``) are registered as special
tokens, so a text containing the literal string "<s>" maps to the BOS id in HF, while
SentencePiece spells it out piece by piece.
"""
import os

_BPE, _UNIGRAM = 2, 1  # TrainerSpec.ModelType


def _load_proto(spm_model_path):
    from sentencepiece import sentencepiece_model_pb2  # needs protobuf; imported lazily

    proto = sentencepiece_model_pb2.ModelProto()
    with open(spm_model_path, "rb") as fh:
        proto.ParseFromString(fh.read())
    return proto


def build_fast_tokenizer(spm_model_path):
    """A ``PreTrainedTokenizerFast`` equivalent to the SentencePiece model (not saved)."""
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import SpmConverter

    proto = _load_proto(spm_model_path)
    mtype = proto.trainer_spec.model_type
    if mtype == _BPE:
        vocab = {p.piece: i for i, p in enumerate(proto.pieces)}
    elif mtype == _UNIGRAM:
        vocab = [(p.piece, p.score) for p in proto.pieces]
    else:
        raise ValueError(f"unsupported SentencePiece model type {mtype} (BPE or Unigram only)")
    backend = SpmConverter.build_tokenizer_from_spm_proto(proto, vocab, legacy=True)
    if backend is None:
        raise RuntimeError("transformers could not build a tokenizer from the SentencePiece model")

    ts = proto.trainer_spec
    n = len(proto.pieces)

    def piece(idx):
        return proto.pieces[idx].piece if 0 <= idx < n else None

    specials = dict(unk_token=piece(ts.unk_id), bos_token=piece(ts.bos_id), eos_token=piece(ts.eos_id),
                    pad_token=piece(ts.pad_id))
    specials = {k: v for k, v in specials.items() if v is not None}
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, clean_up_tokenization_spaces=False, **specials)
    tok.add_bos_token = False
    tok.add_eos_token = False
    return tok


def export_sentencepiece_tokenizer(spm_model_path, out_dir):
    """Write tokenizer.json + tokenizer_config.json (+ the original ``tokenizer.model``) to out_dir."""
    os.makedirs(out_dir, exist_ok=True)
    tok = build_fast_tokenizer(spm_model_path)
    tok.save_pretrained(out_dir)
    with open(spm_model_path, "rb") as src, open(os.path.join(out_dir, "tokenizer.model"), "wb") as dst:
        dst.write(src.read())
    return tok
