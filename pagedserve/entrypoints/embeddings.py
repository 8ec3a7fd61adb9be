"""POST /v1/embeddings: each input's pooled final hidden states (PoolingParams: the model's pooling, or
--pooling), all inputs handed to the engine at once so they share steps; `encoding_format` float or
base64 (little-endian float32, as OpenAI's), `dimensions` where the model was trained for it."""
from __future__ import annotations

import base64

import numpy as np
from fastapi import APIRouter, Request

from pagedserve.entrypoints.completions import tokenize_prompts
from pagedserve.entrypoints.http_errors import RequestError
from pagedserve.entrypoints.protocol import EmbeddingRequest
from pagedserve.entrypoints.responses import admit, check_model, collect, model_name, state
from pagedserve.errors import ParamError
from pagedserve.sampling_params import PoolingParams

router = APIRouter()


@router.post("/v1/embeddings")
async def embeddings(body: EmbeddingRequest, http: Request):
    st = state(http)
    check_model(st, body.model)
    try:        # the engine resolves the pooling (the model's, --pooling) and checks dimensions
        rid, prompts, streams = await admit(st, http, body, "embd-", PoolingParams(dimensions=body.dimensions),
                                            lambda: tokenize_prompts(st, body.input, "input"), prompt_field="input")
    except ParamError as e:                  # the engine's one sampled token (max_tokens 1) is the `input`'s too
        raise RequestError("input" if e.param == "max_tokens" else e.param, str(e), code=e.code) from None
    outs = await collect(http, streams)
    data = []
    for i, out in enumerate(outs):
        vec = out.embedding
        if body.encoding_format == "base64":
            vec = base64.b64encode(np.asarray(vec, dtype="<f4").tobytes()).decode()
        data.append({"object": "embedding", "index": i, "embedding": vec})
    n = sum(len(o.prompt_token_ids) for o in outs)
    return {"object": "list", "id": rid, "model": model_name(st, body.model), "data": data,
            "usage": {"prompt_tokens": n, "total_tokens": n}}
