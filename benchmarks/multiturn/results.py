"""The benchmark's result data: one record per request, summaries, the whole report.

These models are the JSON schema of `results.json`; the quick test validates against them.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, computed_field

SCHEMA_VERSION = 1


class RequestRecord(BaseModel):
    """What one streamed request measured. Times are seconds; None means "not observed"."""

    model_config = ConfigDict(extra="forbid")

    config: str
    conversation: str
    turn: int = Field(ge=0)
    start_s: float  # since the configuration's workload started
    ttft_s: float | None = None  # first content/tool-call delta (else first chunk w/ choices)
    first_chunk_s: float | None = None  # first data chunk of any kind
    e2e_s: float | None = None
    headers_s: float | None = None  # response headers received
    #: The router's stages from its `Server-Timing` header (receive, tokenize, plan,
    #: prefill, decode = D's time to headers, total = arrival to headers); {} without.
    stages_s: dict[str, float] = Field(default_factory=dict)
    itl_s: list[float] = Field(default_factory=list)  # gaps between token-bearing chunks
    #: (last token - first token) / (completion_tokens - 1): per-token decode time, robust to
    #: servers that put several tokens in one chunk or flush chunks in bursts.
    tpot_s: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens
    reused_tokens: int | None = None  # kvagent.reused_tokens (None: no kvagent object)
    path: str | None = None  # kvagent.path
    reason: str | None = None  # kvagent.reason: why that path (the reuse plan's label)
    sent_cache_token: bool = False
    got_cache_token: bool = False
    answer: str = ""
    status: int | None = None
    error: str | None = None


class Distribution(BaseModel):
    n: int
    mean: float | None = None
    p50: float | None = None
    p90: float | None = None
    p99: float | None = None
    min: float | None = None
    max: float | None = None


class TokenTotals(BaseModel):
    prompt: int = 0
    cached: int = 0  # not recomputed, by usage (prefix cache and/or reuse)
    reused: int = 0  # by the kvagent object
    recomputed: int = 0  # prompt - cached
    completion: int = 0


class TurnStats(BaseModel):
    turn: int
    requests: int
    errors: int
    ttft_s: Distribution
    itl_s: Distribution
    tpot_s: Distribution
    e2e_s: Distribution
    prompt_tokens_mean: float | None
    tokens: TokenTotals
    #: Share of requests with reused_tokens > 0; None when no response had a kvagent object.
    reuse_rate: float | None
    #: Share of requests with cached_tokens > 0 (any cache: reuse or prefix cache).
    cache_hit_rate: float | None
    paths: dict[str, int]


class Summary(BaseModel):
    requests: int
    errors: int
    wall_s: float
    ttft_s: Distribution
    ttft_later_turns_s: Distribution  # turns after the first: where reuse can happen
    itl_s: Distribution
    tpot_s: Distribution
    e2e_s: Distribution
    e2e_later_turns_s: Distribution
    tokens: TokenTotals
    reuse_rate_later_turns: float | None
    cache_hit_rate_later_turns: float | None
    requests_per_s: float | None
    output_tokens_per_s: float | None
    prompt_tokens_per_s: float | None
    paths: dict[str, int]
    #: Requests whose answer text equals the reference configuration's answer to the same
    #: (conversation, turn): greedy decoding makes a mismatch a correctness signal.
    answers_matching_reference: int | None = None
    answers_compared: int | None = None


class FloorSample(BaseModel):
    """One reused turn against its floor: the engine's own TTFT for the same request on one
    stock node with exactly the reused prefix cached, plus (`pd_reuse`) the reused KV's bytes
    at the machine's copy bandwidth."""

    conversation: str
    turn: int
    path: str
    reused_tokens: int
    prompt_tokens: int
    engine_ttft_s: float
    engine_cached_tokens: int | None = None
    transfer_s: float
    measured_ttft_s: float

    @property
    def new_tokens(self) -> int:
        return self.prompt_tokens - self.reused_tokens

    @computed_field  # type: ignore[prop-decorator]
    @property
    def floor_s(self) -> float:
        return self.engine_ttft_s + self.transfer_s

    @computed_field  # type: ignore[prop-decorator]
    @property
    def ratio(self) -> float:
        return self.measured_ttft_s / self.floor_s


