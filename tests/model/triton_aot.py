"""Compile the Triton attention kernels ahead of time for an NVIDIA target, with no GPU present (Triton's own
LLVM and ptxas): `python tests/model/triton_aot.py [CAPABILITY]` prints one JSON line per variant the engine
launches (every KV format and query dtype, soft-cap or not, head dims 64 / 128 / 256, GQA groups 1 / 4 / 8;
with --quick head dim 128 only) and exits non-zero if any fails. Run with TRITON_INTERPRET unset: in the interpreter tl's own functions are
not compilable."""
from __future__ import annotations

import json
import sys

import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile as triton_compile
from triton.runtime.jit import JITFunction

from pagedserve.kernels import triton_attention as ta

PTR = {"float32": "*fp32", "bfloat16": "*bf16", "float16": "*fp16", "int8": "*i8"}
TL = {"float32": tl.float32, "bfloat16": tl.bfloat16, "float16": tl.float16}
FLOATS = {"scale", "softcap"}


def signature(fn: JITFunction, ptrs: dict[str, str], const: dict) -> dict[str, str]:
    return {n: "constexpr" if n in const else ptrs.get(n, "fp32" if n in FLOATS else "i32") for n in fn.arg_names}


def variants(quick: bool):
    """(kernel, pointer types, constexprs): what decode_attention / prefill_attention / write_kv launch."""
    for kv, q in (("bfloat16", "bfloat16"), ("float16", "float16"), ("float32", "float32"), ("int8", "bfloat16"),
                  ("int8", "float32")):
        ptrs = dict(Q=PTR[q], K=PTR[kv], V=PTR[kv], KS="*fp32" if kv == "int8" else PTR[kv],
                    VS="*fp32" if kv == "int8" else PTR[kv], BT="*i64", LENS="*i64", CU="*i64", OUT=PTR[q],
                    MID_O="*fp32", MID_L="*fp32")
        shapes = ((128, 4, False), (128, 8, True), (64, 1, True), (256, 8, False))
        for hd, G, softcap in shapes[:2] if quick else shapes:
            dot = dict(UPCAST=False, P_DTYPE=TL[q], INT8=kv == "int8", SOFTCAP=softcap)
            bd, bn = max(16, hd), 64 if hd <= 128 else 32
            yield "decode", ptrs, dict(BS=16, G=G, HD=hd, BLOCK_G=max(16, G), BLOCK_D=bd, BLOCK_N=bn, SPLIT=ta.SPLIT_TOKENS,
                                       **dot)
            bg = triton_next_pow2(G)
            yield "prefill", ptrs, dict(BS=16, G=G, HD=hd, BLOCK_G=bg, BLOCK_Q=max(1, 64 // bg), BLOCK_D=bd, BLOCK_N=bn,
                                        **dot)
        yield "merge", dict(MID_O="*fp32", MID_L="*fp32", OUT=PTR[q]), dict(HD=128, BLOCK_S=16, BLOCK_D=128)
        yield "write_kv", dict(X=PTR[q], C=PTR[kv], S="*fp32" if kv == "int8" else PTR[kv], SLOT="*i64"), \
            dict(HD=128, BLOCK_D=128, INT8=kv == "int8")


def triton_next_pow2(n: int) -> int:
    p = 1
    while p < n:
        p *= 2
    return p


FUNCS = {"decode": ta._decode_kernel, "prefill": ta._prefill_kernel, "merge": ta._merge_kernel,
         "write_kv": ta._write_kv_kernel}


def main() -> int:
    args = [a for a in sys.argv[1:] if a != "--quick"]
    cap = int(args[0]) if args else 90
    target = GPUTarget("cuda", cap, 32)
    failed = 0
    for name, ptrs, const in variants("--quick" in sys.argv):
        fn = FUNCS[name]
        rec = {"kernel": name, "capability": cap, **{k: str(v) for k, v in const.items()},
               "q": ptrs.get("Q", ptrs.get("X")), "kv": ptrs.get("K", ptrs.get("C"))}
        try:
            k = triton_compile(ASTSource(fn, signature(fn, ptrs, const), constexprs=const), target=target)
            rec |= {"ok": True, "shared_bytes": k.metadata.shared, "num_warps": k.metadata.num_warps,
                    "cubin_bytes": len(k.asm["cubin"])}
        except Exception as e:
            failed += 1
            rec |= {"ok": False, "error": f"{type(e).__name__}: {str(e)[-800:]}"}
        print(json.dumps(rec), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
