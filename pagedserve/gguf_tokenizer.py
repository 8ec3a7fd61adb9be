"""A GGUF's byte-level BPE tokenizer ("gpt2" in tokenizer.ggml.model) built with `tokenizers` alone, without
importing transformers (transformers: ~11 s for SmolLM2's 49k tokens, 24-42 s for Qwen2.5's 152k; here 0.5 s
and 1.3-2.1 s, on a loaded 2-core host). It repeats transformers 5.24's conversion step by step
(integrations/gguf/gguf_tokenizer_mapping.py: byte_level_tokenizer, add_gguf_special_tokens, set_split_regex;
then the backend's special tokens and its post-processor) and saves what transformers' save_pretrained saves
(tokenizer.json, tokenizer_config.json, chat_template.jinja), so light_tokenizer.LightTokenizer reads either
alike. Everything else (SentencePiece "llama", unigram "t5", architectures whose transformers class rebuilds
the tokenizer differently) is `refusal`'s to name, and converted by transformers."""
from __future__ import annotations

import json
import mmap
import os
import struct
from array import array

# the saved tokenizer's cache key (tokenizer.build_tokenizer): changes when what is built here changes
FORMAT = "pagedserve-gguf-bpe-1"
# tokenizer.ggml.token_type: llama.cpp's llama_token_type
CONTROL, USER_DEFINED = 3, 4
# architectures whose AutoTokenizer class takes the converted tokenizer as it is (TokenizersBackend), or
# only re-adds its special tokens (Qwen2Tokenizer): the classes checked against transformers here
_BACKEND_CLASSES = {"llama": "TokenizersBackend", "qwen2": "Qwen2Tokenizer", "qwen3": "Qwen2Tokenizer",
                    "qwen2_moe": "Qwen2Tokenizer", "qwen3_moe": "Qwen2Tokenizer"}
# transformers' GGUF_PRE_TOKENIZER_SPLITS: tokenizer.ggml.pre -> the split its merges were learned on;
# any other value keeps GPT-2's own (ByteLevel's regex)
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
           r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
          r"|\s+(?!\S)|\s+")
_QWEN35 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                     "jina-v5-nano", "dbrx", "smaug-bpe"), _LLAMA3),
    "tekken": _TEKKEN,
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), _QWEN2),
    "qwen35": _QWEN35,
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _GPT4O),
}
# transformers' VERY_LARGE_INTEGER, what its save writes for a tokenizer without a length
_NO_MAX_LENGTH = int(1e30)
_SPECIAL_IDS = (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id"))


def read_tokenizer_metadata(path: str) -> dict:
    """general.architecture and every tokenizer.* key of a GGUF (v2/v3, little-endian), read from the
    file's header by struct on the mapped bytes: no numpy, no gguf package. Arrays of strings come back
    as lists, of numbers as lists of ints/floats."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        magic, version = buf[:4], struct.unpack_from("<I", buf, 4)[0]
        if magic != b"GGUF" or version not in (2, 3):
            raise ValueError(f"{path}: not a little-endian GGUF v2/v3 (magic {magic!r}, version {version})")
        n_kv = struct.unpack_from("<Q", buf, 16)[0]
        reader = _Fields(buf, 24)
        out = {}
        for _ in range(n_kv):
            key = reader.string()
            vtype = reader.u32()
            wanted = key.startswith("tokenizer.") or key == "general.architecture"
            out_value = reader.value(vtype, keep=wanted)
            if wanted:
                out[key] = out_value
        return out


class _Fields:
    """A cursor over a GGUF header's key/value section."""

    _SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}

    def __init__(self, buf, offset: int):
        self.buf, self.at = buf, offset

    def u32(self) -> int:
        self.at += 4
        return struct.unpack_from("<I", self.buf, self.at - 4)[0]

    def string(self) -> str:
        n = struct.unpack_from("<Q", self.buf, self.at)[0]
        self.at += 8 + n
        return self.buf[self.at - n:self.at].decode("utf-8", errors="replace")

    def value(self, vtype: int, keep: bool):
        if vtype == 8:
            return self.string()
        if vtype in self._SCALARS:
            code = "<" + self._SCALARS[vtype]
            self.at += struct.calcsize(code)
            return struct.unpack_from(code, self.buf, self.at - struct.calcsize(code))[0]
        if vtype != 9:
            raise ValueError(f"GGUF value type {vtype} is not known")
        itype, n = struct.unpack_from("<IQ", self.buf, self.at)
        self.at += 12
        if itype == 8:
            return self._strings(n, keep)
        if itype not in self._SCALARS:
            raise ValueError(f"GGUF arrays of type {itype} are not read")
        size = struct.calcsize("<" + self._SCALARS[itype])
        start, self.at = self.at, self.at + n * size
        if not keep:
            return None
        items = array(self._SCALARS[itype] if itype != 7 else "B", self.buf[start:self.at])
        if array("H", [1]).tobytes() != b"\x01\x00":     # a big-endian host reads the file's little-endian
            items.byteswap()
        return items.tolist()

    def _strings(self, n: int, keep: bool) -> list[str] | None:
        buf, at, length = self.buf, self.at, struct.Struct("<Q").unpack_from
        out = [] if keep else None
        for _ in range(n):
            k = length(buf, at)[0]
            if keep:
                out.append(buf[at + 8:at + 8 + k].decode("utf-8", errors="replace"))
            at += 8 + k
        self.at = at
        return out


