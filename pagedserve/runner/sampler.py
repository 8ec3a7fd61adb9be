"""Sampling, vectorised over the rows that sample this step: penalties, logit bias, grammar masks,
temperature, top-k, top-p, min-p, per-request seeded generators, logprobs with ranks. Greedy rows
take the argmax. Logprobs are the model's own (before penalties, bias and masks), as vLLM's default."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedserve.core.step import Logprob, SamplingRow


@dataclass(slots=True)
class SampledToken:
    token_id: int
    logprobs: dict[int, Logprob] | None = None     # sampled token + top-k, vLLM's shape


class Sampler:
    def __init__(self, seed: int = 0):
        self.generator = torch.Generator().manual_seed(seed)
        self.req_generators: dict[str, torch.Generator] = {}
        self.draw_states: dict[str, list[torch.Tensor]] = {}   # speculative seeded rows: the state before each draw

    def forget(self, request_id: str) -> None:
        """A sequence ended (SchedulerOutput.finished_req_ids): drop its generator."""
        self.req_generators.pop(request_id, None)
        self.draw_states.pop(request_id, None)

    def verify(self, request_id: str, draft: tuple[int, ...], samples: list[SampledToken]) -> list[SampledToken]:
        """A speculative sequence's tokens from this call's samples of its rows (accepted_run). A seeded
        one's generator then goes back to just after the draws of the rows it used, so it draws the same
        numbers for the same tokens however many drafts each step verified: its output does not depend
        on the drafting."""
        run = accepted_run(draft, samples)
        states = self.draw_states.pop(request_id, None)
        if states is not None and len(run) < len(states):
            self.req_generators[request_id].set_state(states[len(run)])
        return run

    def held(self) -> dict[str, int]:
        return {"sampler.req_generators": len(self.req_generators), "sampler.draw_states": len(self.draw_states)}

    def _generator(self, row: SamplingRow) -> torch.Generator | None:
        if row.generator_seed is None:
            return None
        g = self.req_generators.get(row.request_id)
        if g is None:
            g = self.req_generators[row.request_id] = torch.Generator().manual_seed(row.generator_seed)
        return g

    def __call__(self, logits: torch.Tensor, reqs: list[SamplingRow],
                 masks: tuple[list[int], np.ndarray] | None = None, keep_states=(),
                 draft_probs: dict[str, torch.Tensor] | None = None) -> list[SampledToken]:
        """logits: (R, V) float32, one row per sample to draw (a request may own several rows).
        masks: (row indices, packed int32 bitmask rows) of the rows a grammar constrains.
        keep_states: request id -> its drafts (speculative rows; verify() may rewind a seeded one's draws).
        draft_probs: request id -> (k, V) the distributions q its drafts were sampled from: its rows are
        verified by full rejection sampling (speculative_sample)."""
        self.draw_states.clear()
        params = [r.params for r in reqs]
        lp_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        # the model's own logprobs, of the rows that want them (a copy: the masks below work in place)
        raw_lp = torch.log_softmax(logits[lp_rows], dim=-1) if lp_rows else None
        logits = self._apply_penalties(logits, reqs)
        logits = _apply_logit_bias(logits, reqs)
        if masks is not None:
            logits = _apply_masks(logits, *masks)
        greedy = [p.greedy for p in params]
        if all(greedy):
            tokens = logits.argmax(dim=-1)
        else:
            tokens = self._sample_random(logits, reqs, greedy, keep_states, draft_probs)
        ids = tokens.tolist()
        out = [SampledToken(t) for t in ids]
        if lp_rows:               # one call for all rows at the largest k, each row then cut to its own k
            ks = [params[i].logprobs for i in lp_rows]
            for i, k, d in zip(lp_rows, ks, logprobs_of(raw_lp, [ids[i] for i in lp_rows], max(ks))):
                out[i].logprobs = d if k == max(ks) else {t: v for t, v in d.items() if t == ids[i] or v.rank <= k}
        return out

    def sample_on_device(self, logits: torch.Tensor, reqs: list[SamplingRow],
                         masks: tuple[list[int], np.ndarray] | None = None, keep_states=(),
                         draft_probs: dict[str, torch.Tensor] | None = None) -> list[SampledToken]:
        """As __call__, with `logits` on the model's device. Host logits go straight to __call__. On an
        accelerator the rows that take a plain argmax (takes_plain_argmax) are reduced there and only their
        token ids cross to the host; the other rows' logits go to __call__ on the host, whose per-request
        generators are CPU ones. (A 64-row decode step of a 128k vocabulary copied 33 MB and took its
        argmax on the CPU: most of an H200's step.)"""
        if logits.device.type == "cpu":
            return self(logits, reqs, masks, keep_states, draft_probs)
        return self.split_argmax(logits, reqs, masks, keep_states, draft_probs)

    def split_argmax(self, logits: torch.Tensor, reqs: list[SamplingRow], masks=None, keep_states=(),
                     draft_probs=None) -> list[SampledToken]:
        """sample_on_device's split, on any device (the CPU tests call it directly): plain-argmax rows on
        `logits`' device, the rest through __call__ on host copies of their rows, in the rows' order."""
        constrained = set(masks[0]) if masks is not None else set()
        plain = [i for i, r in enumerate(reqs) if i not in constrained and takes_plain_argmax(r)]
        out: list[SampledToken | None] = [None] * len(reqs)
        dev = logits.device
        if plain:
            rows = logits if len(plain) == len(reqs) else logits[torch.tensor(plain, device=dev)]
            for i, t in zip(plain, rows.argmax(dim=-1).tolist()):
                out[i] = SampledToken(t)
        rest = [i for i, o in enumerate(out) if o is None]
        if not rest:
            self.draw_states.clear()
            return out
        at = {i: j for j, i in enumerate(rest)}     # every constrained row is in `rest`
        sub_masks = ([at[i] for i in masks[0]], masks[1]) if masks is not None else None
        host = (logits if len(rest) == len(reqs) else logits[torch.tensor(rest, device=dev)]).cpu()
        for i, smp in zip(rest, self(host, [reqs[i] for i in rest], sub_masks, keep_states, draft_probs)):
            out[i] = smp
        return out

    def _apply_penalties(self, logits: torch.Tensor, reqs: list[SamplingRow]) -> torch.Tensor:
        need_pen = [i for i, r in enumerate(reqs) if _penalized(r)]
        need_min = [i for i, r in enumerate(reqs) if _min_tokens_pending(r)]
        if not need_pen and not need_min:
            return logits
        logits = logits.clone()
        V = logits.shape[1]
        for i in need_pen:
            p, r = reqs[i].params, reqs[i]
            row = logits[i]
            if p.repetition_penalty != 1.0:
                seen = torch.tensor(sorted(set(r.history)), dtype=torch.long)
                seen = seen[seen < V]
                vals = row[seen]
                row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
            if (p.presence_penalty or p.frequency_penalty) and len(r.history) > r.num_prompt_tokens:
                output = r.history[r.num_prompt_tokens:]
                counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=V)[:V].float()
                row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
        for i in need_min:   # min_tokens: EOS and stop tokens are not allowed yet
            r = reqs[i]
            banned = [t for t in (*r.eos_token_ids, *r.params.stop_token_ids) if t < V]
            if banned:
                logits[i, banned] = float("-inf")
        return logits

    def _sample_random(self, logits: torch.Tensor, reqs: list[SamplingRow], greedy: list[bool],
                       keep_states=(), draft_probs=None) -> torch.Tensor:
        probs = sampling_probs(logits, [r.params for r in reqs], greedy)
        if draft_probs:
            speculative_sample(probs, [r.request_id for r in reqs], keep_states, draft_probs, self.generator)
        # exponential race: argmax(p / q), q ~ Exp(1), draws one sample from p; per-request
        # generators make a seeded request's draws independent of whatever else is in the batch.
        # q = -log(u), u ~ U[0, 1): torch's exponential_ is ~3.5x slower on the CPU (1.45 ms a row of
        # 49,152 here, most of a sampled token's cost); u = 0 gives q = inf, a weight of 0.
        # (the engine's generator fills the batch only where some row has no generator of its own)
        gens = [self._generator(r) for r in reqs]
        u = torch.empty_like(probs)
        if any(g is None for g in gens):
            u.uniform_(generator=self.generator)
        for i, (r, g) in enumerate(zip(reqs, gens)):
            if g is not None:
                if r.request_id in keep_states:
                    self.draw_states.setdefault(r.request_id, []).append(g.get_state())
                u[i].uniform_(generator=g)
        sampled = (probs / u.log_().neg_()).argmax(dim=-1)
        return torch.where(torch.tensor(greedy), logits.argmax(dim=-1), sampled) if any(greedy) else sampled


def _penalized(row: SamplingRow) -> bool:
    p = row.params
    return p.repetition_penalty != 1.0 or bool(p.presence_penalty) or bool(p.frequency_penalty)


def _min_tokens_pending(row: SamplingRow) -> bool:
    return row.num_output_tokens < row.params.min_tokens


def takes_plain_argmax(row: SamplingRow) -> bool:
    """A row whose token is the argmax of the raw logits: greedy, without logprobs, logit bias, or what
    _apply_penalties changes (penalties, min_tokens still to come); a grammar mask is the caller's to check."""
    p = row.params
    return p.greedy and p.logprobs is None and not p.logit_bias and not _penalized(row) and not _min_tokens_pending(row)


def sampling_probs(logits: torch.Tensor, params: list, greedy: list[bool]) -> torch.Tensor:
    """The distribution each row samples from: temperature, top-k, top-p, min-p (greedy rows: softmax
    of the logits, unused)."""
    temp = torch.tensor([1.0 if g else p.temperature for g, p in zip(greedy, params)]).unsqueeze(1)
    x = logits / temp
    top_k = [p.top_k if p.top_k > 0 else 0 for p in params]
    top_p = [p.top_p for p in params]
    if any(top_k) or any(tp < 1.0 for tp in top_p):
        x = _top_k_top_p(x, top_k, top_p)
    probs = torch.softmax(x, dim=-1)
    min_p = [p.min_p for p in params]
    if any(min_p):
        mp = torch.tensor(min_p).unsqueeze(1)
        probs = torch.where(probs < mp * probs.max(dim=-1, keepdim=True).values, 0.0, probs)
    return probs


def speculative_sample(probs: torch.Tensor, row_ids: list[str], drafts: dict[str, tuple[int, ...]],
                       draft_probs: dict[str, torch.Tensor], generator: torch.Generator) -> None:
    """Rejection sampling of drafts drawn from a distribution q (a draft model's sampled proposals), in
    place: row i of a speculative sequence (its target distribution p after drafts 1..i) becomes one-hot
    on draft d = d_(i+1) with probability min(1, p(d) / q(d)), else max(p - q, 0) (the residual: never
    d); its last row keeps p (the bonus token). Sampling the rows then gives d exactly when it is
    accepted, so accepted_run ends the run at the first rejection with a residual sample: the tokens
    follow p whatever q is (Leviathan et al. 2023; vLLM's rejection sampler)."""
    seen: dict[str, int] = {}
    for i, rid in enumerate(row_ids):
        q = draft_probs.get(rid)
        if q is None:
            continue
        j = seen[rid] = seen.get(rid, -1) + 1
        draft = drafts[rid]
        if j >= len(draft):
            continue                                    # the bonus row
        d = draft[j]
        p = probs[i]
        accept = (p[d] / q[j, d]).clamp(max=1.0)      # q[j, d] > 0: d was drawn from it
        if torch.rand((), generator=generator) < accept:
            p.zero_()
            p[d] = 1.0
        else:
            residual = (p - q[j]).clamp_(min=0.0)
            if residual.sum() > 0:                    # (p = q everywhere: every draft is accepted)
                p.copy_(residual)


def accepted_run(draft: tuple[int, ...], samples: list[SampledToken]) -> list[SampledToken]:
    """Verification. samples[i] was drawn from the target's distribution after draft tokens 1..i;
    draft i + 1 is accepted when samples[i] is that token, and the first sample that differs (or the
    last, after all k are accepted) ends the run. For a draft that proposes one token with certainty
    (n-gram lookup, a draft model's greedy token: q = 1 on it) this is exactly rejection sampling:
    accept with min(1, p/q) = p(d), else draw from max(p - q, 0) renormalised = p without d, which is
    what a sample from p that is not d is; drafts sampled from a wider q had their rows made so by
    speculative_sample. Greedy rows take the argmax: the output is the one decoding without drafts gives."""
    run = []
    for d, smp in zip(draft, samples):
        run.append(smp)
        if smp.token_id != d:
            return run
    run.append(samples[len(draft)])
    return run


def _top_k_top_p(x: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    srt, idx = x.sort(dim=-1, descending=True)
    V = x.shape[1]
    pos = torch.arange(V).unsqueeze(0)
    k = torch.tensor([k if k > 0 else V for k in top_k]).unsqueeze(1)
    srt = srt.masked_fill(pos >= k, float("-inf"))
    p = torch.tensor(top_p).unsqueeze(1)
    probs = torch.softmax(srt, dim=-1)
    drop = (probs.cumsum(dim=-1) - probs) > p        # keep the smallest prefix whose mass reaches top_p
    srt = srt.masked_fill(drop, float("-inf"))
    return torch.full_like(x, float("-inf")).scatter(1, idx, srt)


def _apply_logit_bias(logits: torch.Tensor, reqs: list[SamplingRow]) -> torch.Tensor:
    rows, cols, vals = [], [], []
    V = logits.shape[1]
    for i, r in enumerate(reqs):
        for t, b in (r.params.logit_bias or {}).items():
            if t < V:
                rows.append(i), cols.append(t), vals.append(float(b))
    if not rows:
        return logits
    logits = logits.clone()
    logits.index_put_((torch.tensor(rows), torch.tensor(cols)), torch.tensor(vals), accumulate=True)
    return logits


def _apply_masks(logits: torch.Tensor, rows: list[int], packed: np.ndarray) -> torch.Tensor:
    """Disallowed tokens of the constrained rows to -inf (bit t of a packed row = token t allowed), in
    place: the logits are this step's own (the raw logprobs were taken before)."""
    V = logits.shape[1]
    banned = ~torch.from_numpy(np.unpackbits(np.ascontiguousarray(packed).view(np.uint8), axis=1,
                                             bitorder="little")[:, :V].view(bool))
    if len(rows) == logits.shape[0]:
        return logits.masked_fill_(banned, float("-inf"))
    idx = torch.tensor(rows)
    logits[idx] = logits[idx].masked_fill_(banned, float("-inf"))
    return logits


def logprobs_of(lp: torch.Tensor, targets: list[int], k: int) -> list[dict[int, Logprob]]:
    """Per row of log-probabilities `lp` (N, V): the target's logprob and rank, then the top k."""
    t = torch.tensor(targets, dtype=torch.long).unsqueeze(1)
    chosen = lp.gather(1, t)
    ranks = ((lp > chosen).sum(dim=1) + 1).tolist()
    chosen = chosen.squeeze(1).tolist()
    out = [{tok: Logprob(c, r)} for tok, c, r in zip(targets, chosen, ranks)]
    if k:
        vals, ids = lp.topk(k, dim=1)
        for d, vs, ts in zip(out, vals.tolist(), ids.tolist()):
            for rank, (v, tok) in enumerate(zip(vs, ts), start=1):
                if tok not in d:
                    d[tok] = Logprob(v, rank)
    return out
