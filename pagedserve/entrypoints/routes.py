"""The server's routes, one module-level function each: the service routes and the tokenizer
endpoints here; /v1/completions in `completions.py`, /v1/chat/completions in `chat.py`, /v1/responses
in `responses_api.py`, Anthropic's /v1/messages in `messages.py`. A request is
validated (400 naming the field), submitted to the AsyncLLMEngine, and answered from its
RequestStream (`responses.py`): whole, or as SSE chunks."""
from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse

from pagedserve.entrypoints import chat, completions, embeddings, messages, responses_api
from pagedserve.entrypoints.protocol import (DetokenizeRequest, LoadLoRAAdapterRequest, TokenizeRequest,
                                             UnloadLoRAAdapterRequest, message_dict)
from pagedserve.entrypoints.responses import check_model, model_not_found, state as _state
from pagedserve.entrypoints.http_errors import RequestError, error_response
from pagedserve.errors import EngineDeadError
from pagedserve.tokenizer import apply_chat_template

router = APIRouter()
router.include_router(completions.router)
router.include_router(chat.router)
router.include_router(responses_api.router)
router.include_router(messages.router)
router.include_router(embeddings.router)


# ---------------------------------------------------------------- service routes
@router.get("/health")
async def health(http: Request):
    st = _state(http)
    if st.aengine.dead is not None:
        return error_response(503, f"the engine is dead: {st.aengine.dead}", type_="engine_dead")
    if st.draining:
        return error_response(503, "the server is shutting down", type_="server_shutting_down",
                              headers={"Retry-After": "5"})
    return {"status": "ok"}


@router.get("/v1/models/{model:path}")
async def model(model: str, http: Request):
    """One model of /v1/models by its id (OpenAI's retrieve); 404 naming `model` when it is not served."""
    found = [m for m in (await models(http))["data"] if m["id"] == model]
    if not found:
        raise model_not_found(_state(http), model)
    return found[0]


@router.get("/v1/models")
async def models(http: Request):
    """The served model under each of its names (--served-model-name), and with --enable-lora each loaded
    adapter (its parent: the served model's first name)."""
    st = _state(http)
    eng = st.engine
    base = {"id": st.model_name, "object": "model", "created": 0, "owned_by": "pagedserve",
            "root": eng.info.model_path, "parent": None, "max_model_len": eng.info.max_model_len}
    adapters = [] if not eng.info.enable_lora else await st.aengine.call(eng.lora_adapters)
    return {"object": "list", "data": [base | {"id": name} for name in st.served_model_names] +
                                      [base | {"id": name, "root": path, "parent": st.model_name}
                                       for name, path in adapters]}


# ---------------------------------------------------------------- LoRA adapters at run time (vLLM's routes)
def _with_lora(http: Request):
    if not (st := _state(http)).engine.info.enable_lora:
        raise RequestError("lora_name", "lora_name: the server runs without LoRA (start it with --enable-lora)")
    return st


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(body: LoadLoRAAdapterRequest, http: Request):
    """Load a PEFT adapter folder under a name requests can then give as `model`. 400 naming the field
    when the server runs without --enable-lora, the name is taken or the folder does not fit the model."""
    st = _with_lora(http)
    if body.lora_name in st.served_model_names:
        raise RequestError("lora_name", f"lora_name: {body.lora_name!r} is a served model name")
    await st.aengine.call(lambda: st.engine.load_lora(body.lora_name, body.lora_path))   # ParamError: a 400 naming it
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, http: Request):
    """Unload an adapter: later requests naming it get a 404; those in flight finish with it."""
    st = _with_lora(http)
    if not await st.aengine.call(lambda: st.engine.unload_lora(body.lora_name)):
        raise RequestError("lora_name", f"lora_name: no LoRA adapter named {body.lora_name!r} is loaded", 404,
                           "NotFoundError")
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


@router.get("/metrics")
async def prometheus(http: Request):
    """The registry, with the gauges an idle engine does not step to update refreshed first in the
    engine thread (between steps: nothing here reads the scheduler or the KV manager while they
    change). A dead engine's last values are still served."""
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
    st = _state(http)
    if st.aengine.dead is None:
        try:
            await st.aengine.call(lambda: st.metrics.refresh(st.engine))
        except EngineDeadError:
            pass
    return PlainTextResponse(generate_latest(st.metrics.registry), media_type=CONTENT_TYPE_LATEST)


@router.get("/debug/scheduler")
async def debug_scheduler(http: Request):
    """The queues, the pool and every request-keyed structure's size, read in the engine thread."""
    st = _state(http)
    return await st.aengine.call(lambda: scheduler_snapshot(st))


def scheduler_snapshot(st) -> dict:
    """/debug/scheduler's body; engine thread only (AsyncLLMEngine.call)."""
    return {
        **st.engine.scheduler_view(),
        # entries of every request-keyed structure: all 0 once nothing runs or waits (a soak checks it)
        "held": {**st.aengine.held(), **st.metrics.held()},
        # bounded stores that outlive their requests (their bounds are named where they are defined)
        "stored": {"responses": 0 if st.responses is None else len(st.responses)},
    }


# ---------------------------------------------------------------- tokenizer (vLLM's shapes)
@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, http: Request):
    """{"prompt": text} or {"messages": [...]} -> {"count", "max_model_len", "tokens"[, "token_strs"]}."""
    st = _state(http)
    check_model(st, body.model)
    tok = st.engine.tokenizer
    if (body.prompt is None) == (body.messages is None):
        raise RequestError("prompt", "prompt: give exactly one of prompt and messages")
    if body.prompt is not None:
        ids = await asyncio.to_thread(lambda: list(tok(body.prompt, add_special_tokens=body.add_special_tokens)
                                                   ["input_ids"]))
    else:
        try:
            msgs = [message_dict(m) for m in body.messages]
            ids = await asyncio.to_thread(apply_chat_template, tok, msgs, body.add_generation_prompt,
                                          chat_template=st.chat_template)
        except (ValueError, TypeError) as e:
            raise RequestError(getattr(e, "param", "messages"), str(e)) from None
    out = {"count": len(ids), "max_model_len": st.engine.info.max_model_len, "tokens": ids}
    if body.return_token_strs:
        out["token_strs"] = tok.convert_ids_to_tokens(ids)
    return out


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, http: Request):
    st = _state(http)
    check_model(st, body.model)
    st.engine.info.check_token_ids("tokens", body.tokens)         # a 400 naming the field
    return {"prompt": await asyncio.to_thread(st.engine.tokenizer.decode, body.tokens)}


@router.get("/tokenizer_info")
async def tokenizer_info(http: Request):
    st = _state(http)
    tok = st.engine.tokenizer
    return {"tokenizer_class": type(tok).__name__, "vocab_size": st.engine.info.vocab_size,
            "model_max_length": st.engine.info.max_model_len,
            "eos_token": tok.eos_token, "eos_token_id": tok.eos_token_id,
            "bos_token": tok.bos_token, "bos_token_id": tok.bos_token_id,
            "pad_token": tok.pad_token, "unk_token": tok.unk_token,
            "eos_token_ids": list(st.engine.info.eos_token_ids),
            "chat_template": st.chat_template or tok.chat_template,
            "add_bos_token": getattr(tok, "add_bos_token", None)}
