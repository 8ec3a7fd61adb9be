"""LightTokenizer: a saved fast tokenizer (tokenizer.json + tokenizer_config.json + its chat template)
read with the `tokenizers` library alone, and the chat template rendered by chat_template.py, so `serve`
and `generate` do not import transformers (~1.2 s of a 3 s start). It gives what the engine reads of a
transformers tokenizer (encode/decode, special tokens, vocabulary, the chat template) with transformers'
results on the same files; a folder whose tokenizer transformers would change on load (a model-specific
class, add_bos_token, truncation in the file...) is not read here (`light_refusal`) and loads through
transformers instead. Nothing is written to the Rust object after it is built, so threads share it
without a lock."""
from __future__ import annotations

import glob
import json
import os
import threading

# transformers' generic fast-tokenizer classes: they load tokenizer.json as it is
GENERIC_CLASSES = (None, "TokenizersBackend", "PreTrainedTokenizerFast")
SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# config keys under which transformers rewrites the file's pipeline or its output on load
_REWRITING_KEYS = ("add_bos_token", "add_eos_token", "split_special_tokens", "add_prefix_space")


class Encoded(dict):
    """transformers' BatchEncoding as far as callers read one: `["input_ids"]` and `.input_ids`."""

    @property
    def input_ids(self):
        return self["input_ids"]


def light_refusal(folder: str) -> str | None:
    """Why this folder's tokenizer must load through transformers; None when tokenizers alone reads it
    as transformers would."""
    if not os.path.isfile(os.path.join(folder, "tokenizer.json")):
        return "no tokenizer.json"
    config = _read_config(folder)
    cls = config.get("tokenizer_class")
    if cls not in GENERIC_CLASSES:
        return f"tokenizer_class {cls}"
    for key in _REWRITING_KEYS:
        if key in config:
            return f"tokenizer_config.json sets {key}"
    if config.get("clean_up_tokenization_spaces"):
        return "tokenizer_config.json sets clean_up_tokenization_spaces"
    return None


def _read_config(folder: str) -> dict:
    path = os.path.join(folder, "tokenizer_config.json")
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _content(token) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken's dict."""
    return token.get("content") if isinstance(token, dict) else token


def read_chat_template(folder: str, config: dict) -> str | dict | None:
    """As transformers finds it: chat_template.jinja, else the config's (a string, or a list of named
    templates); named ones from additional_chat_templates/ beside it."""
    own = config.get("chat_template")
    path = os.path.join(folder, "chat_template.jinja")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            own = f.read()
    if isinstance(own, list):
        own = {t["name"]: t["template"] for t in own}
    extra = sorted(glob.glob(os.path.join(folder, "additional_chat_templates", "*.jinja")))
    if extra:
        own = {"default": own} if isinstance(own, str) else dict(own or {})
        for p in extra:
            with open(p, encoding="utf-8") as f:
                own[os.path.basename(p)[:-len(".jinja")]] = f.read()
    return own


