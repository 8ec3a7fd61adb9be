"""Regenerate the client corpus: run real clients (LangChain's ChatOpenAI / OpenAI, LiteLLM) against a
capture server that records every request (path, headers, JSON body) and answers with a canned
OpenAI response, then write one JSON file per request next to this script. Not run by `make test`
(the clients are not test dependencies): run it in a separate venv that has them, e.g.

    python3 -m venv /tmp/clients && /tmp/clients/bin/pip install langchain-openai litellm
    LITELLM_LOCAL_MODEL_COST_MAP=True /tmp/clients/bin/python tests/entrypoints/client_corpus/capture.py

tests/entrypoints/test_client_corpus.py replays the files against `pagedserve serve`."""
from __future__ import annotations

import json
import os
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib.metadata import version

HERE = os.path.dirname(os.path.abspath(__file__))
KEEP_HEADERS = ("content-type", "accept")          # what a replay sends besides the body
CAPTURED: list[dict] = []
CHAT = {"id": "c", "object": "chat.completion", "created": 0, "model": "m",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": '{"city": "Paris"}'},
                     "finish_reason": "stop", "logprobs": None}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}
COMPLETION = {"id": "c", "object": "text_completion", "created": 0, "model": "m",
              "choices": [{"index": 0, "text": "x", "finish_reason": "stop", "logprobs": None}],
              "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}


class Capture(BaseHTTPRequestHandler):
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        CAPTURED.append({"path": self.path, "headers": {k.lower(): v for k, v in self.headers.items()
                                                        if k.lower() in KEEP_HEADERS}, "body": body})
        chat = self.path.endswith("chat/completions")
        if body.get("stream"):
            chunk = ({"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m",
                      "choices": [{"index": 0, "delta": {"role": "assistant", "content": "x"}, "finish_reason": "stop"}]}
                     if chat else COMPLETION)
            data = f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
        else:
            data = json.dumps(CHAT if chat else COMPLETION).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *a):
        pass


def run(name: str, fn) -> None:
    start = len(CAPTURED)
    try:
        fn()
    except Exception as e:          # the canned answer need not satisfy the client: the request is what we keep
        print(f"{name}: client raised {type(e).__name__}: {str(e)[:120]}", file=sys.stderr)
    for k, req in enumerate(CAPTURED[start:]):
        client = name.split("-")[0]
        pkg = {"langchain": "langchain-openai", "litellm": "litellm"}[client]
        out = {"client": f"{pkg} {version(pkg)}", "case": name, **req}
        with open(os.path.join(HERE, f"{name}{'' if k == 0 else f'-{k}'}.json"), "w") as f:
            json.dump(out, f, indent=1, sort_keys=True)
            f.write("\n")


def main():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Capture)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{srv.server_address[1]}/v1"
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI, OpenAI
    from pydantic import BaseModel

    @tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return "sunny"

    class City(BaseModel):
        city: str

    lc = ChatOpenAI(base_url=base, api_key="x", model="m", max_retries=0)
    run("langchain-invoke", lambda: lc.invoke("Name a river."))
    run("langchain-stream", lambda: list(lc.stream("Name a river.")))
    run("langchain-params", lambda: ChatOpenAI(base_url=base, api_key="x", model="m", temperature=0, max_tokens=16,
                                               stop=["\n"], top_p=0.9, seed=1, max_retries=0).invoke("Hi"))
    run("langchain-tools", lambda: lc.bind_tools([get_weather]).invoke("Weather in Paris?"))
    run("langchain-structured", lambda: lc.with_structured_output(City).invoke("A city."))
    run("langchain-structured-function", lambda: lc.with_structured_output(City, method="function_calling")
        .invoke("A city."))
    run("langchain-completions", lambda: OpenAI(base_url=base, api_key="x", model="m", max_retries=0).invoke("Hi"))

    import litellm
    msgs = [{"role": "user", "content": "Name a river."}]
    kw = dict(api_base=base, api_key="x", num_retries=0)
    run("litellm-completion", lambda: litellm.completion(model="openai/m", messages=msgs, **kw))
    run("litellm-stream", lambda: list(litellm.completion(model="openai/m", messages=msgs, stream=True,
                                                          stream_options={"include_usage": True}, **kw)))
    run("litellm-params", lambda: litellm.completion(model="openai/m", messages=msgs, temperature=0, max_tokens=16,
                                                     stop=["\n"], seed=1, **kw))
    run("litellm-tools", lambda: litellm.completion(model="openai/m", messages=msgs, tools=[{
        "type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                        "required": ["city"]}}}], tool_choice="auto", **kw))
    run("litellm-structured", lambda: litellm.completion(model="openai/m", messages=msgs, response_format=City, **kw))
    run("litellm-hosted_vllm", lambda: litellm.completion(model="hosted_vllm/m", messages=msgs, max_tokens=16, **kw))
    run("litellm-text_completion", lambda: litellm.text_completion(model="text-completion-openai/m", prompt="Hi",
                                                                   max_tokens=8, **kw))
    srv.shutdown()


if __name__ == "__main__":
    main()