class ConfigResult(BaseModel):
    name: str
    description: str
    #: The client API the workload was sent through (`apis.APIS`); rows of other APIs than
    #: chat are named `<configuration>:<api>`.
    api: str = "chat"
    status: Literal["ok", "failed", "skipped"]
    error: str | None = None
    startup_s: float | None = None
    #: Most vLLM processes not started by the benchmark seen running while the workload ran
    #: (sampled every few seconds): non-zero means the numbers include contention.
    foreign_vllm_max: int | None = None
    summary: Summary | None = None
    per_turn: list[TurnStats] = Field(default_factory=list)
    records: list[RequestRecord] = Field(default_factory=list)
    #: `--paired-floor`: each reused turn's floor, measured right after the turn itself.
    floor: list[FloorSample] = Field(default_factory=list)
    logs: str | None = None


class Targets(BaseModel):
    """The full run's goals, measured (never asserted). Ratios are of the median TTFT of
    turns after the first, keyed `kvagent/<baseline>`."""

    ratios: dict[str, float | None] = Field(default_factory=dict)
    kvagent_reuse_rate: float | None = None
    #: Goal name -> met (None: not measured in this run).
    met: dict[str, bool | None] = Field(default_factory=dict)


class PathBudget(BaseModel):
    """Mean seconds per TTFT segment (budget.SEGMENTS) for one (configuration, path)."""

    config: str
    path: str  # kvagent's path, or "direct" for a configuration without the router
    n: int
    segments_s: dict[str, float]
    ttft_mean_s: float
    ttft_p50_s: float | None


class BenchmarkReport(BaseModel):
    schema_version: int = SCHEMA_VERSION
    created_at: str
    command: list[str]
    machine: dict[str, str | int | float | None]
    versions: dict[str, str | None]
    workload_source: str
    workload_fingerprint: str
    workload: dict  # WorkloadSpec (generated) or replay info
    reference_config: str | None
    #: The client APIs the reusing configurations ran through (`run --api`); the baselines
    #: ran chat only.
    apis: list[str] = Field(default_factory=lambda: ["chat"])
    configs: list[ConfigResult]
    targets: Targets
    #: Mean TTFT per segment, per (configuration, path), turns after the first (budget.py).
    time_budget: list[PathBudget] = Field(default_factory=list)


# =========================================================================== load mode

LOAD_SCHEMA_VERSION = 1


class Slo(BaseModel):
    """What a turn must meet to count toward goodput, and where the bounds came from.

    Bounds are multiples of an idle probe measured in the same run: one session at a time
    on one configuration (`probe_config`), so each bound means "this much worse than the
    machine does with nothing else running". The computed bounds are written to the JSON
    too (and ignored when it is read back)."""

    probe_config: str
    probe_requests: int
    #: Idle TTFT p90 of first turns (cold document prefill) and of later turns (seconds).
    idle_ttft_first_p90_s: float
    idle_ttft_later_p90_s: float
    #: Idle decode step: TPOT p50 (seconds per output token after the first).
    idle_decode_step_s: float
    ttft_factor: float
    itl_factor: float

    @computed_field  # type: ignore[prop-decorator]
    @property
    def ttft_first_s(self) -> float:
        return self.ttft_factor * self.idle_ttft_first_p90_s

    @computed_field  # type: ignore[prop-decorator]
    @property
    def ttft_later_s(self) -> float:
        return self.ttft_factor * self.idle_ttft_later_p90_s

    @computed_field  # type: ignore[prop-decorator]
    @property
    def itl_s(self) -> float:
        return self.itl_factor * self.idle_decode_step_s