class LightTokenizer:
    """A tokenizers.Tokenizer with the special tokens and chat template of its folder (module docstring)."""

    def __init__(self, folder: str):
        from tokenizers import Tokenizer
        self.folder = folder
        self.config = _read_config(folder)
        self.backend_tokenizer = Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
        if self.backend_tokenizer.truncation or self.backend_tokenizer.padding:
            raise ValueError(f"{folder}/tokenizer.json sets truncation or padding (transformers applies them)")
        self._special = {n: _content(self.config[n]) for n in SPECIAL_NAMES if self.config.get(n) is not None}
        self._extra_special = [_content(t) for t in (self.config.get("extra_special_tokens")
                                                     or self.config.get("additional_special_tokens") or [])
                               if isinstance(t, (str, dict))]
        self._add_missing_tokens()
        self.chat_template = read_chat_template(folder, self.config)
        vocab = self.backend_tokenizer.get_vocab(with_added_tokens=True)
        self._added = {t.content: i for i, t in sorted(self.backend_tokenizer.get_added_tokens_decoder().items())}
        self.all_special_tokens = list(dict.fromkeys([*self._special.values(), *self._extra_special]))
        self.all_special_ids = [vocab[t] for t in self.all_special_tokens if t in vocab]
        self._hf = None
        self._hf_lock = threading.Lock()

    def _add_missing_tokens(self) -> None:
        """As transformers' load does: the config's added tokens and the named special tokens that the
        file lacks are added (special ones as special)."""
        from tokenizers import AddedToken
        tok = self.backend_tokenizer
        have = set(tok.get_vocab(with_added_tokens=True))
        extra = []
        decoder = self.config.get("added_tokens_decoder") or {}
        for _, t in sorted(decoder.items(), key=lambda kv: int(kv[0])):
            if t["content"] not in have:
                extra.append(AddedToken(t["content"], single_word=t.get("single_word", False),
                                        lstrip=t.get("lstrip", False), rstrip=t.get("rstrip", False),
                                        normalized=t.get("normalized", True), special=t.get("special", False)))
                have.add(t["content"])
        for t in [*self._special.values(), *self._extra_special]:
            if t not in have:
                extra.append(AddedToken(t, special=True))
                have.add(t)
        if extra:
            tok.add_tokens(extra)

    # ------------------------------------------------------------ text <-> ids
    def __call__(self, text: str | list[str], add_special_tokens: bool = True) -> Encoded:
        if isinstance(text, str):
            return Encoded(input_ids=self.encode(text, add_special_tokens))
        encs = self.backend_tokenizer.encode_batch(list(text), add_special_tokens=add_special_tokens)
        return Encoded(input_ids=[e.ids for e in encs])

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        if isinstance(ids, int):
            ids = [ids]
        return self.backend_tokenizer.decode(ids if type(ids) is list else list(ids),
                                             skip_special_tokens=skip_special_tokens)

    def batch_decode(self, seqs, skip_special_tokens: bool = False) -> list[str]:
        return [self.decode(s, skip_special_tokens) for s in seqs]

    def convert_ids_to_tokens(self, ids, skip_special_tokens: bool = False):
        if isinstance(ids, int):
            return self.backend_tokenizer.id_to_token(ids)
        skip = set(self.all_special_ids) if skip_special_tokens else set()
        return [self.backend_tokenizer.id_to_token(int(i)) for i in ids if int(i) not in skip]

    def convert_tokens_to_ids(self, tokens):
        if isinstance(tokens, str):
            return self._token_id(tokens)
        return [self._token_id(t) for t in tokens]

    def _token_id(self, token: str) -> int | None:
        i = self.backend_tokenizer.token_to_id(token)
        return self.unk_token_id if i is None else i

    def get_vocab(self) -> dict[str, int]:
        return self.backend_tokenizer.get_vocab(with_added_tokens=True)

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def vocab_size(self) -> int:
        """The base vocabulary, added tokens not counted (transformers' vocab_size)."""
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=False)

    @property
    def added_tokens_encoder(self) -> dict[str, int]:
        return dict(self._added)

    # ------------------------------------------------------------ special tokens
    @property
    def special_tokens_map(self) -> dict[str, str]:
        return dict(self._special)

    def __getattr__(self, name: str):
        """bos_token, eos_token_id, pad_token, ... (None when the model has none)."""
        base = name.removesuffix("_id")
        if base in SPECIAL_NAMES:
            token = self.__dict__.get("_special", {}).get(base)
            if name == base or token is None:
                return token
            return self.backend_tokenizer.token_to_id(token)
        raise AttributeError(name)

    # ------------------------------------------------------------ chat
    def apply_chat_template(self, conversation: list, tools: list | None = None, documents: list | None = None,
                            chat_template: str | None = None, add_generation_prompt: bool = False,
                            continue_final_message: bool | str = False, tokenize: bool = True, **kwargs):
        """transformers' apply_chat_template for one conversation: the ids (tokenize) or the text."""
        from pagedserve.chat_template import render_chat, select_template
        template = select_template(self.chat_template, chat_template, tools)
        text = render_chat(template, conversation, tools=tools, documents=documents,
                           add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
                           variables={**self._special, **kwargs})
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def compile_chat_template(self) -> None:
        """Compiles the model's template(s) ahead of the first chat; one that does not compile is left for
        that chat to report."""
        from pagedserve.chat_template import compile_template
        own = self.chat_template
        for text in (own.values() if isinstance(own, dict) else [own] if own else []):
            try:
                compile_template(text)
            except Exception:           # noqa: BLE001 -- reported by the request that uses it
                pass

    # ------------------------------------------------------------ for what needs transformers' own
    def transformers(self):
        """The same files loaded by transformers (imported here, ~1.5 s), for a library that takes its
        tokenizer object (lm-eval's HFLM, llguidance.hf); built once and kept by this owner."""
        with self._hf_lock:
            if self._hf is None:
                from pagedserve.model.families import from_transformers
                self._hf = from_transformers("PreTrainedTokenizerFast").from_pretrained(self.folder)
            return self._hf

    def save_pretrained(self, folder: str) -> None:
        """The files it was read from, as transformers saves them (a folder transformers and this load)."""
        os.makedirs(folder, exist_ok=True)
        self.backend_tokenizer.save(os.path.join(folder, "tokenizer.json"))
        config = {k: v for k, v in self.config.items() if k != "chat_template"}
        if isinstance(self.chat_template, dict):
            config["chat_template"] = [{"name": k, "template": v} for k, v in self.chat_template.items()]
        with open(os.path.join(folder, "tokenizer_config.json"), "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2)
        if isinstance(self.chat_template, str):
            with open(os.path.join(folder, "chat_template.jinja"), "w", encoding="utf-8") as f:
                f.write(self.chat_template)

    def __repr__(self) -> str:
        return f"LightTokenizer({self.folder!r}, vocab {len(self)})"
