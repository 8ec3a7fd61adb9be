"""The CLI: generate, chat, and flags generated from EngineArgs."""
import builtins

from pagedserve.config import EngineArgs
from pagedserve.entrypoints.cli import build_parser, main


def test_every_engine_arg_is_a_flag():
    p = build_parser()
    ns = p.parse_args(["serve", "--num-kv-blocks", "64", "--max-num-seqs", "3", "--no-enable-prefix-caching"])
    names = [n for n, *_ in EngineArgs.field_specs()]
    assert all(hasattr(ns, n) for n in names)
    assert (ns.num_kv_blocks, ns.max_num_seqs, ns.enable_prefix_caching, ns.port) == (64, 3, False, 8000)


def test_generate(capsys):
    assert main(["generate", "What is 2+2?", "--max-tokens", "8", "--num-kv-blocks", "64"]) == 0
    assert len(capsys.readouterr().out.strip()) > 0


def test_chat_turns(capsys, monkeypatch):
    lines = iter(["Hello!", "And again?", ""])
    monkeypatch.setattr(builtins, "input", lambda prompt="": next(lines))
    assert main(["chat", "--max-tokens", "6", "--num-kv-blocks", "64"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) >= 2


def test_bad_flag_value_is_a_clear_error(capsys):
    assert main(["generate", "x", "--block-size", "0"]) == 2
    assert "block_size" in capsys.readouterr().err


def test_simulate_projection_and_slo(capsys, tmp_path):
    png = tmp_path / "sim.png"
    assert main(["simulate", "--model-shape", "llama-3-8b", "--hardware", "h100", "--kv-cache-memory", "8GiB",
                 "--rate", "4", "--num-requests", "60", "--slo", "ttft_p99<2s,itl_p99<100ms", "--json",
                 "--plot", str(png)]) == 0
    import json
    rep = json.loads(capsys.readouterr().out)
    assert rep["result"]["requests"] == 60 and rep["result"]["output_tok_s"] > 0
    assert rep["slo"]["max_rate"] > 0 and rep["slo"]["at_max_rate"]["ttft_p99_ms"] <= 2000
    assert png.stat().st_size > 1000


def test_simulate_bad_flags_are_clear(capsys):
    assert main(["simulate", "--model-shape", "llama-3-8b", "--hardware", "tpu9"]) == 2
    assert "--hardware" in capsys.readouterr().err
    assert main(["simulate", "--model-shape", "llama-3-8b", "--slo", "ttft<1s"]) == 2
    assert "--slo" in capsys.readouterr().err


def test_simulate_from_shape_flags(capsys):
    import json
    args = ["simulate", "--layers", "32", "--hidden", "4096", "--heads", "32", "--kv-heads", "8", "--head-dim", "128",
            "--intermediate", "14336", "--vocab", "128256", "--hardware", "a100", "--num-kv-blocks", "4000",
            "--num-requests", "40", "--json"]
    assert main(args) == 0
    by_flags = json.loads(capsys.readouterr().out)
    assert main(["simulate", "--model-shape", "llama-3-8b", "--hardware", "a100", "--num-kv-blocks", "4000",
                 "--num-requests", "40", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == by_flags
    assert main(["simulate", "--layers", "32", "--hardware", "a100"]) == 2
    assert "--hidden" in capsys.readouterr().err


# What each subcommand may import (issue 24 item 4): the arithmetic and the clients import neither torch
# nor the server app; `pagedserve --help` imports no subcommand's modules at all.
IMPORT_PROBE = """
import sys
for m in ("torch", "transformers", "pagedserve.entrypoints.server"):
    sys.modules[m] = None          # importing any of them now fails
from pagedserve.entrypoints.cli import main
try:
    main(sys.argv[1:])
except SystemExit:
    pass
print(sorted(m for m in ("fastapi", "pydantic", "uvicorn", "numpy", "rich", "httpx") if sys.modules.get(m)))
"""


def test_subcommands_import_only_what_they_run():
    import json
    import subprocess
    import sys

    def imported(*argv):
        p = subprocess.run([sys.executable, "-c", IMPORT_PROBE, *argv], capture_output=True, text=True, timeout=60)
        assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
        return json.loads(p.stdout.strip().splitlines()[-1].replace("'", '"'))

    assert imported("--help") == []
    assert imported("kv-plan", "--layers", "30", "--kv-heads", "3", "--head-dim", "64") == []
    assert imported("simulate", "--help") == []
    assert set(imported("top", "--help")) <= {"rich", "httpx"}
    assert "numpy" not in imported("router", "--help")       # the router's own app (FastAPI), not the server's


def test_generate_takes_the_model_positionally_and_is_quiet_by_default(capsys, caplog):
    """`generate [MODEL] PROMPT` as `serve [MODEL]` (--model too); the answer alone on stdout and nothing
    below a warning logged unless --log-level info asks for the engine's start-up lines."""
    import logging
    from pagedserve.model.loader import default_model_path
    path = default_model_path()
    caplog.set_level(logging.DEBUG)
    assert main(["generate", path, "What is 2+2?", "--max-tokens", "4", "--num-kv-blocks", "64"]) == 0
    assert capsys.readouterr().out.strip()
    assert not [r for r in caplog.records if r.name == "pagedserve" and r.levelno < logging.WARNING]
    assert main(["generate", "Hi", "--model", path, "--max-tokens", "2", "--num-kv-blocks", "64",
                 "--log-level", "info"]) == 0
    assert any(r.getMessage().startswith("memory plan") for r in caplog.records)
    assert main(["generate", path, "Hi", "--model", "/elsewhere.gguf"]) == 2
    assert "model given twice" in capsys.readouterr().err


def test_serve_on_a_busy_port_exits_1_before_loading(capsys):
    """The port is checked before the model loads: in use -> exit 1 naming --port, at once."""
    import socket
    import time
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        t = time.perf_counter()
        assert main(["serve", "--port", str(port), "--num-kv-blocks", "64"]) == 1
        assert time.perf_counter() - t < 5              # (not a timing claim: the load would take longer)
    assert f"--port {port}" in capsys.readouterr().err


def test_one_shot_commands_build_gemm_shapes_as_they_meet_them():
    """generate and chat meet a few GEMM shapes: not every bucket built at load (~1-2.5 s, issue 56); a
    server builds them all before serving (flat memory); either can be asked for."""
    p = build_parser()
    assert [p.parse_args(a).warm_gemm_shapes for a in (["generate", "x"], ["chat"], ["serve"])] == [False, False, True]
    assert p.parse_args(["generate", "x", "--warm-gemm-shapes"]).warm_gemm_shapes is True
    assert p.parse_args(["serve", "--no-warm-gemm-shapes"]).warm_gemm_shapes is False


def test_serve_runs_its_core_in_a_process_of_its_own_by_default():
    """serve: the engine core in its own process unless --no-engine-process (issue 53); generate, chat and LLM()
    step a core in process (one answer: a second process's start would only add to it)."""
    p = build_parser()
    assert [p.parse_args(a).engine_process for a in (["generate", "x"], ["chat"], ["serve"])] == [False, False, True]
    assert p.parse_args(["serve", "--no-engine-process"]).engine_process is False
    assert EngineArgs().engine_process is False
