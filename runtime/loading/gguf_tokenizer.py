"""The tokenizer of a GGUF file: built from its vocabulary (byte-level BPE, `tokenizer.ggml.model` gpt2, with the
pre-tokenizer `tokenizer.ggml.pre` names), or copied from the folder beside the file where the file has no
vocabulary or one of another kind. Written as tokenizer.json / tokenizer_config.json for transformers to load."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from runtime.errors import NpumoeError
from runtime.loading.checkpoints import TOKENIZER_FILES
from runtime.loading.gguf_file import GGUFFile

# llama.cpp's pre-tokenizer names -> the split regex before the byte-level step (None: GPT-2's own regex)
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
               r"\s+(?!\S)|\s+")
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_SPLITS = {"default": None, "gpt-2": None, "qwen2": QWEN2_SPLIT, "llama-bpe": LLAMA3_SPLIT}
CONTROL, USER_DEFINED = 3, 4  # llama.cpp's token types
BESIDE = (*TOKENIZER_FILES, "tokenizer_config.json", "special_tokens_map.json", "merges.txt")


def write_tokenizer(file: GGUFFile, out: Path) -> None:
    """tokenizer.json and tokenizer_config.json for `file` into folder `out`."""
    model = file.value("tokenizer.ggml.model", "str", None)
    pre = file.value("tokenizer.ggml.pre", "str", "default")
    if model == "gpt2" and pre in PRE_SPLITS:
        _write_bpe(file, out, PRE_SPLITS[pre])
        return
    beside = file.path.parent
    if not any((beside / n).exists() for n in TOKENIZER_FILES):
        what = "no vocabulary" if model is None else f"a {model!r} vocabulary with pre-tokenizer {pre!r}"
        raise NpumoeError(f"{file.path}: holds {what}, which this reader does not build (it builds gpt2 byte-level "
                          f"BPE with pre-tokenizers {', '.join(PRE_SPLITS)}); put the model's tokenizer.json beside "
                          "the file")
    for name in BESIDE:
        if (beside / name).exists():
            shutil.copy(beside / name, out / name)


def _merges(file: GGUFFile, vocab: dict[str, int]) -> list[tuple[str, str]]:
    """The vocabulary's merges, each two tokens it holds whose join it holds too (the BPE tokenizer fails on any
    other with a traceback of its own)."""
    merges = []
    for i, merge in enumerate(file.value("tokenizer.ggml.merges", "strs")):
        pair = tuple(merge.split(" ", 1))
        missing = [t for t in (*pair, "".join(pair)) if t not in vocab] if len(pair) == 2 else [merge]
        if missing:
            raise NpumoeError(f"{file.path}: tokenizer.ggml.merges entry {i} ({merge!r}) names {missing[0]!r}, which "
                              f"is not among its {len(vocab)} tokens: not a vocabulary the tokenizer can build")
        merges.append(pair)
    return merges


def _write_bpe(file: GGUFFile, out: Path, split: str | None) -> None:
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    tokens = file.value("tokenizer.ggml.tokens", "strs")
    vocab = {t: i for i, t in enumerate(tokens)}
    types = file.value("tokenizer.ggml.token_type", "ints", [1] * len(tokens))
    if len(types) != len(tokens):
        raise NpumoeError(f"{file.path}: tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=_merges(file, vocab)))
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                            for i, t in enumerate(types) if t == CONTROL])
    tok.add_tokens([AddedToken(tokens[i], normalized=False) for i, t in enumerate(types) if t == USER_DEFINED])
    special = {}
    for key in ("bos", "eos", "unknown", "padding"):
        index = file.value(f"tokenizer.ggml.{key}_token_id", "int", None)
        if index is not None and 0 <= index < len(tokens):
            special[{"unknown": "unk", "padding": "pad"}.get(key, key) + "_token"] = tokens[index]
    if file.value("tokenizer.ggml.add_bos_token", "bool", False) and "bos_token" in special:
        bos = special["bos_token"]
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A $B",
                                                           special_tokens=[(bos, tokens.index(bos))])
    tok.save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False, **special}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1), encoding="utf-8")
