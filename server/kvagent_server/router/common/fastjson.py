"""JSON on the hot path (leg bodies out, node answers in): orjson, with stdlib fallbacks.

orjson is several times faster than `json` but differs at the edges: it writes only
64-bit integers and string keys (the stdlib then writes instead), refuses NaN and
Infinity (the stdlib then reads, and writes, such an answer), and reads integers beyond
64 bits as floats. So it is for what the nodes send (vLLM's own JSON: token ids, counts,
timestamps), while the client's request body keeps the stdlib parser
(`request.parse_json`), whose exact errors and integers clients see.
"""

from __future__ import annotations

import json
from typing import Any

import orjson


def parse(raw: bytes | str) -> tuple[Any, bool]:
    """A node's JSON answer, and whether the stdlib had to read it (then write it with
    `dumps_std`: it may hold NaN or Infinity). ValueError when it is not JSON."""
    try:
        return orjson.loads(raw), False
    except ValueError:
        return json.loads(raw), True


def loads(raw: bytes | str) -> Any:
    """A node's JSON answer (ValueError when it is not JSON)."""
    return parse(raw)[0]


def dumps(obj: Any) -> bytes:
    """Compact UTF-8 JSON, as `json.dumps(obj, separators=(",", ":"), ensure_ascii=False)`
    writes it, for values without NaN or Infinity (orjson would write those as null)."""
    try:
        return orjson.dumps(obj)
    except TypeError:  # orjson.JSONEncodeError: big ints, non-str keys, odd types
        return dumps_std(obj)


def dumps_std(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()
