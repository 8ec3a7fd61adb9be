"""(A copy of the team's bench workload generator, kept here so a clone with nothing beside it has it: keep the
two equal.)
Deterministic synthetic workload used to compare serving engines side by side.

Each request: prompt token ids drawn from the vocabulary, and a fixed number of output
tokens (generation ignores EOS), so every engine produces exactly the same token counts.
Usage: python workload.py NAME > requests.jsonl   (NAME: mixed64, mixed16, short8)
"""
import json, random, sys, math

SPECS = {
    # name: (n_requests, prompt (mu, sigma, lo, hi), output (lo, hi), seed)
    "mixed64": (64, (5.0, 0.9, 8, 1024), (8, 256), 0),
    "mixed16": (16, (5.0, 0.9, 8, 1024), (8, 256), 1),
    "short8": (8, (3.5, 0.5, 8, 64), (16, 32), 2),
}
VOCAB = 49152
SPECIAL = 17  # SmolLM2 keeps ids 0..16 for special tokens; stay clear of them


def make(name):
    n, (mu, sigma, plo, phi), (olo, ohi), seed = SPECS[name]
    rng = random.Random(seed)
    out = []
    for i in range(n):
        plen = int(min(phi, max(plo, round(math.exp(rng.gauss(mu, sigma))))))
        olen = rng.randint(olo, ohi)
        prompt = [rng.randrange(SPECIAL, VOCAB) for _ in range(plen)]
        out.append({"id": f"{name}-{i}", "prompt_token_ids": prompt, "max_tokens": olen})
    return out


if __name__ == "__main__":
    for r in make(sys.argv[1] if len(sys.argv) > 1 else "mixed64"):
        print(json.dumps(r))
