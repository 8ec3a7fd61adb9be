"""`pagedserve generate | chat | serve | top | router | simulate | kv-plan`. Engine flags are generated from
EngineArgs (EngineArgs.add_cli_args)."""
from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import sys

from pagedserve.config import EngineArgs
from pagedserve.engine.startup import StartupTimer, process_age_s


def add_sampling_flags(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=-1)
    ap.add_argument("--sampling-seed", type=int, default=None)


def sampling_from(ns):
    from pagedserve.sampling_params import SamplingParams
    return SamplingParams(max_tokens=ns.max_tokens, temperature=ns.temperature, top_p=ns.top_p,
                          top_k=ns.top_k, seed=ns.sampling_seed)


def json_list(text: str) -> list[str]:
    """A flag's JSON list of strings, as vLLM takes them: --allowed-origins '["https://app.example"]'."""
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f"must be a JSON list of strings, e.g. '[\"*\"]', got {text!r}")
    return value


def runs_as_worker(ns) -> bool:
    """Under torchrun with --distributed-executor-backend external_launcher, every rank runs the same
    engine command: rank 0 is the engine, the others run the tensor-parallel worker loop (returns True)."""
    if ns.cmd not in ("generate", "chat", "serve") or getattr(ns, "distributed_executor_backend", None) != \
            "external_launcher":            # (asked before importing the executor: it imports torch)
        return False
    from pagedserve.distributed.executor import is_external_worker, run_worker_from_env
    args = EngineArgs.from_cli_args(ns)
    if not is_external_worker(args):
        return False
    run_worker_from_env(args)
    return True


def start_kernel_builds(args: EngineArgs) -> None:
    """A cold start's native builds, started before the imports (issue 56: gcc's seconds then run beside
    torch's import and the model read instead of after them); the engine starts any it predicts otherwise.
    The model's kind is told from its path here (no torch): a Hub id not yet downloaded is left to the
    engine."""
    if args.device != "cpu":
        return
    path = args.model and os.path.expanduser(args.model)
    if path is None or (os.path.isfile(path) and path.endswith(".gguf")):
        kind = "gguf"
    elif path and os.path.isdir(path):
        kind = "hf" if os.path.isfile(os.path.join(path, "config.json")) else "gguf"
    else:
        return
    from pagedserve.native_build import prebuild, sources_for
    prebuild(sources_for(kind, args.quantization, args.dtype, args.tensor_parallel_size))


def cmd_generate(ns) -> int:
    args = EngineArgs.from_cli_args(ns)
    start_kernel_builds(args)
    from pagedserve.engine.llm_engine import LLMEngine
    ns.startup.mark("imports")
    eng = LLMEngine(args, startup=ns.startup)
    try:
        params = sampling_from(ns)
        prompt = ns.prompt
        if not ns.raw:
            from pagedserve.tokenizer import apply_chat_template
            prompt = {"prompt_token_ids": apply_chat_template(eng.tokenizer, [{"role": "user", "content": ns.prompt}])}
        _stream(eng, prompt, params)
    finally:
        eng.shutdown()
    return 0


def _stream(eng, prompt, params) -> str:
    rid = eng.add_request(None, prompt, params, stream=True)
    parts = []
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.request_id == rid:           # a streaming request's outputs are deltas
                parts.append(out.outputs[0].text)
                sys.stdout.write(parts[-1])
                sys.stdout.flush()
    sys.stdout.write("\n")
    return "".join(parts)


def cmd_chat(ns) -> int:
    args = EngineArgs.from_cli_args(ns)
    start_kernel_builds(args)
    from pagedserve.engine.llm_engine import LLMEngine
    ns.startup.mark("imports")
    eng = LLMEngine(args, startup=ns.startup)
    try:
        return _chat(eng, ns)
    finally:
        eng.shutdown()


def _chat(eng, ns) -> int:
    from pagedserve.tokenizer import apply_chat_template
    params = sampling_from(ns)
    messages: list[dict] = []
    if ns.system:
        messages.append({"role": "system", "content": ns.system})
    print("pagedserve chat: type a message, empty line or Ctrl-D to quit.", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if not line.strip():
            break
        messages.append({"role": "user", "content": line})
        ids = apply_chat_template(eng.tokenizer, messages)
        try:
            reply = _stream(eng, {"prompt_token_ids": ids}, params)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            messages.pop()
            continue
        messages.append({"role": "assistant", "content": reply})
    return 0


def port_in_use(host: str, port: int) -> str | None:
    """Why host:port cannot be listened on (None: it can), asked before the model loads: a busy port was
    found only after the load (~25 s), and the process then exited 0."""
    import socket
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)      # as uvicorn binds: TIME_WAIT is no conflict
        try:
            s.bind((host, port))
        except OSError as e:
            return e.strerror or str(e)
    return None


