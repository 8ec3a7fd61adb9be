"""POST /v1/completions, as the OpenAI spec and vLLM have it: one or many prompts (text or token ids;
choice index = prompt index * n + sample), `echo` (the prompt first, with its tokens' logprobs when
`logprobs` is set: the first is null), `max_tokens` 0 with echo (the prompt scored, nothing
generated), `logprobs` with tokens, token_logprobs, top_logprobs and text_offset."""
from __future__ import annotations

import time

from fastapi import APIRouter, Request

from pagedserve.engine.outputs import CompletionOutput, RequestOutput
from pagedserve.entrypoints.protocol import CompletionRequest, to_sampling_params
from pagedserve.entrypoints.responses import (Usage, admit, check_model, collect, completion_logprobs, deltas,
                                              model_name, sse, state, usage_of)
from pagedserve.entrypoints.http_errors import RequestError
from pagedserve.entrypoints.server_state import ServerState

router = APIRouter()


@router.post("/v1/completions")
async def completions(body: CompletionRequest, http: Request):
    st = state(http)
    check_model(st, body.model)
    if body.suffix:
        raise RequestError("suffix", "suffix: insertion (text after the completion) is not supported")
    if body.best_of is not None and body.best_of != body.n:
        raise RequestError("best_of", "best_of: only equal to n (the server does not rank samples)")
    max_tokens = body.max_tokens
    if body.max_completion_tokens is not None and "max_tokens" not in body.model_fields_set:
        max_tokens = body.max_completion_tokens
    if max_tokens == 0 and not body.echo:
        raise RequestError("max_tokens", "max_tokens: 0 is only allowed with echo (score the prompt, generate nothing)")
    echo_only = body.echo and max_tokens == 0
    # echo_only still samples one token (the last prompt row's logits are computed anyway); it is dropped
    params = to_sampling_params(body, 1 if echo_only else max_tokens, body.logprobs,
                                prompt_logprobs=body.logprobs if body.echo and body.logprobs is not None else None)
    rid, prompts, streams = await admit(st, http, body, "cmpl-", params, lambda: tokenize_prompts(st, body.prompt))
    created = int(time.time())
    if body.stream:
        return sse(_chunks(st, rid, created, streams, body, prompts, echo_only), streams)
    outs = await collect(http, streams)
    choices = [_choice(st, body, p, out, o, i * body.n + o.index, echo_only, echo=body.echo)
               for i, (p, out) in enumerate(zip(prompts, outs)) for o in out.outputs]
    return {"id": rid, "object": "text_completion", "created": created, "model": model_name(st, body.model),
            "system_fingerprint": st.system_fingerprint, "choices": choices,
            "usage": usage_of(outs, count_completion=not echo_only)}


def tokenize_prompts(st: ServerState, prompt, field: str = "prompt") -> list[dict]:
    """Each prompt as {"prompt_token_ids", "prompt"} (tokenized here, in a worker thread, not in the
    engine's step loop); `field` names it in errors (embeddings call it `input`)."""
    if isinstance(prompt, str):
        items = [prompt]
    elif prompt and isinstance(prompt[0], int):
        items = [prompt]
    else:
        items = list(prompt)
    if not items:
        raise RequestError(field, f"{field}: must not be empty")
    tok = st.engine.tokenizer
    out = []
    for p in items:
        if isinstance(p, str):
            out.append({"prompt_token_ids": list(tok(p)["input_ids"]), "prompt": p})
        else:
            out.append({"prompt_token_ids": list(p), "prompt": None})
    return out


def _prompt_text(st: ServerState, prompt: dict) -> str:
    if prompt["prompt"] is not None:
        return prompt["prompt"]
    ids = prompt["prompt_token_ids"]
    V = st.engine.info.vocab_size
    return st.engine.tokenizer.decode([t for t in ids if 0 <= t < V])


def _choice(st: ServerState, body: CompletionRequest, prompt: dict, out: RequestOutput, o: CompletionOutput,
            index: int, echo_only: bool, echo: bool) -> dict:
    """One choice; `echo` puts the prompt (and its logprobs) first."""
    text, ids, lps = "", [], []
    if echo:
        text = _prompt_text(st, prompt)
        ids = list(out.prompt_token_ids)
        lps = list(out.prompt_logprobs) if out.prompt_logprobs is not None else [None] * len(ids)
    if not echo_only:
        text += o.text
        ids += o.token_ids
        lps += o.logprobs or []
    logprobs = None
    if body.logprobs is not None:
        logprobs = completion_logprobs(st.engine.tokenizer, ids, lps)
    return {"index": index, "text": text, "logprobs": logprobs,
            "finish_reason": o.finish_reason, "stop_reason": o.stop_reason}


async def _chunks(st: ServerState, rid: str, created: int, streams, body: CompletionRequest, prompts: list[dict],
                  echo_only: bool):
    usage = Usage(prompt={i: len(p["prompt_token_ids"]) for i, p in enumerate(prompts)})
    every = body.stream_options is not None and body.stream_options.usage_in_every_chunk()

    def wrap(choices):
        chunk = {"id": rid, "object": "text_completion", "created": created, "model": model_name(st, body.model),
                 "system_fingerprint": st.system_fingerprint, "choices": choices}
        return chunk | {"usage": usage.body(count_completion=not echo_only)} if every else chunk

    echoed: set[int] = set()
    offsets: dict[int, int] = {}           # choice index -> characters sent so far (text_offset)
    async for i, item in deltas(streams, usage):
        if isinstance(item, RequestError):
            yield item
            return
        if isinstance(item, RequestOutput):
            if body.echo and i not in echoed and (body.logprobs is None or item.prompt_logprobs is not None):
                echoed.add(i)
                for k in range(body.n):
                    c = _choice(st, body, prompts[i], item, CompletionOutput(k, "", [], None, None), i * body.n + k,
                                echo_only=True, echo=True)
                    offsets[i * body.n + k] = len(c["text"])
                    yield wrap([c | {"finish_reason": None, "stop_reason": None}])
            continue
        o: CompletionOutput = item
        index = i * body.n + o.index
        if echo_only:
            if o.finish_reason is not None:
                yield wrap([{"index": index, "text": "", "logprobs": None, "finish_reason": o.finish_reason,
                             "stop_reason": o.stop_reason}])
            continue
        lp = None
        if body.logprobs is not None:
            lp = completion_logprobs(st.engine.tokenizer, o.token_ids, o.logprobs or [], offsets.get(index, 0))
        offsets[index] = offsets.get(index, 0) + len(o.text)
        yield wrap([{"index": index, "text": o.text, "logprobs": lp, "finish_reason": o.finish_reason,
                     "stop_reason": o.stop_reason}])
    if body.stream_options and body.stream_options.include_usage:
        yield wrap([]) | {"usage": usage.body(count_completion=not echo_only)}
