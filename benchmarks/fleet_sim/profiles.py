"""Cost models of the simulated nodes: one fitted to this machine's recorded runs, and GPU
profiles derived from published figures.

A profile prices what the router cannot see but the nodes spend: prefill and `d_direct`
compute per token, the KV transfer between P and D (bytes per token over a bandwidth),
decode steps, and how many KV blocks a decode node has. Everything is linear in tokens;
the simulator adds the queueing (one prefill at a time per node) on top.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
from pydantic import BaseModel, ConfigDict, Field


class Profile(BaseModel):
    """Per-node cost constants (seconds, bytes, blocks)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    block_size: int = Field(ge=1)
    kv_bytes_per_token: int = Field(ge=1)
    #: P: fixed per leg (HTTP, scheduling, D's first step: latency, not P's compute time)
    #: + per computed token (P's compute, one prefill at a time).
    prefill_fixed_s: float = Field(ge=0)
    prefill_per_token_s: float = Field(ge=0)
    #: D extending its own prefix (`d_direct`): fixed + per new token.
    d_direct_fixed_s: float = Field(ge=0)
    d_direct_per_token_s: float = Field(ge=0)
    #: Attention: every computed token (on P or in a `d_direct` delta) also costs this much
    #: per token of context before it (cached, pulled, or computed earlier in the same
    #: prefill). 0: compute is linear in the new tokens alone.
    per_token_per_context_s: float = Field(default=0.0, ge=0)
    #: One NIXL read (either direction): fixed + bytes / bandwidth.
    xfer_fixed_s: float = Field(ge=0)
    xfer_bytes_per_s: float = Field(gt=0)
    #: One decode step (one output token for every running sequence): base + per sequence.
    decode_step_s: float = Field(gt=0)
    decode_step_per_seq_s: float = Field(default=0.0, ge=0)
    #: KV blocks of one decode node.
    d_kv_blocks: int = Field(ge=1)
    #: How the constants were obtained (shown in the docs).
    source: str = ""

    def _attention_s(self, tokens: int, context: int) -> float:
        """Extra seconds for `tokens` new tokens after `context` ones: each attends to the
        context and to the new tokens before it (`context + (tokens - 1) / 2` on average)."""
        if tokens <= 0:
            return 0.0
        return self.per_token_per_context_s * tokens * (context + (tokens - 1) / 2)

    def prefill_compute_s(self, tokens: int, context: int = 0) -> float:
        """P's compute for `tokens` new tokens after `context` (the part P serialises)."""
        return self.prefill_per_token_s * tokens + self._attention_s(tokens, context)

    def prefill_s(self, tokens: int, context: int = 0) -> float:
        return self.prefill_fixed_s + self.prefill_compute_s(tokens, context)

    def d_direct_s(self, tokens: int, context: int = 0) -> float:
        return (self.d_direct_fixed_s + self.d_direct_per_token_s * tokens
                + self._attention_s(tokens, context))

    def xfer_s(self, tokens: int) -> float:
        return self.xfer_fixed_s + tokens * self.kv_bytes_per_token / self.xfer_bytes_per_s

    def step_s(self, batch: int) -> float:
        return self.decode_step_s + self.decode_step_per_seq_s * max(0, batch - 1)


# ------------------------------------------------------------------ this machine

#: The demo model: 4 layers x (K, V) x hidden 256 x float32.
DEMO_KV_BYTES_PER_TOKEN = 4 * 2 * 256 * 4
#: Bundle defaults on CPU: 2 GiB KV cache per node, vLLM's CPU block size.
DEMO_BLOCK_SIZE = 128
DEMO_D_KV_BLOCKS = (2 << 30) // (DEMO_KV_BYTES_PER_TOKEN * DEMO_BLOCK_SIZE)

_PD_CONFIGS = ("kvagent", "pd_noreuse_pcache_off", "pd_noreuse_pcache_on")