def _port_busy(ns, why: str) -> int:
    print(f"error: --port {ns.port}: cannot listen on {ns.host}:{ns.port} ({why}); choose another --port "
          "or stop what holds it", file=sys.stderr)
    return 1


def cmd_serve(ns) -> int:
    """The port is bound first, before torch, FastAPI or the model load (pagedserve.entrypoints.front):
    a busy port fails at once, and /health answers 503 with the start-up phase until the engine is ready."""
    if ns.data_parallel_size != 1:
        busy = port_in_use(ns.host, ns.port)
        if busy is not None:
            return _port_busy(ns, busy)
        from pagedserve.router.replicas import run_data_parallel
        return run_data_parallel(ns, ns.argv[ns.argv.index("serve") + 1:])
    from pagedserve.entrypoints.front import Front
    args = EngineArgs.from_cli_args(ns)
    try:
        front = Front(ns.startup, ns.host, ns.port)
    except OSError as e:
        return _port_busy(ns, e.strerror or str(e))
    ns.startup.current = "imports"
    front.start()
    start_kernel_builds(args)
    ns.core_spawn = None
    if args.engine_process:             # the core's imports and load beside this process's imports, not after
        from pagedserve.engine.core_spawn import spawn_core_for
        ns.core_spawn = spawn_core_for(args, warm_at_load=False)
    try:
        from pagedserve.entrypoints.server import run_server
    except BaseException:
        front.stop()
        if ns.core_spawn is not None:
            ns.core_spawn.proc.kill()
        raise
    ns.startup.mark("imports")
    return run_server(args, ns, front)


def _log_level_flag(p: argparse.ArgumentParser, default: str) -> None:
    p.add_argument("--log-level", default=default, choices=("debug", "info", "warning", "error"),
                   help=f"what the engine logs to stderr (default: {default})")


def _generate_flags(g: argparse.ArgumentParser) -> None:
    # `generate [MODEL] PROMPT`, as `serve [MODEL]`; --model still names it
    g.add_argument("model_arg", nargs="?", default=None, metavar="MODEL",
                   help="a GGUF file, an HF folder or a Hub id (default: the bundled SmolLM2-135M-Instruct)")
    g.add_argument("prompt")
    g.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    add_sampling_flags(g)
    _log_level_flag(g, "warning")
    EngineArgs.add_cli_args(g)
    g.set_defaults(fn=cmd_generate, warm_gemm_shapes=False)    # a one-shot answer meets a few shapes


def _chat_flags(c: argparse.ArgumentParser) -> None:
    c.add_argument("--system", default=None)
    add_sampling_flags(c)
    _log_level_flag(c, "warning")
    EngineArgs.add_cli_args(c)
    c.set_defaults(fn=cmd_chat, warm_gemm_shapes=False)


def _serve_flags(s: argparse.ArgumentParser) -> None:
    s.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    s.add_argument("--port", type=int, default=8000)
    _log_level_flag(s, "info")
    s.add_argument("--api-key", default=None, help="required as 'Authorization: Bearer KEY' on /v1 and /debug")
    s.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the name(s) requests give as `model` (aliases; the first is the one responses report); "
                        "any other is a 404 model_not_found (default: the model's name)")
    for flag, what in (("origins", "origins"), ("methods", "HTTP methods"), ("headers", "request headers")):
        s.add_argument(f"--allowed-{flag}", type=json_list, default=["*"],
                       help=f'CORS: the {what} browsers may use, a JSON list (default: ["*"])')
    s.add_argument("--allow-credentials", action=argparse.BooleanOptionalAction, default=False,
                   help="CORS: let browsers send credentials (cookies, Authorization) cross-origin")
    s.add_argument("--max-body-bytes", type=int, default=4 * 2**20, help="larger request bodies get 413")
    s.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds a request may live before it ends with a timeout error (default: 600)")
    s.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds in-flight requests get to finish before they end with an error")
    s.add_argument("--step-trace", default=None, help="append each step's shape and time to this JSONL "
                   "(`pagedserve simulate --calibrate-from` fits the cost model to it)")
    s.add_argument("--dead-engine-grace", type=float, default=2.0,
                   help="if the engine dies, seconds to answer clients before exiting with status 1")
    s.add_argument("--chat-template", default=None, help="a Jinja chat template file replacing the model's own")
    s.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="serve tool_choice 'auto' (needs --tool-call-parser and a template that renders tools)")
    from pagedserve.entrypoints.tool_calls import TOOL_CALL_PARSERS
    from pagedserve.entrypoints.reasoning import REASONING_PARSERS
    s.add_argument("--tool-call-parser", default=None, choices=TOOL_CALL_PARSERS,
                   help="how the model writes a tool call (hermes: <tool_call>{json}</tool_call>)")
    s.add_argument("--reasoning-parser", default=None, choices=REASONING_PARSERS,
                   help="move <think>...</think> into the message's reasoning_content (and the stream's deltas)")
    s.add_argument("--data-parallel-size", type=int, default=1,
                   help="N > 1: start N replicas (each with these engine flags, on ports after --port) behind the "
                        "cache-aware router on --host:--port")
    s.add_argument("--dashboard", action=argparse.BooleanOptionalAction, default=True,
                   help="serve the live view of the cache and the schedule at /dashboard (and /debug/state)")
    EngineArgs.add_cli_args(s, positional_model=True)
    s.set_defaults(fn=cmd_serve, engine_process=True)     # the core in a process of its own (issue 53)


