"""Finding a held turn by its tokens, for callers that name no conversation. Pure.

A held turn is indexed under a few chained block hashes of its tokens (`held_keys`): where
its prompt ended and where its sequence (prompt plus answer) ended, and one block before
that, since the next prompt renders the answer's last tokens (end of turn, stop token)
its own way. A new prompt looks up every block boundary of its own tokens, longest first
(`lookup_keys`): the first hit names the session whose latest handle the turn claims.

A hit is only a candidate: the planner still compares the prompt's token ids with the
handle's and reuses only the verified block-aligned prefix, so a collision or a stale
entry costs a recompute, never wrong KV. Keys are the node-independent chain of
`kv.hashing` over `BLOCK_TOKENS`-token blocks (the nodes' block sizes may differ), salted
with the tenant's cache salt; the store scopes them by tenant and caller besides.

Cost per turn: hashing the prompt's full blocks (sha256 of each block, about 1 ms per
8,000 tokens on one core) and one batched lookup; a held turn adds three index entries.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvagent_server.router.kv.hashing import BlockHasher

#: Tokens per indexed block: small enough that a short first turn is findable, large
#: enough that a long prompt's lookup stays a few hundred keys.
BLOCK_TOKENS = 32

_HASHER = BlockHasher("sha256")


def _chain(token_ids: Sequence[int], salt: str) -> list[str]:
    return [h.hex()[:32] for h in _HASHER.hashes(token_ids, BLOCK_TOKENS, cache_salt=salt)]


def held_keys(prompt_len: int, sequence: Sequence[int], salt: str) -> list[str]:
    """The keys to index a held turn under: its prompt's end, its sequence's end and the
    block before it (whole blocks only; none for a sequence under one block)."""
    chain = _chain(sequence, salt)
    if not chain:
        return []
    ends = {min(prompt_len // BLOCK_TOKENS, len(chain)), len(chain), len(chain) - 1}
    return [chain[n - 1] for n in sorted(ends, reverse=True) if n >= 1]


def lookup_keys(prompt_ids: Sequence[int], salt: str) -> list[str]:
    """Every block boundary of a new prompt's tokens, longest prefix first."""
    return list(reversed(_chain(prompt_ids, salt)))