def _lstsq_nonneg(rows: list[list[float]], y: list[float]) -> list[float]:
    """Least squares with coefficients clipped at 0 (refit without the clipped ones)."""
    a, b = np.asarray(rows, float), np.asarray(y, float)
    keep = list(range(a.shape[1]))
    while True:
        coef, *_ = np.linalg.lstsq(a[:, keep], b, rcond=None)
        if (coef >= 0).all() or len(keep) == 1:
            out = [0.0] * a.shape[1]
            for i, c in zip(keep, coef, strict=True):
                out[i] = max(0.0, float(c))
            return out
        keep.pop(int(np.argmin(coef)))


#: Configurations a fit skips per run: the full run of 2026-11-30 had foreign vLLM nodes on
#: the cores during `pd_noreuse_pcache_off` (docs/benchmarks.md, caveat).
CONTAMINATED = {"20261130T020127Z": ("pd_noreuse_pcache_off",)}


def fit_machine_profile(results: Path | list[Path], *, name: str = "cpu-demo") -> Profile:
    """Fit this machine's constants to a recorded multi-turn benchmark run.

    Every P/D request of the reuse-on and reuse-off configurations is one equation (with
    two conversations in flight hardly any ran alone, so queueing is in the samples; the
    simulator serialises only the per-token part on P, the fixed part is latency): `ttft = F + p * computed_on_P + x * tokens_moved_to_D` (`pd_reuse`
    adds `x * reused_tokens` for the pull from D); every `d_direct` request
    `ttft = F_d + d * new_tokens`. `x` gives the bandwidth through the demo model's known
    bytes per token. The decode step is the median time per output token of kvagent's
    requests. `run.py validate` replays the same runs with their concurrency.
    """
    files = [Path(results)] if isinstance(results, (str, Path)) else [Path(p) for p in results]
    pd_rows: list[list[float]] = []
    pd_y: list[float] = []
    dd_rows: list[list[float]] = []
    dd_y: list[float] = []
    tpot: list[float] = []
    for config, r in _records(files):
        if r.get("error"):
            continue
        prompt, cached = r["prompt_tokens"], r.get("cached_tokens") or 0
        if config["name"] == "kvagent":
            t, n = r.get("tpot_s"), r.get("completion_tokens") or 0
            if t is None and n > 1 and r.get("e2e_s") is not None:
                t = (r["e2e_s"] - r["ttft_s"]) / (n - 1)
            if t is not None:
                tpot.append(t)
        if r.get("path") in ("d_direct", "d_fresh"):  # D computes, nothing is pulled
            dd_rows.append([1.0, prompt - cached])
            dd_y.append(r["ttft_s"])
        else:
            # D pulls the prompt's KV from P; after a reuse pull D still holds that prefix,
            # but the pull moved the same tokens the other way: `prompt` tokens either way.
            pd_rows.append([1.0, prompt - cached, prompt])
            pd_y.append(r["ttft_s"])
    f, p, x = _lstsq_nonneg(pd_rows, pd_y)
    fd, d = _lstsq_nonneg(dd_rows, dd_y) if len(dd_rows) >= 2 else (f, p * 1.5)
    step = float(np.median(tpot)) if tpot else 0.015
    bw = DEMO_KV_BYTES_PER_TOKEN / x if x > 0 else 1e12
    return Profile(
        name=name, block_size=DEMO_BLOCK_SIZE, kv_bytes_per_token=DEMO_KV_BYTES_PER_TOKEN,
        prefill_fixed_s=f, prefill_per_token_s=p, d_direct_fixed_s=fd, d_direct_per_token_s=d,
        xfer_fixed_s=0.0, xfer_bytes_per_s=bw, decode_step_s=step, d_kv_blocks=DEMO_D_KV_BLOCKS,
        source=f"least-squares fit to {len(pd_y)} P/D and {len(dd_y)} d_direct requests of "
               f"{', '.join(f.parent.name for f in files)}; decode step = median TPOT of "
               f"{len(tpot)} kvagent requests")


def _records(files: list[Path]):
    for f in files:
        data = json.loads(f.read_text())
        skip = CONTAMINATED.get(f.parent.name, ())
        for config in data["configs"]:
            if config["name"] in _PD_CONFIGS and config["name"] not in skip:
                for r in config["records"]:
                    if r.get("ttft_s") is not None:
                        yield config, r


