"""Finding a held turn by its tokens, for callers that name no conversation. Pure.

A held turn is indexed under a few chained block hashes of its tokens (`held_keys`): where
its prompt ended and where its sequence (prompt plus answer) ended, and one block before
that, since the next prompt renders the answer's last tokens (end of turn, stop token)
its own way. A new prompt looks up every block boundary of its own tokens, longest first
(`lookup_keys`): the first hit names the session whose latest handle the turn claims.

A hit is only a candidate. It is taken only when the new prompt repeats the held turn's
whole prompt (`extends`): a prompt ending inside a block shares that block's key with
every conversation that starts the same way (a system prompt, a short first question),
and a turn that only shares that scaffold must not claim another conversation's handle,
which is single-use. The planner then compares the token ids as for any reuse and reuses
only the verified block-aligned prefix, so a collision costs a recompute, never wrong KV. Keys are the node-independent chain of
`kv.hashing` over `BLOCK_TOKENS`-token blocks (the nodes' block sizes may differ), salted
with the tenant's cache salt; the store scopes them by tenant and caller besides.

Cost per turn: hashing the prompt's full blocks (sha256 of each block, about 1 ms per
8,000 tokens on one core), one batched lookup and, on a hit, a read of each candidate's
latest handle until one is extended; a held turn updates up to three index keys.
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


def caller_key(caller: str, key: str) -> str:
    """An index key as the store keeps it: the caller's own (one API key never finds
    another's turns)."""
    return f"{caller}/{key}"


#: Held turns one index key remembers, newest first: conversations that share a key (a
#: system prompt, a short question and a short answer all inside one block) each stay
#: findable while fewer than this many others wrote it since.
MAX_ENTRIES = 8


def add_entry(value: bytes | None, prompt_len: int, session: str) -> bytes:
    """An index key's value with the held turn `(prompt_len, session)` first: one line per
    held turn, newest first, this session's older line dropped, at most `MAX_ENTRIES`."""
    lines = [f"{prompt_len} {session}"]
    for line in (value or b"").decode().splitlines():
        if line.partition(" ")[2] != session and len(lines) < MAX_ENTRIES:
            lines.append(line)
    return "\n".join(lines).encode()


def entries(value: bytes) -> list[tuple[int, str]]:
    """The held turns `(prompt_len, session)` an index key's value names, newest first."""
    out = []
    for line in value.decode().splitlines():
        length, _, session = line.partition(" ")
        if length.isdigit() and session:
            out.append((int(length), session))
    return out


def extends(prompt_ids: Sequence[int], held_ids: Sequence[int], held_prompt_len: int) -> bool:
    """Whether a new prompt repeats a held turn's whole prompt (the tokens it was asked)."""
    need = min(held_prompt_len, len(held_ids))
    return len(prompt_ids) >= need and list(prompt_ids[:need]) == list(held_ids[:need])
