"""A draft model for speculative decoding's benchmarks: some of a GGUF file's layers (its embeddings,
final norm and LM head kept, so its tokenizer and vocabulary are the target's), written as a GGUF file
of its own with the gguf package. Not a trained draft: it shows the mechanics and the costs of method
draft_model, with an acceptance rate below a distilled draft's.

    python bench/truncated_draft.py --layers 0-7,24-29 --out /tmp/drafts/d.gguf [--model FILE]"""
from __future__ import annotations

import argparse
import re


def parse_layers(spec: str) -> list[int]:
    """'0-7,24-29' or '8' (the first 8) or '0-29/2' (every second one)."""
    if spec.isdigit():
        return list(range(int(spec)))
    out = []
    for part in spec.split(","):
        rng, _, step = part.partition("/")
        lo, _, hi = rng.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1, int(step or 1)))
    return sorted(set(out))


def truncate_gguf(src: str, dst: str, layers: list[int]) -> str:
    import gguf
    reader = gguf.GGUFReader(src)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    block_count = gguf.Keys.LLM.BLOCK_COUNT.format(arch=arch)
    total = reader.fields[block_count].contents()
    if not layers or not all(0 <= i < total for i in layers):
        raise ValueError(f"--layers must name layers in [0, {total - 1}], got {layers}")
    new_index = {old: new for new, old in enumerate(sorted(layers))}
    writer = gguf.GGUFWriter(dst, arch)
    for f in reader.fields.values():
        if f.name == gguf.Keys.General.ARCHITECTURE or f.name.startswith("GGUF."):
            continue
        vtype = f.types[0]
        sub = f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        value = len(new_index) if f.name == block_count else f.contents()
        writer.add_key_value(f.name, value, vtype, sub_type=sub)
    keep = []
    for t in reader.tensors:
        m = re.match(r"blk\.(\d+)\.", t.name)
        if m is None:
            keep.append((t.name, t))
        elif int(m.group(1)) in new_index:
            keep.append((f"blk.{new_index[int(m.group(1))]}.{t.name[m.end():]}", t))
    for name, t in keep:
        writer.add_tensor_info(name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, t in keep:
        writer.write_tensor_data(t.data, tensor_endianess=reader.endianess)
    writer.close()
    return dst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="the GGUF file (default: the bundled SmolLM2-135M-Instruct)")
    ap.add_argument("--layers", required=True, help="N (the first N), or ranges: 0-7,24-29 or 0-29/2")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    if a.model is None:
        from pagedserve.model.loader import default_model_path
        a.model = default_model_path()
    print(truncate_gguf(a.model, a.out, parse_layers(a.layers)))


if __name__ == "__main__":
    main()
