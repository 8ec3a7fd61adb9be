"""Chat templates rendered as transformers' `apply_chat_template` renders them, without importing
transformers (~1.2 s of every start): the same sandboxed jinja2 environment (trim_blocks, lstrip_blocks,
loopcontrols, the `{% generation %}` tag, `tojson` without HTML escapes, `raise_exception`,
`strftime_now`, a limited `dict` and `namespace`), the same variables (messages, tools, documents,
add_generation_prompt, the named special tokens, the caller's extra variables) and the same message
normalisation (message objects to dicts, keys whose value is None dropped, reasoning fields aliased,
rich objects replaced by inert placeholders). Mirrors transformers 5's utils/chat_template_utils.py;
tests/test_tokenizer_light.py renders the same conversations through both."""
from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache
from typing import Any

# the names a message's reasoning arrives under; templates read the first, gpt-oss's the second
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def select_template(own: str | dict | None, asked: str | None, tools: list | None) -> str:
    """The template text to render: `asked` (a template, or the name of one of the model's), else the
    model's own ("tool_use" when tools are given and the model names one, else "default")."""
    if isinstance(own, dict):
        if asked is not None and asked in own:
            return own[asked]
        if asked is None:
            if tools is not None and "tool_use" in own:
                return own["tool_use"]
            if "default" in own:
                return own["default"]
            raise ValueError(f"this model has several chat templates and none is the default: pass one of "
                             f"{sorted(own)} as chat_template")
    if asked is not None:
        return asked
    if own is None:
        raise ValueError("this model has no chat template and none was given")
    return own


def render_chat(template: str, messages: list, *, tools: list | None = None, documents: list | None = None,
                add_generation_prompt: bool = False, continue_final_message: bool | str = False,
                variables: dict | None = None) -> str:
    """The conversation rendered by `template` (`variables`: the special tokens and the caller's extra
    template variables, the latter winning)."""
    if not messages:
        raise ValueError("Cannot apply chat template to an empty conversation. Provide at least one message.")
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt are not compatible")
    compiled = compile_template(template)
    tools = _plain(_tool_schemas(tools))
    if documents is not None and not all(isinstance(d, dict) for d in documents):
        raise TypeError("Documents should be a list of dicts with 'title' and 'text' keys!")
    documents = _plain(documents)
    chat = _alias_reasoning(_normalize(messages))
    final = None
    if continue_final_message:
        final = _tag_final_message(chat, template, continue_final_message)
    text = compiled.render(messages=chat, tools=tools, documents=documents,
                           add_generation_prompt=add_generation_prompt, **_plain(variables or {}))
    return text if final is None else _cut_at_tag(text, final)


def _tool_schemas(tools: list | None) -> list | None:
    if tools is None:
        return None
    out = []
    for tool in tools:
        if isinstance(tool, dict):
            out.append(tool)
        elif callable(tool):        # a Python function: transformers writes its schema from the docstring
            from transformers.utils import get_json_schema
            out.append(get_json_schema(tool))
        else:
            raise ValueError("Tools should either be a JSON schema, or a callable function with type hints "
                             "and a docstring suitable for auto-conversion to a schema.")
    return out


def _tag_final_message(chat: list[dict], template: str, field: bool | str) -> str:
    """Marks the end of the last message's `field` (so the render can be cut there); its text."""
    field = field if isinstance(field, str) else "content"
    final = chat[-1].get(field)
    if final is None:
        raise ValueError(f'continue_final_message is set but the final message has no "{field}" to continue!')
    fields = [field]
    if field in _REASONING_FIELDS:
        fields = [f for f in _REASONING_FIELDS if chat[-1].get(f) == final]
    if not any(f in template for f in fields):
        raise ValueError(f'continue_final_message is set to "{field}" but this is not an accepted field in the '
                         "chat_template")
    if isinstance(final, (list, tuple)):
        for block in reversed(final):
            if "text" in block:
                final, block["text"] = block["text"], block["text"] + _CONTINUE_TAG
                return final
        raise ValueError("continue_final_message is set but we could not find any text to continue in the final "
                         "message!")
    for f in fields:
        chat[-1][f] = chat[-1][f] + _CONTINUE_TAG
    return final


def _cut_at_tag(text: str, final: str) -> str:
    if final.strip() not in text or _CONTINUE_TAG.strip() not in text:
        raise ValueError("continue_final_message is set but the final message does not appear in the chat after "
                         "applying the chat template")
    at = text.rindex(_CONTINUE_TAG.strip())
    if text[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return text[:at]
    return text[:at].rstrip()       # the template trimmed the message's trailing space


def _normalize(messages: list) -> list[dict]:
    """Message objects (dataclasses, pydantic models) as dicts; keys whose value is None dropped (many
    templates render a literal "None" for `content=None`, and handle a missing key)."""
    out = []
    for m in getattr(messages, "messages", messages):
        d = _plain(m)
        if not isinstance(d, dict):
            raise TypeError(f"Chat messages should be dicts, dataclasses or pydantic models, but got {m!r}.")
        out.append({k: v for k, v in d.items() if v is not None})
    return out


def _plain(value: Any) -> Any:
    """What a template sees is rebuilt from plain JSON types: objects with methods the sandbox does not
    know to be dangerous become a placeholder naming their type ("<ndarray>")."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    np = sys.modules.get("numpy")          # (not imported for this: a numpy scalar exists only if numpy does)
    if np is not None and isinstance(value, np.generic):
        return _plain(value.item())            # np.bool_(False) must stay falsy
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _alias_reasoning(chat: list[dict]) -> list[dict]:
    out = []
    for m in chat:
        reasoning = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
        out.append(m if reasoning is None else {"thinking": reasoning, **m, "reasoning_content": reasoning})
    return out


@lru_cache(maxsize=16)
def compile_template(template: str):
    return _environment().from_string(template)


@lru_cache(maxsize=1)
def _environment():
    """transformers' environment, built once (jinja2 is imported here: ~0.1 s, paid at the first chat)."""
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; here it renders
        its body as it is."""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller):
            return caller()

    class Namespace(jinja2.utils.Namespace):
        """Rejects underscore-prefixed attributes (a way to CPython's internals)."""

        def __init__(*args, **kwargs):      # noqa: N805 -- jinja's Namespace signature, so namespace(self=...) works
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}.")

    class TemplateDict:
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt),
                       dict=TemplateDict(), namespace=Namespace)
    return env
