"""The offline API, named as vLLM's: LLM(model, **engine_args).generate / .chat / .beam_search."""
from __future__ import annotations

from dataclasses import dataclass

from pagedserve.config import EngineArgs
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.engine.multimodal import split_image_parts
from pagedserve.errors import ParamError
from pagedserve.lora_request import LoRARequest
from pagedserve.engine.outputs import CompletionOutput, EmbeddingOutput, EmbeddingRequestOutput, RequestOutput
from pagedserve.sampling_params import BeamSearchParams, PoolingParams, SamplingParams
from pagedserve.tokenizer import apply_chat_template


@dataclass(slots=True)
class BeamSequence:
    tokens: list[int]
    cum_logprob: float = 0.0
    finished: bool = False


class LLM:
    def __init__(self, model: str | None = None, **engine_args):
        self.engine = LLMEngine(EngineArgs(model=model, **engine_args))

    def shutdown(self) -> None:
        """Stop tensor-parallel workers now (they also stop when the LLM is collected or at exit)."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: list[int] | None = None,
                 lora_request: LoRARequest | list[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """`lora_request`: the LoRA adapter every prompt runs with, or one per prompt (None: the base model)."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"sampling_params: got {len(params)} for {len(prompts)} prompts")
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"priority: got {len(priority)} values for {len(prompts)} prompts")
        loras = lora_request if isinstance(lora_request, list) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"lora_request: got {len(loras)} for {len(prompts)} prompts")
        if any(p.use_beam_search for p in params):
            if lora_request is not None:
                raise ValueError("lora_request: beam search runs the base model only")
            return [self._beam_search_one(pr, p) for pr, p in zip(prompts, params)]
        return self._run(prompts, params, priority, use_tqdm, loras)

    def _run(self, prompts, params, priority, use_tqdm, loras=None) -> list[RequestOutput]:
        eng = self.engine
        prompts = self._tokenized(prompts)
        ids = []
        try:
            for i, (pr, sp) in enumerate(zip(prompts, params)):
                ids.append(eng.add_request(None, pr, sp, priority=priority[i] if priority else 0,
                                           lora_request=loras[i] if loras else None))
        except Exception:
            for rid in ids:
                eng.abort(rid)
            raise
        done: dict[str, RequestOutput] = {}
        bar = _progress(len(ids), use_tqdm)
        while eng.has_unfinished_requests():
            for out in eng.step():
                if out.finished:
                    done[out.request_id] = out
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return [done[r] for r in ids]

    def _tokenized(self, prompts: list) -> list:
        """Tokenization before submit: the text prompts as {"prompt", "prompt_token_ids"}, tokenized in one
        batch call (the fast tokenizer encodes a batch in Rust, on several threads); other prompts as given."""
        texts = [i for i, p in enumerate(prompts) if isinstance(p, str)]
        if len(texts) < 2:
            return prompts
        enc = self.engine.tokenizer([prompts[i] for i in texts])["input_ids"]
        prompts = list(prompts)
        for i, ids in zip(texts, enc):
            prompts[i] = {"prompt": prompts[i], "prompt_token_ids": list(ids)}
        return prompts

    def embed(self, prompts, pooling_params: PoolingParams | None = None,
              use_tqdm: bool = True) -> list[EmbeddingRequestOutput]:
        """vLLM's LLM.embed: each prompt's pooled final hidden states (PoolingParams: pooling type,
        normalize, dimensions; default the model's). The prompts run batched like any requests."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        outs = self._run(prompts, [pooling_params or PoolingParams()] * len(prompts), None, use_tqdm)
        return [EmbeddingRequestOutput(o.request_id, o.prompt_token_ids, EmbeddingOutput(o.embedding), o.finished)
                for o in outs]

    def chat(self, messages, sampling_params: SamplingParams | None = None, use_tqdm: bool = True,
             add_generation_prompt: bool = True, lora_request: LoRARequest | None = None) -> list[RequestOutput]:
        """Image parts ({"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}) as the
        server takes them (engine/multimodal.py)."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self._chat_prompt(c, add_generation_prompt) for c in convs]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def _chat_prompt(self, conv: list[dict], add_generation_prompt: bool) -> dict:
        eng = self.engine
        contents, urls = split_image_parts([m.get("content") for m in conv], eng.images)
        conv = [m if c is m.get("content") else {**m, "content": c} for m, c in zip(conv, contents)]
        ids = apply_chat_template(eng.tokenizer, conv, add_generation_prompt)
        return eng.images.prompt(ids, urls, eng.args.allowed_media_domains) if urls else {"prompt_token_ids": ids}

    # ------------------------------------------------------------ beam search
    def beam_search(self, prompts, params: BeamSearchParams) -> list[RequestOutput]:
        sp = SamplingParams(n=params.beam_width, use_beam_search=True, max_tokens=params.max_tokens,
                            ignore_eos=params.ignore_eos, length_penalty=params.length_penalty)
        return [self._beam_search_one(p, sp) for p in (prompts if isinstance(prompts, list) else [prompts])]

    def _beam_search_one(self, prompt, sp: SamplingParams) -> RequestOutput:
        """vLLM's scheme: each step runs every live beam one token further with 2*width logprobs and keeps
        the best `width` continuations. Beams share their common prefix through the prefix cache: a
        step re-reads cached full blocks and computes only the tail of the last partial block."""
        eng, width = self.engine, sp.beam_width
        if isinstance(prompt, dict) and (prompt.get("multi_modal_data") or prompt.get("mm_features")):
            raise ParamError("multi_modal_data", "multi_modal_data: beam search does not take images")
        text, prompt_ids = eng.tokenize(prompt)
        eos = set(eng.info.eos_token_ids) if not sp.ignore_eos else set()
        eng.check_fits(len(prompt_ids), sp.max_tokens or 1)
        step_params = SamplingParams(max_tokens=1, logprobs=2 * width, ignore_eos=True)
        beams = [BeamSequence([])]
        finished: list[BeamSequence] = []
        self.beam_peak_blocks = 0
        for _ in range(sp.max_tokens):
            ids = [eng.add_request(None, {"prompt_token_ids": prompt_ids + b.tokens}, step_params) for b in beams]
            outs: dict[str, RequestOutput] = {}
            while eng.has_unfinished_requests():
                self.beam_peak_blocks = max(self.beam_peak_blocks, eng.stats().num_used_blocks)
                for o in eng.step():
                    outs[o.request_id] = o
            cands = []
            for b, rid in zip(beams, ids):
                for tok, lp in outs[rid].outputs[0].logprobs[0].items():
                    cands.append(BeamSequence(b.tokens + [tok], b.cum_logprob + lp.logprob))
            cands.sort(key=lambda c: c.cum_logprob, reverse=True)
            beams = []
            for c in cands:
                if c.tokens[-1] in eos:
                    if len(finished) < width:
                        finished.append(BeamSequence(c.tokens, c.cum_logprob, True))
                else:
                    beams.append(c)
                if len(beams) == width:
                    break
            if not beams:
                break
        finished.extend(beams)

        def score(b: BeamSequence) -> float:
            return b.cum_logprob / (max(1, len(b.tokens)) ** sp.length_penalty)

        best = sorted(finished, key=score, reverse=True)[: sp.n]
        tok = eng.tokenizer
        outs = [CompletionOutput(i, tok.decode(b.tokens, skip_special_tokens=True), b.tokens, b.cum_logprob, None,
                                 "stop" if b.finished else "length") for i, b in enumerate(best)]
        return RequestOutput(f"beam-{id(best)}", text, prompt_ids, outs, True)


def _progress(total: int, use_tqdm: bool):
    if not use_tqdm or total < 8:
        return None
    from tqdm import tqdm
    return tqdm(total=total, desc="Processed prompts", dynamic_ncols=True)


__all__ = ["LLM"]
