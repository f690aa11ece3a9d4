"""A vLLM-like automatic prefix cache: fixed-size blocks of the prompt, each block's hash
chained on its parent's, full blocks only, least recently used evicted first.

The simulator has no tokenizer: a "token" is 4 characters of prompt text (as
`openai_shapes.prompt_tokens` counts them), so a 16-token block is 64 characters. A chat
prompt is rendered the way a chat template would (each message as `<|role|>content`, then
the generation prompt `<|assistant|>`), so a conversation's next turn, which repeats the
previous prompt and the reply, shares that prefix byte for byte. Pure logic, no I/O.
"""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from pdproc_sim.openai_shapes import Api

BLOCK_TOKENS = 16  # vLLM's default block size
CHARS_PER_TOKEN = 4
BLOCK_CHARS = BLOCK_TOKENS * CHARS_PER_TOKEN
GENERATION_PROMPT = "<|assistant|>"
# Beyond this many characters a prompt's blocks are not hashed (they count as uncached):
# bounds the work a hostile prompt can cause.
MAX_RENDERED_CHARS = 64 * 1024 * 1024


def _content_text(value: Any) -> str:
    """The text of a message's content: a string, or a list of text parts."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "".join(_content_text(part) for part in value)
    if isinstance(value, dict):
        return _content_text(value.get("text")) + _content_text(value.get("content"))
    return ""


def rendered_prompt(api: Api, body: dict[str, Any]) -> str:
    """The prompt as the engine would see it before tokenising."""
    if api is Api.CHAT:
        messages = body.get("messages")
        parts = []
        if isinstance(messages, list):
            for message in messages:
                if isinstance(message, dict):
                    role = message.get("role")
                    parts.append(f"<|{role if isinstance(role, str) else ''}|>")
                    parts.append(_content_text(message.get("content")))
        parts.append(GENERATION_PROMPT)
        return "".join(parts)
    if api is Api.GENERATE:
        ids = body.get("token_ids")
        # One 4-character "token" per id, so blocks hold 16 ids as in vLLM.
        if not isinstance(ids, list):
            return ""
        return "".join(f"{i & 0xFFFF:04x}" for i in ids if isinstance(i, int))
    field = "prompt" if api is Api.COMPLETIONS else "input"
    return _content_text(body.get(field))


def block_hashes(text: str) -> list[bytes]:
    """The chained hashes of the text's full blocks (a partial last block is never cached,
    as in vLLM). Blocks are cut on characters and hashed as UTF-8."""
    text = text[:MAX_RENDERED_CHARS]
    hashes: list[bytes] = []
    parent = b""
    for start in range(0, len(text) - BLOCK_CHARS + 1, BLOCK_CHARS):
        chunk = text[start : start + BLOCK_CHARS].encode("utf-8", "surrogatepass")
        parent = hashlib.blake2b(parent + chunk, digest_size=16).digest()
        hashes.append(parent)
    return hashes


@dataclass(frozen=True, slots=True)
class Lookup:
    """What the cache held of one prompt."""

    hashes: tuple[bytes, ...]
    cached_blocks: int
    prompt_tokens: int

    @property
    def cached_tokens(self) -> int:
        # vLLM always computes at least the prompt's last token (it needs its logits).
        limit = max(0, (self.prompt_tokens - 1) // BLOCK_TOKENS) * BLOCK_TOKENS
        return min(self.cached_blocks * BLOCK_TOKENS, limit)

    @property
    def uncached_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens


class PrefixCache:
    """One engine's KV blocks, keyed by chained block hash, least recently used evicted."""

    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks < 0:
            raise ValueError("capacity_blocks must be >= 0")
        self.capacity = capacity_blocks
        self._blocks: collections.OrderedDict[bytes, None] = collections.OrderedDict()

    @property
    def used(self) -> int:
        return len(self._blocks)

    @property
    def usage(self) -> float:
        """vllm:kv_cache_usage_perc (a fraction, as vLLM reports it)."""
        return self.used / self.capacity if self.capacity else 0.0

    def lookup(self, hashes: Sequence[bytes], prompt_tokens: int) -> Lookup:
        """The longest cached run of leading blocks (a hit stops at the first miss)."""
        hit = 0
        for block in hashes:
            if block not in self._blocks:
                break
            hit += 1
        return Lookup(tuple(hashes), hit, prompt_tokens)

    def store(self, hashes: Iterable[bytes]) -> None:
        """The blocks were computed (or received): most recently used now."""
        if not self.capacity:
            return
        blocks = self._blocks
        for block in hashes:
            if block in blocks:
                blocks.move_to_end(block)
            else:
                blocks[block] = None
                if len(blocks) > self.capacity:
                    blocks.popitem(last=False)

    def clear(self) -> None:
        self._blocks.clear()


SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")


class EngineCaches:
    """A server's prefix caches, one per DP rank (each vLLM engine has its own KV cache),
    and the counts vLLM exports about them."""

    def __init__(self, ranks: int, capacity_blocks: int) -> None:
        self.caches = [PrefixCache(capacity_blocks) for _ in range(ranks)]
        self.tokens_by_source: collections.Counter[tuple[int, str]] = collections.Counter()
        self.queries = collections.Counter[int]()  # prompt tokens looked up, per rank
        self.hits = collections.Counter[int]()  # of those, found cached
        self.waiting = [0] * ranks
        self.running = [0] * ranks

    @property
    def enabled(self) -> bool:
        return bool(self.caches and self.caches[0].capacity)

    def lookup(self, rank: int, text: str) -> Lookup:
        """The prompt's rendered text looked up; with a cache its tokens are counted from
        that text (chat template included, as an engine counts them)."""
        prompt_tokens = max(1, len(text) // CHARS_PER_TOKEN)
        found = self.caches[rank].lookup(block_hashes(text), prompt_tokens)
        self.queries[rank] += prompt_tokens
        self.hits[rank] += found.cached_tokens
        return found

    def count(self, rank: int, found: Lookup, *, received: bool = False) -> None:
        """The prompt's tokens by where they came from: the cache, or computed here, or (a
        decode's P/D request) received from the prefill."""
        self.tokens_by_source[rank, "local_cache_hit"] += found.cached_tokens
        source = "external_kv_transfer" if received else "local_compute"
        self.tokens_by_source[rank, source] += found.uncached_tokens

    def store(self, rank: int, hashes: Iterable[bytes]) -> None:
        self.caches[rank].store(hashes)

    def clear(self) -> None:
        for cache in self.caches:
            cache.clear()

    def reset_counts(self) -> None:
        self.tokens_by_source.clear()
        self.queries.clear()
        self.hits.clear()