class LevelResult(BaseModel):
    """One level of the sweep on one configuration."""

    level: int  # offered concurrent sessions
    window_s: float  # arrivals happen in [0, window_s)
    wall_s: float  # level start to the last turn's end (or the drain cap)
    sessions: int  # arrived
    sessions_finished: int  # every turn answered (met the SLO or not)
    sessions_met: int  # every turn answered within the SLO
    sessions_cancelled: int  # still running at the drain cap
    offered_sessions_per_min: float
    goodput_sessions_per_min: float  # sessions_met per minute of the arrival window
    requests: int
    errors: int
    error_rate: float
    turns_within_ttft: int  # answered turns whose TTFT met their bound
    ttft_s: Distribution
    ttft_first_s: Distribution
    ttft_later_s: Distribution
    itl_s: Distribution  # gaps between token-bearing chunks, all turns pooled
    tpot_s: Distribution
    turns_per_s: float
    output_tokens_per_s: float
    paths: dict[str, int]
    #: Whether the level's own distributions meet the SLO bounds (TTFT p90 per turn
    #: class, ITL p99): the SLO read as a fleet-wide target rather than per session.
    slo_met_level: bool
    broken: bool  # goodput 0 or too many errors: the sweep of this config stops here
    broken_reason: str | None = None
    #: Why sessions that finished missed the SLO: `first_turn_ttft`, `later_turn_ttft`,
    #: `itl_p99` -> sessions (one session may count under several).
    missed_by: dict[str, int] = Field(default_factory=dict)
    foreign_vllm_max: int | None = None
    #: Highest 1-minute load average during the level. It counts the benchmark's own
    #: runnable threads too (the engines' outnumber the cores), so `steal_s` and
    #: `other_cpu_s` say better whether something else competed for the cores.
    load_avg_max: float | None = None
    #: CPU seconds the hypervisor gave to other machines during the level (all cores).
    steal_s: float | None = None
    #: CPU seconds used during the level by processes outside the benchmark and its
    #: children, by name, most first (the kernel's own threads included).
    other_cpu_s: dict[str, float] | None = None
    #: The router's P and D placement choices during the level, by reason
    #: (`prefill:tier_hit`, `decode:affinity`, ...); empty without a router.
    placements: dict[str, float] = Field(default_factory=dict)
    #: Per session id: `met`, `missed`, `failed` or `cancelled`. Every configuration runs
    #: the same sessions, so two configurations can be compared session by session.
    session_outcome: dict[str, str] = Field(default_factory=dict)
    records: list[RequestRecord] = Field(default_factory=list)


class LoadConfigResult(BaseModel):
    name: str
    description: str
    status: Literal["ok", "failed"]
    error: str | None = None
    startup_s: float | None = None
    levels: list[LevelResult] = Field(default_factory=list)
    #: Highest level run; the sweep stopped there when that level was broken.
    stopped_at: int | None = None
    logs: str | None = None


class PairedSessions(BaseModel):
    """Two configurations judged on the same sessions (same arrivals, same prompts) over
    the levels both ran: which sessions met the SLO in one and not in the other. Goodput
    of two configurations that choose alike moves by a few sessions per level from timing
    alone; the exact sign test on the discordant sessions (McNemar's test) says how often
    a split at least this uneven happens when neither configuration is better."""

    a: str
    b: str
    levels: list[int]
    sessions: int  # paired: run in both
    both: int  # met the SLO in both
    only_a: int
    only_b: int
    neither: int
    p_value: float  # two-sided exact sign test on only_a vs only_b


class LoadTargets(BaseModel):
    """The load mode's goals, measured (never asserted)."""

    peak_goodput: dict[str, float] = Field(default_factory=dict)  # config -> best level's
    best_baseline: str | None = None
    kvagent_over_best_baseline: float | None = None  # peak goodput ratio (goal >= 1.5)
    #: ITL p99 of kvagent and the aggregated node at the highest level both ran.
    itl_p99_level: int | None = None
    kvagent_itl_p99_s: float | None = None
    aggregated_itl_p99_s: float | None = None
    #: Peak goodput of the cost model over each fixed policy (> 1: the cost model wins).
    cost_model_over: dict[str, float | None] = Field(default_factory=dict)
    #: Each cost model against each fixed policy, and kvagent against the best baseline,
    #: session by session.
    paired: list[PairedSessions] = Field(default_factory=list)
    met: dict[str, bool | None] = Field(default_factory=dict)


class LoadReport(BaseModel):
    schema_version: int = LOAD_SCHEMA_VERSION
    created_at: str
    command: list[str]
    machine: dict[str, str | int | float | None]
    versions: dict[str, str | None]
    #: Session shape (WorkloadSpec without seed/count), think time, level window, drain
    #: cap, nominal session time, levels.
    load: dict
    slo: Slo | None
    idle_probe: list[RequestRecord] = Field(default_factory=list)
    configs: list[LoadConfigResult]
    targets: LoadTargets
    #: Set when this report re-judges a recorded run against other SLO factors
    #: (`load --rescore`): the factors used and the original ones.
    rescored: dict | None = None
