"""EncoderCacheManager: which images' encoder outputs the runner keeps, decided here (plain Python, as
vLLM v1's encoder cache manager). The runner holds the tensors under the same content hashes; each
step record tells it which to drop. Two limits:

- a per-step **encoder budget** (image tokens encoded in one step): a prefill chunk that would reach an
  image not yet encoded beyond it is cut before that image, so a request with many images cannot
  stall the step's decodes (the image is encoded in a later step);
- where an image's tokens attend to each other both ways (Gemma 3: `whole_images`), a prefill chunk
  never ends inside an image (`whole`; vLLM's disable_chunked_mm_input): cut before it, or, when the
  chunk starts at (or, after a prefix hit, inside) it, run to its end if the step's token budget holds
  that, past the long-prefill threshold and a traffic class's time fit (else the request waits a step);
- a **capacity** (image tokens kept): entries no running request uses are evicted least recently used
  first when a new one needs room. Entries in use are never evicted (they may exceed the capacity
  while many different images prefill at once; the next releases bring it back down).

A request's reference on an image lasts from the chunk that first reads it until the request finishes
or is preempted; a later request (or the preempted one's recompute) reading the same image finds it
here and runs no encoder (a hit)."""
from __future__ import annotations

from collections import OrderedDict

from pagedserve.core.request import MMFeature, Request


class EncoderCacheManager:
    def __init__(self, capacity_tokens: int, budget_tokens: int, whole_images: bool = False):
        self.capacity_tokens = capacity_tokens
        self.budget_tokens = budget_tokens
        self.whole_images = whole_images                    # no prefill chunk ends inside an image
        self.sizes: OrderedDict[str, int] = OrderedDict()   # hash -> image tokens, least recently used first
        self.size_tokens = 0                                # sum of sizes (what /metrics shows)
        self.users: dict[str, set[str]] = {}                # hash -> request ids holding it
        self.held_by: dict[str, set[str]] = {}              # request id -> hashes it holds
        self.to_free: list[str] = []                        # evicted since the last step record
        self.left = budget_tokens                           # this step's budget left
        self.planned: set[str] = set()                      # images this step encodes
        self.hits = 0                                       # image reads served from the cache
        self.misses = 0                                     # encoder runs

    def held(self) -> dict[str, int]:
        return {"encoder_cache.requests": len(self.held_by)}

    def begin_step(self) -> None:
        self.left, self.planned = self.budget_tokens, set()

    def cut(self, req: Request, start: int, n: int) -> int:
        """Tokens of req's chunk start..start+n-1 the step's encoder budget allows: cut before the first
        image that needs the encoder and does not fit what is left (an image alone larger than the whole
        budget still runs, alone in its step). Takes the budget of the images it lets through."""
        for f in req.mm_features:
            if not f.overlaps(start, start + n) or f.hash in self.sizes or f.hash in self.planned:
                continue
            if f.length > self.left and (self.planned or self.left < self.budget_tokens):
                return max(0, f.offset - start)
            self.left -= f.length
            self.planned.add(f.hash)
        return n

    def whole(self, req: Request, start: int, n: int, most: int) -> int:
        """Tokens of req's chunk start..start+n-1 with no image split at its end: cut before the image the
        chunk would end inside, or, when the chunk starts at or inside that image, run to its end if
        `most` (the tokens the step's budget allows) reaches it, else 0 (the request waits a step)."""
        if not self.whole_images:
            return n
        for f in req.mm_features:
            if f.offset < start + n < f.end:
                if f.offset > start:
                    return f.offset - start
                return f.end - start if f.end - start <= most else 0
        return n

    def use(self, req: Request, start: int, n: int) -> tuple[MMFeature, ...]:
        """The images a scheduled chunk reads; each is now held by req (an encoder run if not cached)."""
        rid, out = req.request_id, []
        for f in req.mm_features:
            if not f.overlaps(start, start + n):
                continue
            out.append(f)
            mine = self.held_by.setdefault(rid, set())
            if f.hash in mine:
                self.sizes.move_to_end(f.hash)
                continue
            if f.hash in self.sizes:
                self.hits += 1
                self.sizes.move_to_end(f.hash)
            else:
                self.misses += 1
                self._make_room(f.length)
                self.sizes[f.hash] = f.length
                self.size_tokens += f.length
            mine.add(f.hash)
            self.users.setdefault(f.hash, set()).add(rid)
        return tuple(out)

    def release(self, request_id: str) -> None:
        """req finished or was preempted: its images stay cached, evictable once nobody else reads them."""
        for h in self.held_by.pop(request_id, ()):
            users = self.users[h]
            users.discard(request_id)
            if not users:
                del self.users[h]
        self._make_room(0)                  # back under the capacity, now that these may be evicted

    def take_frees(self) -> tuple[str, ...]:
        out, self.to_free = tuple(self.to_free), []
        return out

    def _make_room(self, tokens: int) -> None:
        for h in [h for h in self.sizes if h not in self.users]:      # least recently used first
            if self.size_tokens + tokens <= self.capacity_tokens:
                return
            self.size_tokens -= self.sizes.pop(h)
            self.to_free.append(h)
