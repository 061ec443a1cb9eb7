"""The continuous engine's KV pages, host side: which pages are free, which sequences hold each, and how many a
sequence needs (JAX-free).

A bank of the engine (rollout.engine, sampler.kv_cache = paged) keeps every full-attention layer's keys and
values in one pool of `pages` pages of `page_size` positions each, plus one scratch page (index `pages`) that
rows with nothing to write point at. A sequence's key at position p lives in the p // page_size-th page it
holds. The samples of a group admitted together share the pages their prompt fills whole (a page's reference
count is the number of sequences holding it); the page holding the prompt's tail and every later one are the
sample's own, since the sample writes its tokens there. A page returns to the free list when no sequence
holds it.

Contract: `PagePool.take` never hands out a page that a sequence holds; `release` of what a sequence holds frees
exactly the pages no other sequence holds; the free count plus the distinct pages held is always `pages`.
"""

from __future__ import annotations

import numpy as np


def pages_for(positions: int, page_size: int) -> int:
    """Pages that hold `positions` key positions (0 .. positions - 1)."""
    return -(-positions // page_size)


def positions_needed(prompt_len: int, generated: int, limit: int, steps: int) -> int:
    """Key positions a sequence of a `prompt_len`-token prompt that has drawn `generated` tokens (of at most
    `limit`) writes up to, exclusive, in its next `steps` decode steps: each step writes the key of the last token
    drawn (position prompt_len + generated - 1, then one more per step), and the step that draws the last token
    it may draw is the last that writes."""
    return max(prompt_len, min(prompt_len + generated - 1 + steps, prompt_len + limit - 1))


class PagePool:
    """Free pages and reference counts of one bank's pool (see the module docstring)."""

    def __init__(self, pages: int):
        if pages <= 0:
            raise ValueError(f"PagePool: pages={pages}: must be positive")
        self.pages = pages
        self._free = list(range(pages - 1, -1, -1))  # a stack: the lowest page is handed out first
        self._refs = np.zeros(pages, np.int32)
        self.peak_used = 0

    @property
    def scratch(self) -> int:
        """The scratch page's index (one past the pool's pages): what rows that hold nothing point at."""
        return self.pages

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def used(self) -> int:
        return self.pages - len(self._free)

    def take(self, count: int) -> list[int]:
        """`count` free pages, each now held once."""
        if count > len(self._free):
            raise RuntimeError(f"PagePool: {count} pages asked, {len(self._free)} free")
        taken = [self._free.pop() for _ in range(count)]
        self._refs[taken] = 1
        self.peak_used = max(self.peak_used, self.used)
        return taken

    def share(self, pages: list[int]) -> None:
        """One more sequence holds each of `pages` (held already)."""
        if pages and np.any(self._refs[pages] <= 0):
            raise RuntimeError("PagePool: sharing a page nobody holds")
        np.add.at(self._refs, pages, 1)

    def release(self, pages: list[int]) -> None:
        """A sequence lets go of `pages`: those it alone held are free again."""
        if not pages:
            return
        np.add.at(self._refs, pages, -1)
        if np.any(self._refs[pages] < 0):
            raise RuntimeError("PagePool: a page released more often than it was held")
        self._free.extend(sorted({p for p in pages if self._refs[p] == 0}, reverse=True))

    def holders(self) -> np.ndarray:
        """[pages] int32: how many sequences hold each page (a copy)."""
        return self._refs.copy()
