"""Embeddings per second for N inputs of T tokens: pagedserve's LLM.embed (last-token pooling, one
batch through the paged engine) next to transformers' base model forward on the same weights (HF
AutoModel in batches of --hf-batch, last hidden state of the last token), one after the other in one
run, float32, the default model (its GGUF read by transformers). Also checks the two agree.

With --model FOLDER (a sentence-transformers folder over an encoder, e.g. all-MiniLM-L6-v2): pagedserve's
LLM.embed (EncoderCore: the folder's own pooling and normalization, no KV pool) next to
SentenceTransformer.encode (batches of --st-batch) on the same texts (--inputs texts of about --tokens
words drawn from the tokenizer's vocabulary, lengths varying), both float32; checks they agree.

Usage: python bench/embeddings.py [--inputs 32] [--tokens 256] [--hf-batch 8]
       python bench/embeddings.py --model PATH [--inputs 256] [--tokens 64] [--st-batch 32]
"""
import argparse
import os
import time

import torch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--inputs", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--hf-batch", type=int, default=8)
    ap.add_argument("--model", help="a sentence-transformers folder: pagedserve next to sentence-transformers")
    ap.add_argument("--st-batch", type=int, default=32)
    ap.add_argument("--max-num-batched-tokens", type=int, default=4096)
    a = ap.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    if a.model:
        return folder(a)
    from pagedserve import LLM, PoolingParams
    from pagedserve.host import describe
    from pagedserve.model.loader import resolve_model
    print(f"host: {describe()}")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 40000, (a.tokens,), generator=g).tolist() for _ in range(a.inputs)]
    llm = LLM(dtype="float32", num_kv_blocks=a.inputs * (a.tokens // 16 + 2), max_num_seqs=a.inputs,
              max_num_batched_tokens=2048)
    pp = PoolingParams("LAST", True)
    llm.embed([{"prompt_token_ids": prompts[0]}], pp, use_tqdm=False)          # warm-up
    t = time.perf_counter()
    ours = llm.embed([{"prompt_token_ids": p} for p in prompts], pp, use_tqdm=False)
    ours_s = time.perf_counter() - t
    del llm
    from transformers import AutoModel
    src = resolve_model(None)
    hf = AutoModel.from_pretrained(os.path.dirname(src.path), gguf_file=os.path.basename(src.path),
                                   torch_dtype=torch.float32).eval()
    with torch.no_grad():
        hf(torch.tensor([prompts[0]]))
        t = time.perf_counter()
        ref = []
        for i in range(0, a.inputs, a.hf_batch):
            h = hf(torch.tensor(prompts[i:i + a.hf_batch])).last_hidden_state[:, -1]
            ref.append(torch.nn.functional.normalize(h.float(), dim=-1))
        hf_s = time.perf_counter() - t
    ref = torch.cat(ref)
    got = torch.tensor([o.outputs.embedding for o in ours])
    err = (got - ref).abs().max().item()
    print(f"RESULT pagedserve LLM.embed: {a.inputs / ours_s:.2f} embeddings/s ({a.inputs * a.tokens / ours_s:.0f} tok/s)")
    print(f"RESULT HF AutoModel (batch {a.hf_batch}): {a.inputs / hf_s:.2f} embeddings/s "
          f"({a.inputs * a.tokens / hf_s:.0f} tok/s)")
    print(f"ratio {hf_s / ours_s:.2f}x; max |difference| {err:.2e}")


def folder(a):
    """--model FOLDER: pagedserve's LLM.embed next to sentence-transformers on the same texts."""
    import random

    from sentence_transformers import SentenceTransformer

    from pagedserve import LLM
    from pagedserve.host import describe
    print(f"host: {describe()}")
    st = SentenceTransformer(a.model, device="cpu")
    tok = st.tokenizer
    special = set(tok.all_special_tokens)
    words = [w for w in tok.get_vocab() if w.isalnum() and w not in special]
    rng = random.Random(0)
    texts = [" ".join(rng.choice(words) for _ in range(rng.randint(max(1, a.tokens // 2), a.tokens)))
             for _ in range(a.inputs)]
    llm = LLM(a.model, dtype="float32", max_num_seqs=max(a.inputs, 1),
              max_num_batched_tokens=a.max_num_batched_tokens)
    llm.embed(texts[:4], use_tqdm=False)                                          # warm-up
    t = time.perf_counter()
    ours = llm.embed(texts, use_tqdm=False)
    ours_s = time.perf_counter() - t
    n_tok = sum(len(o.prompt_token_ids) for o in ours)
    st.encode(texts[:4], batch_size=a.st_batch)                                  # warm-up
    t = time.perf_counter()
    ref = st.encode(texts, batch_size=a.st_batch, convert_to_tensor=True)
    st_s = time.perf_counter() - t
    got = torch.tensor([o.outputs.embedding for o in ours])
    err = (got - ref.float()).abs().max().item()
    print(f"model {a.model}: {a.inputs} texts, {n_tok} tokens after truncation (max_seq_length "
          f"{st.max_seq_length})")
    print(f"RESULT pagedserve LLM.embed: {a.inputs / ours_s:.2f} embeddings/s ({n_tok / ours_s:.0f} tok/s)")
    print(f"RESULT sentence-transformers encode (batch {a.st_batch}): {a.inputs / st_s:.2f} embeddings/s "
          f"({n_tok / st_s:.0f} tok/s)")
    print(f"ratio {st_s / ours_s:.2f}x; max |difference| {err:.2e}")


if __name__ == "__main__":
    main()