def _lazy(module: str, name: str, engine_flags: bool = False):
    """The flags of a subcommand that lives in `module`: its add_<name>_flags (and the engine's), its
    run_<name> to run it; the module is imported only when that subcommand is asked for."""
    def add_flags(p: argparse.ArgumentParser) -> None:
        mod = importlib.import_module(module)
        getattr(mod, f"add_{name}_flags")(p)
        if engine_flags:
            EngineArgs.add_cli_args(p)
        p.set_defaults(fn=getattr(mod, f"run_{name}"))
    return add_flags


# subcommand -> (its one-line help, what adds its flags). A subcommand's flags import what it runs (the
# server's parsers, the router's app, rich), so main adds only the flags of the subcommand asked for:
# `pagedserve --help` and `pagedserve kv-plan` import none of the others' modules.
SUBCOMMANDS = {
    "generate": ("generate a reply to one prompt", _generate_flags),
    "chat": ("interactive chat", _chat_flags),
    "serve": ("OpenAI-compatible HTTP server", _serve_flags),
    "top": ("the dashboard's live view of a running server, on the terminal",
            _lazy("pagedserve.entrypoints.top", "top")),
    "router": ("one OpenAI front over data-parallel replicas, cache-aware", _lazy("pagedserve.router.app", "router")),
    "simulate": ("capacity planning: the real scheduler on a step-time cost model",
                 _lazy("pagedserve.sim.cli", "simulate", engine_flags=True)),
    "kv-plan": ("KV-cache memory arithmetic: blocks, bytes, waste, capacity", _lazy("pagedserve.kv_plan", "kv_plan")),
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The whole command line; with `only`, every subcommand is listed but only that one's flags are
    added (main passes the subcommand its argv names, or "" for none)."""
    ap = argparse.ArgumentParser(prog="pagedserve", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name, (help_, add_flags) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_)
        if only is None or only == name:
            add_flags(p)
    return ap


def exit_now(code: int) -> None:
    """End this process as a one-shot command's: the exit handlers run (atexit: logging's flush, child
    processes joined), the output is flushed, and the interpreter's teardown is skipped: freeing torch's
    modules and objects one by one took 1.4-2.3 s after `generate` had printed its answer (2 loaded
    cores; ~0.1 s with this), longer than the answer's own steps."""
    import atexit
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def main(argv: list[str] | None = None) -> int:
    startup = StartupTimer()
    process = argv is None          # a process of its own (the `pagedserve` script, python -m), not a caller's
    if process and (age := process_age_s()) is not None:      # its start counts too
        startup.add("python", age)
    argv = list(sys.argv[1:] if argv is None else argv)
    ns = build_parser(only=argv[0] if argv and argv[0] in SUBCOMMANDS else "").parse_args(argv)
    ns.argv, ns.startup = argv, startup
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    for noisy in ("transformers", "httpx"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    # generate / chat print an answer: the engine's start-up lines only with --log-level info (the level is
    # the command's: put back when main returns, for callers in the same process)
    ours = logging.getLogger("pagedserve")
    before = ours.level
    ours.setLevel(getattr(ns, "log_level", "info").upper())
    try:
        if getattr(ns, "model_arg", None) is not None:
            if ns.model is not None and ns.model != ns.model_arg:
                print(f"error: model given twice: {ns.model_arg!r} and --model {ns.model!r}", file=sys.stderr)
                return 2
            ns.model = ns.model_arg
        code = 0 if runs_as_worker(ns) else ns.fn(ns)
        if process and ns.cmd in ("generate", "chat"):
            exit_now(code)
        return code
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:                   # how one leaves `top` and `chat`; an interrupted command: 130
        return 0 if ns.cmd in ("top", "chat") else 130
    finally:
        ours.setLevel(before)


if __name__ == "__main__":
    sys.exit(main())