# ------------------------------------------------------------------ GPU, published figures


def derive_from_reuse_report(*, tokens: int, ttft_noreuse_s: float, ttft_reuse_s: float,
                             new_tokens: int, fixed_s: float) -> tuple[float, float]:
    """Per-token prefill and transfer seconds from a TTFT pair with and without reuse.

    Without reuse P computes all `tokens` and D pulls them all:
    `T0 = F + N (p + x)`. With reuse P pulls the N - n cached tokens from D, computes
    the n new ones, and D (holding the prefix in its own cache) pulls only those n:
    `T1 = F + (N - n) x + n p + n x = F + N x + n p`. Subtracting: `p = (T0 - T1) / (N - n)`,
    then `x = (T0 - F) / N - p`. `n` and `F` are not in the report: assumed.
    """
    n_all, n = tokens, new_tokens
    p = (ttft_noreuse_s - ttft_reuse_s) / (n_all - n)
    x = (ttft_noreuse_s - fixed_s) / n_all - p
    if p <= 0 or x <= 0:
        raise ValueError("figures inconsistent with the model")
    return p, x


#: Qwen3-32B: 64 layers x (K, V) x 8 KV heads x head dim 128 x bf16.
QWEN3_32B_KV_BYTES = 64 * 2 * 8 * 128 * 2
#: Assumptions the report does not give (stated in the docs).
GPU_ASSUMED_NEW_TOKENS = 1000
GPU_ASSUMED_FIXED_S = 0.030
GPU_BLOCK_SIZE = 16
#: H200 (141 GB), bf16 weights of a 32B model (~65.5 GB) at 0.9 memory utilisation,
#: ~5 GB for activations and graphs: ~56 GB of KV.
GPU_D_KV_BYTES = 56e9
GPU_DECODE_STEP_S = 0.025  # assumed TPOT of a 32B model at small batch
GPU_DECODE_STEP_PER_SEQ_S = 0.0002


def gpu_profile() -> Profile:
    """Qwen3-32B on H200-class GPUs from the AWS bidirectional-transfer figures
    (~24k tokens, TTFT 778 ms without reuse, 460 ms with)."""
    p, x = derive_from_reuse_report(tokens=24_000, ttft_noreuse_s=0.778, ttft_reuse_s=0.460,
                                    new_tokens=GPU_ASSUMED_NEW_TOKENS,
                                    fixed_s=GPU_ASSUMED_FIXED_S)
    blocks = math.floor(GPU_D_KV_BYTES / (QWEN3_32B_KV_BYTES * GPU_BLOCK_SIZE))
    return Profile(
        name="gpu-qwen3-32b", block_size=GPU_BLOCK_SIZE, kv_bytes_per_token=QWEN3_32B_KV_BYTES,
        prefill_fixed_s=GPU_ASSUMED_FIXED_S, prefill_per_token_s=p,
        # D computing a delta competes with its decodes: priced as the router's prior does
        # (1.5x P's per-token cost), plus one decode step.
        d_direct_fixed_s=GPU_DECODE_STEP_S, d_direct_per_token_s=1.5 * p,
        xfer_fixed_s=0.0, xfer_bytes_per_s=QWEN3_32B_KV_BYTES / x,
        decode_step_s=GPU_DECODE_STEP_S, decode_step_per_seq_s=GPU_DECODE_STEP_PER_SEQ_S,
        d_kv_blocks=blocks,
        source="AWS report, Qwen3-32B ~24k tokens, TTFT 778 -> 460 ms; assumed 1,000 new "
               "tokens per turn and 30 ms fixed; KV bytes from the model's shape")


def glm_constants() -> tuple[float, float]:
    """Per-token prefill and transfer seconds from the report's GLM figures (20k tokens,
    2,334 -> 702 ms), under the same assumptions (for the docs' table)."""
    return derive_from_reuse_report(tokens=20_000, ttft_noreuse_s=2.334, ttft_reuse_s=0.702,
                                    new_tokens=GPU_ASSUMED_NEW_TOKENS,
                                    fixed_s=GPU_ASSUMED_FIXED_S)