def refusal(meta: dict, folder: str | None = None) -> str | None:
    """Why this file's tokenizer is left to transformers' conversion; None when it is built here. `folder`:
    the file's own (a config.json there can make transformers patch a >100k vocabulary's split as Mistral's)."""
    model = meta.get("tokenizer.ggml.model")
    if model != "gpt2":
        return f"tokenizer.ggml.model {model!r} (only byte-level BPE, 'gpt2', is built without transformers)"
    arch = meta.get("general.architecture")
    if arch not in _BACKEND_CLASSES:
        return f"architecture {arch!r} (its transformers tokenizer class is not one checked here)"
    if "tokenizer.ggml.tokens" not in meta:
        return "no tokenizer.ggml.tokens"
    if folder and len(meta["tokenizer.ggml.tokens"]) > 100_000 and os.path.isfile(os.path.join(folder, "config.json")):
        return "a config.json beside the file (transformers reads it to decide a Mistral split fix)"
    return None


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte alphabet: each byte as a printable character (transformers' and tokenizers' own)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def build_backend(meta: dict):
    """The tokenizers.Tokenizer transformers' conversion gives for this file, and the special tokens by name
    (None where the file names none)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE
    tokens, types = meta["tokenizer.ggml.tokens"], meta.get("tokenizer.ggml.token_type") or ()
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    # a token the file writes in plain text is spelled in the byte alphabet (later duplicates win, as there)
    vocab = {t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")): i
             for i, t in enumerate(tokens)}
    merges = [tuple(m.split(" ")) for m in meta.get("tokenizer.ggml.merges", ())]
    tok = Tokenizer(BPE(vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="",
                        end_of_word_suffix="", fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # GPT2Tokenizer's own defaults (unk, bos and eos "<|endoftext|>") are added first, whatever the file says
    tok.add_tokens([AddedToken("<|endoftext|>", special=True)])
    tok.post_processor = _template(None, None, False, False)
    # control tokens as special (only those spelled in the byte alphabet: another is a mislabel there),
    # user-defined ones as plain added tokens
    control = [AddedToken(t, normalized=False, special=True)
               for t, kind in zip(tokens, types) if kind == CONTROL and set(t) <= alphabet]
    if control:
        tok.add_special_tokens(control)
    have = tok.get_vocab(with_added_tokens=True)
    user = [AddedToken(t, normalized=False, special=False)
            for t, kind in zip(tokens, types) if kind == USER_DEFINED and t in have]
    if user:
        tok.add_tokens(user)
    split = PRE_SPLITS.get(meta.get("tokenizer.ggml.pre"))
    if split is not None:
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    special = {}
    for name, key in _SPECIAL_IDS:
        i = meta.get(f"tokenizer.ggml.{key}")
        special[name] = tokens[i] if i is not None else None
    # the named special tokens the tokenizer lacks as added tokens are added (special)
    added = {t.content for t in tok.get_added_tokens_decoder().values()}
    missing = [t for t in dict.fromkeys(special.values()) if t is not None and t not in added]
    if missing:
        tok.add_tokens([AddedToken(t, special=True) for t in missing])
    add_bos, add_eos = meta.get("tokenizer.ggml.add_bos_token"), meta.get("tokenizer.ggml.add_eos_token")
    if add_bos is not None or add_eos is not None:     # (the backend re-makes it only when the file says)
        bos, eos = ((t, tok.token_to_id(t)) if t is not None else None
                    for t in (special["bos_token"], special["eos_token"]))
        tok.post_processor = _template(bos, eos, bool(add_bos), bool(add_eos))
    return tok, special


def _template(bos: tuple | None, eos: tuple | None, add_bos: bool, add_eos: bool):
    """transformers' update_post_processor: bos before and eos after each sequence where asked (and named)."""
    from tokenizers import processors
    add_bos, add_eos = add_bos and bos is not None, add_eos and eos is not None
    single = f"{(bos[0] + ':0 ') if add_bos else ''}$A:0{(' ' + eos[0] + ':0') if add_eos else ''}"
    pair = f"{single}{(' ' + bos[0] + ':1') if add_bos else ''} $B:1{(' ' + eos[0] + ':1') if add_eos else ''}"
    return processors.TemplateProcessing(single=single, pair=pair,
                                         special_tokens=[t for t, on in ((bos, add_bos), (eos, add_eos)) if on])


def save_tokenizer(meta: dict, folder: str) -> None:
    """The files transformers' save_pretrained writes for its conversion of this file, into `folder`."""
    tok, special = build_backend(meta)
    os.makedirs(folder, exist_ok=True)
    tok.save(os.path.join(folder, "tokenizer.json"))
    cls = _BACKEND_CLASSES[meta["general.architecture"]]
    config = {"backend": "tokenizers", **special, "is_local": True, "local_files_only": False,
              "model_max_length": _NO_MAX_LENGTH, "tokenizer_class": cls}
    if cls == "Qwen2Tokenizer":
        config["add_prefix_space"] = None
    with open(os.path.join(folder, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(dict(sorted(config.items())), f, indent=2, ensure_ascii=False)
    template = meta.get("tokenizer.chat_template")
    if isinstance(template, str):
        with open(os.path.join(folder, "chat_template.jinja"), "w", encoding="utf-8") as f:
            f.write(template)
