"""The simulated vLLM v1 engine: scheduler step loop, block-level prefix cache, step-time model.

Pure Python, no I/O, no clock: the caller owns time. ``add_request`` queues a request,
``step(now)`` runs ONE scheduler step starting at engine time ``now`` and returns what
happened and how long the step took; the caller advances its clock by ``duration`` (the HTTP
server sleeps ``duration / speed``; the offline simulator just adds it). The same class backs
``kvtop sim`` and ``kvtop simulate``.

What it follows (vllm/v1/core/sched/scheduler.py, kv_cache_manager.py, block_pool.py):

* RUNNING requests first, in order; each gets ``min(remaining, long_prefill_token_threshold,
  budget)`` tokens (chunked prefill always on). When blocks run out, the newest running
  request is preempted (recompute: its blocks are freed, ``computed = 0``, it goes back to
  the head of the waiting queue, behind requests that hold pulled remote KV, which vLLM
  schedules first); if that is the request being scheduled, the loop stops.
* WAITING requests only if nothing was preempted this step and ``len(running) <
  max_num_seqs``: prefix lookup, chunk to the remaining budget, allocation failure stops the
  loop (head-of-line blocking). Order is FIFO unless an ``admission`` hook reorders it.
* ``scheduling_policy="priority"`` (vLLM's ``--scheduling-policy priority``,
  request_queue.py's PriorityRequestQueue): the waiting queue is ordered by the request's
  ``(priority, arrival_time)``, lower first, and a preempted request goes back into it by that
  order rather than to its head. When a running request's blocks do not fit, the victim is
  the running request with the largest ``(priority, arrival_time)`` (vLLM's ``max(self.running,
  ...)``), wherever it is in the running list; if it was already scheduled in this step, its
  tokens go back to the budget. As in vLLM v1, a WAITING request never preempts a running
  one: priority orders admission, and preemption happens only when running requests need
  blocks. Requests holding pulled remote KV stay at the queue's head in both policies (see
  ``_queue_behind_holders``).
* Prefix cache: full prompt blocks keyed by the caller's chained hashes; a hit is the longest
  cached chain, capped at ``num_tokens - 1`` rounded down to a block. Blocks are cacheable as
  soon as they are scheduled full, even mid-prefill. Freed blocks (refcount 0) go to the tail
  of an LRU free queue in reverse order and keep their hash; allocation pops the head and
  evicts its hash; a hit on a free block takes it out of the queue.
* ``kv_pin_ttl_s`` > 0 models an engine feature vLLM does not have (a session's KV kept
  across its tool-call pause): the blocks a request releases when it FINISHES (not when it is
  preempted or aborted) are pinned until ``finish time + kv_pin_ttl_s``. A WAITING request may
  not take a pinned block for its new KV (its own prefix hit on pinned blocks is fine: that is
  the returning turn the pin is for), so admission waits for a pin to end, which is at most
  the TTL away (``next_event_time`` includes it); a RUNNING request short of blocks takes
  pinned ones, the oldest pin's first, when no unpinned block is free, so a pin never
  preempts or stalls work already admitted (no deadlock, no lost progress). When a pin ends,
  its blocks rejoin the free queue where they would have been without it (release order).
  The turn that took pinned blocks pins them again when it finishes. The P/D pull path
  ignores pins. 0 (the default) is exactly vLLM's LRU.
* A token is sampled at the end of the step that computes a request's last pending token:
  the first token ends the last prefill chunk, then one token per decode step; the request
  finishes at ``max_tokens`` (``length``), or at ``stop_at`` if that comes first (``stop``:
  the model's natural end, EOS or a stop string, which the HTTP layer decides up front).

* Time: a request enters the scheduler ``profile.frontend_s(prompt tokens)`` after it
  arrives (HTTP, parsing, hashing; the engine keeps stepping meanwhile) and is QUEUED at the
  first step boundary after that, as vLLM's engine core takes new requests between steps.
  Its first SCHEDULED time is kept through preemptions (vLLM's request stats do the same).
  A step lasts ``profile.step_time``: fixed, per-request and per-admitted-request costs, the
  linear layers, causal
  attention of prefill chunks, and the KV read of every decoding request, the sum of their
  contexts (so a batch of long contexts decodes slower than one of short ones).

Blocks filled by generated tokens are not hashed (the engine never sees token ids), so only
prompt blocks can be hits. Prompts whose KV could never fit are rejected up front.
"""

from __future__ import annotations

import bisect
from collections import deque
from itertools import islice
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from kvtop.sim import _pool
from kvtop.sim.profiles import DEFAULT_PROFILE, Profile, get_profile

# The block pool's per-block loops: compiled (kvtop/sim/_blockpool.c) when the install built it,
# else the same loops in Python (kvtop/sim/_pool.py; KVTOP_PURE_PYTHON=1 forces them).
_gather = _pool.gather
_fill = _pool.fill
_incr = _pool.incr
_count_free = _pool.count_free
_select_equal = _pool.select_equal
_evict_claim = _pool.evict_claim
_release = _pool.release
_touch_blocks = _pool.touch
_register_blocks = _pool.register
_cached_prefix = _pool.cached_prefix
_chain_prefix = _pool.chain_prefix
_running_plain = _pool.running_plain
_sample_plain = _pool.sample_plain
_decode_room = _pool.decode_room
_advance_running = _pool.advance
_decode_times = _pool.decode_times
_decode_plan = _pool.decode_plan

__all__ = [
    "Engine",
    "check_priority",
    "check_kv_pin_ttl",
    "EngineRequest",
    "EngineRejected",
    "RequestTooLong",
    "ExceedsKVCapacity",
    "StepResult",
    "FinishedRequest",
    "WaitingView",
    "AdmissionHook",
]


class EngineRejected(ValueError):
    """``add_request`` refused a request before queueing it."""


class EngineFailed(RuntimeError):
    """The engine failed a request it was sent, as a vLLM answering 5xx would: the router may
    retry it elsewhere (router/lifecycle.py). The model engine never raises it; an engine
    standing in for a failing one does (a scripted test engine, a failed instance)."""


class RequestTooLong(EngineRejected):
    """Prompt plus ``max_tokens`` exceeds ``max_model_len`` (vLLM answers 400)."""


class ExceedsKVCapacity(EngineRejected):
    """The request's KV could never fit in the whole cache; queueing it would livelock."""


@dataclass(slots=True)
class EngineRequest:
    """What the engine needs to know about a request; no token ids.

    ``block_hashes`` are the chained hashes of the prompt's full blocks at the engine's block
    size (``router.blocks.hash_token_blocks(tokens, engine.block_size)``), at most
    ``num_prompt_tokens // block_size`` of them; fewer means the tail can never hit.
    ``kv_transfer_params``: ``{"do_remote_decode": True}`` makes this a prefill-only request
    (P side of vLLM's disaggregated two-step); the params a P side returned, with
    ``"do_remote_prefill": True``, make this a decode-side request that first pulls the KV.
    ``stop_at``: the answer ends naturally (finish reason ``stop``) after this many output
    tokens when that is fewer than ``max_tokens``; None: it runs to ``max_tokens``.
    """

    request_id: str
    num_prompt_tokens: int
    block_hashes: Sequence[int]
    max_tokens: int
    arrival_time: float
    kv_transfer_params: dict[str, Any] | None = None
    stop_at: int | None = None
    #: vLLM's per-request ``priority``: lower is served first under the priority policy
    #: (ignored under fcfs, where the server refuses a nonzero one as vLLM does)
    priority: int = 0
    # the KV pin's TTL for this request (the per-request hint a real API would take: a client
    # whose answer ends in a tool call knows its session continues); None: the engine's
    # kv_pin_ttl_s. 0: no pin.
    kv_pin_s: float | None = None


class WaitingView(NamedTuple):
    """A waiting request as the admission hook sees it."""

    request_id: str
    num_tokens: int          # prompt + tokens already generated (>prompt after a preemption)
    cached_tokens: int       # prefix-cache hit it would get right now
    cost: int                # tokens it still has to compute: num_tokens - cached_tokens
    arrival_time: float


#: ``hook(views, budget) -> indices into views, in the order to try them``. Requests left out
#: are not admitted this step. The engine stops at the first one whose blocks do not fit.
AdmissionHook = Callable[[list[WaitingView], int], Sequence[int]]


@dataclass(slots=True)
class FinishedRequest:
    """A request that left the engine, with its timeline in engine seconds."""

    request_id: str
    finish_reason: str       # "length", "stop" or "abort"
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int   # prefix hit (local + pulled remote KV) at its first scheduling
    num_preemptions: int
    arrival_time: float
    queued_time: float | None        # QUEUED: the first step boundary after the frontend overhead
    scheduled_time: float | None     # first SCHEDULED (vLLM's stats ignore later, after preemption)
    first_token_time: float | None
    finish_time: float
    kv_transfer_params: dict[str, Any] | None = None


@dataclass(slots=True, init=False)
class StepResult:
    """What one ``step(now)`` did. Every event happens at ``end_time = now + duration``.

    With ``step(now, coalesce=True)`` one result can stand for ``num_steps`` consecutive
    decode steps in which nothing but decoding happened (no first token, finish, preemption
    or admission); ``num_scheduled_*`` are then per step and ``emitted`` holds the outputs
    after the last one."""

    now: float
    duration: float = 0.0
    end_time: float = 0.0
    num_scheduled_tokens: int = 0
    num_scheduled_reqs: int = 0
    num_steps: int = 1
    first_token: list[str] = field(default_factory=list)
    emitted: dict[str, int] = field(default_factory=dict)   # request id -> its output tokens so far
    finished: list[FinishedRequest] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    transfers_started: list[str] = field(default_factory=list)

    # Written out (init=False): the generated __init__ calls a factory per list, and the
    # simulator makes one result per step.
    def __init__(self, now: float, duration: float = 0.0, end_time: float = 0.0,
                 num_scheduled_tokens: int = 0, num_scheduled_reqs: int = 0, num_steps: int = 1,
                 first_token: list[str] | None = None, emitted: dict[str, int] | None = None,
                 finished: list[FinishedRequest] | None = None, preempted: list[str] | None = None,
                 transfers_started: list[str] | None = None) -> None:
        self.now = now
        self.duration = duration
        self.end_time = end_time
        self.num_scheduled_tokens = num_scheduled_tokens
        self.num_scheduled_reqs = num_scheduled_reqs
        self.num_steps = num_steps
        self.first_token = [] if first_token is None else first_token
        self.emitted = {} if emitted is None else emitted
        self.finished = [] if finished is None else finished
        self.preempted = [] if preempted is None else preempted
        self.transfers_started = [] if transfers_started is None else transfers_started

    @property
    def idle(self) -> bool:
        """Nothing happened that a next step could build on: nothing scheduled and nothing
        preempted. A step that only preempted (its running requests needed blocks the cache did
        not have) freed blocks but, like vLLM's scheduler, admitted nothing in the same step;
        the next one can, so a driver must step again rather than wait for a new request."""
        return self.num_scheduled_tokens == 0 and not self.preempted


def _priority_key(req: "_Req") -> tuple[int, float]:
    """vLLM's request order under the priority policy (vllm/v1/request.py ``__lt__``)."""
    return (req.priority, req.arrival)


# request states
_PENDING, _WAITING, _TRANSFERRING, _RUNNING, _DONE = range(5)

#: Requests whose blocks ``_lookup`` remembers per engine (by first block hash), at most, and
#: their hashes in all, at most, in multiples of the engine's blocks: beyond what the cache can
#: hold they are of no use, and ``kvtop sim`` must not keep 200k-token prompts' hashes alive.
_MAX_CHAINS = 1024

#: Coalesced decode steps per result, at most (a longer run is the next result's).
_MAX_STRETCH = 512
_CHAIN_BLOCKS_PER_CACHE_BLOCK = 8


_BLOCK_IDS: list[int] = []


def _block_ids(n: int) -> list[int]:
    """Block ids 0..n-1 as int objects shared by every engine of the process: the 8 engines of a
    simulation then touch one set of id objects (an id past 256 is an object of its own, and
    every refcount, free-queue and gather operation reads it) instead of 8."""
    global _BLOCK_IDS
    ids = _BLOCK_IDS
    if len(ids) < n:   # a new list, never one changed in place: safe for engines built in threads
        ids = _BLOCK_IDS = ids + list(range(len(ids), n))
    return ids[:n]


class _Run:
    """Blocks that entered the free queue together (one request's release, in the order vLLM
    appends them), as one entry of the queue: ``q[head:]`` in LRU order. Entries a later hit
    took out one by one stay in ``q`` as stale ones until allocation filters the run
    (``dirty``); a hit that takes the run's tail, the common case, slices it off."""

    __slots__ = ("rid", "q", "head", "dirty", "expiry")

    def __init__(self, rid: int, q: list[int]):
        self.rid = rid
        self.q = q
        self.head = 0
        self.dirty = False
        self.expiry: float | None = None   # a pinned run (kv_pin_ttl_s): when its pin ends


class _Stretch:
    """The steps a coalesced StepResult added after its first one: each one's start, end and
    the engine's busy time after it, so that a cut can take steps back. ``plain``: the requests
    that decode one token a step (their counts are applied at once and taken back by a cut).
    ``fill``: for a prefill stretch, ``(request, blocks needed, computed after)`` per step of
    the one request prefilling alongside them; ``grow``: the blocks the plain requests take on
    the way. Blocks and registrations are applied only when the engine next steps or aborts
    (``Engine._settle``), so a cut has nothing to undo."""

    __slots__ = ("result", "end0", "busy0", "starts", "ends", "busys", "k", "plain", "fill",
                 "grow", "lazy")

    def __init__(self, result: StepResult, end0: float, busy0: float, starts: list[float],
                 ends: list[float], busys: list[float], plain: list["_Req"],
                 fill: tuple["_Req", list[int], list[int]] | None = None,
                 grow: tuple[list[int], list[int]] | None = None):
        self.result = result
        self.end0 = end0
        self.busy0 = busy0
        self.starts = starts
        self.ends = ends
        self.busys = busys
        self.k = 0      # extra steps applied to the engine's state
        self.plain = plain
        self.fill = fill
        self.grow = grow     # the blocks the plain requests take: (steps, indices), decode_plan's
        self.lazy = fill is not None or grow is not None   # blocks to apply: Engine._settle


class _Req:
    __slots__ = ("id", "prompt", "hashes", "max_tokens", "arrival", "num_tokens", "computed",
                 "output", "blocks", "registered", "state", "cached_tokens", "queued_time",
                 "scheduled_time", "first_token_time", "preemptions", "counted", "remote_decode",
                 "remote_prefill", "ready_at", "stops", "priority", "pin_s")

    def __init__(self, r: EngineRequest, ready_at: float):
        self.id = r.request_id
        self.prompt = r.num_prompt_tokens
        self.hashes = r.block_hashes
        self.max_tokens = r.max_tokens
        self.arrival = r.arrival_time
        self.num_tokens = r.num_prompt_tokens
        self.computed = 0
        self.output = 0
        self.blocks: list[int] = []
        self.registered = 0          # leading blocks whose hash is settled (cached or hit)
        self.state = _PENDING
        self.cached_tokens: int | None = None
        self.queued_time: float | None = None
        self.scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.preemptions = 0
        self.counted = False         # prefix metrics recorded once
        params = r.kv_transfer_params or {}
        self.remote_decode = bool(params.get("do_remote_decode"))
        self.remote_prefill: dict | None = dict(params) if params.get("do_remote_prefill") else None
        self.ready_at = ready_at
        self.stops = False           # max_tokens is the natural end (stop_at), not the cap
        self.priority = r.priority
        self.pin_s = r.kv_pin_s


if _pool.C is not None:   # the C running loop reads _Req's slots directly
    _pool.C.bind_request(_Req)


#: ``Engine(kv_pin_ttl_s=...)``'s bound: a pin of a day is already no pin but a leak.
MAX_KV_PIN_TTL_S = 86400.0

def check_kv_pin_ttl(value: Any) -> float:
    """``kv_pin_ttl_s`` (the CLIs' --kv-pin-ttl) as a float; ValueError with a one-line reason
    unless it is a number in 0..MAX_KV_PIN_TTL_S."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not 0 <= value <= MAX_KV_PIN_TTL_S:   # (a NaN fails both comparisons)
        raise ValueError(f"--kv-pin-ttl must be a number of seconds from 0 to {MAX_KV_PIN_TTL_S:g}, "
                         f"not {str(value)[:40]}")
    return float(value)


#: ``Engine(scheduling_policy=...)``: vLLM's ``--scheduling-policy`` values modelled here.
SCHEDULING_POLICIES = ("fcfs", "priority")


def check_priority(value: Any, scheduling_policy: str) -> int:
    """A request body's ``priority`` as vLLM takes it (default 0; lower is served first): an
    integer, and nonzero only under the priority policy. Raises EngineRejected (a 400) with
    vLLM's own message for a nonzero one under fcfs."""
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int):
        raise EngineRejected(f"priority must be an integer, got {str(value)[:40]!r}")
    if value and scheduling_policy != "priority":
        raise EngineRejected(f"Got priority {value} but Priority scheduling is not enabled.")
    return value


class Engine:
    """One simulated vLLM instance. See the module docstring for the scheduling rules.

    ``prefix_metrics``: ``"after_alloc"`` (current vLLM, fix for #43736) counts prefix
    queries/hits once per request after its blocks were allocated, and a request resumed after
    preemption goes to the ``preempted_prefix_*`` counters instead (#25780);
    ``"at_lookup"`` (older releases) counts every lookup, failed allocations and resumes included.
    """

    def __init__(self, profile: Profile | str = DEFAULT_PROFILE, *, block_size: int | None = None,
                 num_gpu_blocks: int | None = None, max_num_batched_tokens: int | None = None,
                 max_num_seqs: int | None = None, max_model_len: int | None = None,
                 long_prefill_token_threshold: int | None = None,
                 frontend_overhead_s: float | None = None,
                 prefix_metrics: str = "after_alloc", admission: AdmissionHook | None = None,
                 admission_window: int = 64, engine_id: str = "0",
                 busy_window_s: float = 5.0, scheduling_policy: str = "fcfs",
                 kv_pin_ttl_s: float = 0.0, kv_pin_max_share: float = 1.0):
        if isinstance(profile, str):
            profile = get_profile(profile)
        if prefix_metrics not in ("after_alloc", "at_lookup"):
            raise ValueError("prefix_metrics must be 'after_alloc' or 'at_lookup'")
        if scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, "
                             f"not {scheduling_policy!r}")
        self.kv_pin_ttl_s = check_kv_pin_ttl(kv_pin_ttl_s)
        if not 0 < kv_pin_max_share <= 1:
            raise ValueError(f"kv_pin_max_share must be in (0, 1], not {kv_pin_max_share!r}")
        self.kv_pin_max_share = kv_pin_max_share
        self.scheduling_policy = scheduling_policy
        self._by_priority = scheduling_policy == "priority"
        self.profile = profile.with_overrides(
            block_size=block_size, num_gpu_blocks=num_gpu_blocks,
            max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
            max_model_len=max_model_len, long_prefill_token_threshold=long_prefill_token_threshold,
            frontend_overhead_s=frontend_overhead_s)
        p = self.profile
        for name in ("block_size", "num_gpu_blocks", "max_num_batched_tokens", "max_num_seqs",
                     "max_model_len"):
            if getattr(p, name) <= 0:
                raise ValueError(f"{name} must be positive")
        self.block_size = p.block_size
        self.num_gpu_blocks = p.num_gpu_blocks
        self.max_num_batched_tokens = p.max_num_batched_tokens
        self.max_num_seqs = p.max_num_seqs
        self.max_model_len = p.max_model_len
        self.long_prefill_token_threshold = p.long_prefill_token_threshold
        self.frontend_overhead_s = p.frontend_overhead_s
        self.prefix_metrics = prefix_metrics
        self.admission = admission
        self.admission_window = admission_window
        self.engine_id = engine_id

        n = self.num_gpu_blocks
        # The block pool. Work is per run of blocks where it can be: a finished request's blocks
        # enter the free queue (vLLM's LRU: released blocks go to the tail, the request's last
        # block first; allocation takes the head) as one _Run, and a returning turn's hit,
        # which is the previous turn's blocks, leaves it as one slice (docs/simulator.md, "Cost").
        # ``_ref[b]``: >= 1, the requests holding b; < 0, b is free and -_ref[b] is the id of
        # the run that holds its live queue entry.
        self._ref = [-1] * n
        self._block_hash: list[int | None] = [None] * n
        self._cached: dict[int, int] = {}                      # hash -> block id
        first = _Run(1, _block_ids(n))
        self._runs: deque[_Run] = deque([first])               # the free queue, head = next evicted
        self._run_of: dict[int, _Run] = {1: first}             # run id -> run, while queued
        # kv_pin_ttl_s: the runs finished requests released, pinned until their expiry, in
        # release order (so in expiry order too); allocation takes from them only when the free
        # queue above has nothing left (see "KV pin" in docs/simulator.md). Their blocks are
        # free (refcount 0, counted in _num_free, found by lookups) like any free block.
        self._pinned: deque[_Run] = deque()
        self._num_pinned = 0    # the free blocks in them
        self._pin_cap = int(kv_pin_max_share * n)   # kv_pin_max_share: at most this many pinned
        self._pin_blocked = False   # the last admission that failed failed only for pinned blocks
        self._next_rid = 2
        self._num_free = n
        self._num_shared = 0    # sum of (refcount - 1) over held blocks: 0 = no block is shared

        self._requests: dict[str, _Req] = {}
        # Head-of-line memo: a waiting request whose blocks did not fit is retried every step;
        # its prefix hit stays valid until one of its hit blocks is evicted, so keep it.
        self._hol_req: _Req | None = None
        self._hol_hit: list[int] = []
        self._hol_set: set[int] = set()   # the memo's hit blocks (a set: cheaper to build than
        # a block -> position dict, and positions are needed only when one is evicted, rarely)
        self._hol_touch_free = 0       # hit blocks of the memo with refcount 0
        # first block hash -> (hashes, blocks, request) of the last request admitted with it
        self._chains: dict[int, tuple[Sequence[int], list[int], _Req]] = {}
        self._chains_size = 0   # their hashes, in all
        self._held_hit: list[int] | None = None   # the last lookup's hit, if all of it is held
        self._pending: list[tuple[float, int, _Req]] = []      # frontend, sorted by ready time
        self.kv_events: list | None = None  # KV facts for kvtop/sim/kv_publisher.py, when it is on
        self._seq = 0
        self.waiting: deque[_Req] = deque()
        self.running: list[_Req] = []
        self._transferring: list[_Req] = []
        self._stretch: _Stretch | None = None   # the last coalesced result, while it can be cut
        # the profile's step time (Profile.step_timer) and decode_base(num) by num, for
        # self._timed: rebuilt when a caller swaps self.profile
        self._timed: Profile | None = None
        self._step_time: Callable[..., float] = self.profile.step_time
        self._decode_bases: dict[int, float] = {}

        # counters (cumulative) and busy-time window
        self.num_preemptions = 0
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.preempted_prefix_queries = 0
        self.preempted_prefix_hits = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.request_success: dict[str, int] = {"length": 0, "stop": 0, "abort": 0}
        self.num_steps = 0
        self.busy_time = 0.0
        self._busy_window_s = busy_window_s
        self._recent_steps: deque[tuple[float, float]] = deque()   # (start, duration)
        self._recent_busy = 0.0

    # ------------------------------------------------------------------ requests

    def add_request(self, request: EngineRequest) -> None:
        """Queue a request; raises ``EngineRejected`` if it can never run."""
        bs = self.block_size
        if request.request_id in self._requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        if request.num_prompt_tokens <= 0:
            raise EngineRejected("prompt must have at least one token")
        if request.max_tokens <= 0:
            raise EngineRejected("max_tokens must be at least 1")
        if len(request.block_hashes) > request.num_prompt_tokens // bs:
            raise ValueError(f"{len(request.block_hashes)} block hashes for "
                             f"{request.num_prompt_tokens} tokens at block size {bs}")
        params = request.kv_transfer_params or {}
        max_tokens = 1 if params.get("do_remote_decode") else request.max_tokens
        total = request.num_prompt_tokens + max_tokens
        if total > self.max_model_len:
            raise RequestTooLong(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                f"requested {total} tokens ({request.num_prompt_tokens} in the messages, "
                f"{max_tokens} in the completion). Please reduce the length of the messages or "
                f"completion.")
        # KV of all but the last sampled token must fit at once.
        if -(-(total - 1) // bs) > self.num_gpu_blocks:
            raise ExceedsKVCapacity(
                f"request needs {total - 1} tokens of KV but the cache holds "
                f"{self.num_gpu_blocks * bs} ({self.num_gpu_blocks} blocks of {bs})")
        req = _Req(request, request.arrival_time + self.frontend_overhead_s
                   + self.profile.frontend_s_per_token * request.num_prompt_tokens)
        req.max_tokens = max_tokens
        if request.stop_at is not None and 0 < request.stop_at < max_tokens:
            req.max_tokens, req.stops = request.stop_at, True
        if self._stretch is not None:
            self._cut(req.ready_at)
        self._requests[req.id] = req
        self._seq += 1
        bisect.insort(self._pending, (req.ready_at, self._seq, req))

    def abort(self, request_id: str, now: float | None = None) -> FinishedRequest | None:
        """Remove a request wherever it is and free its blocks; None if it is not here."""
        req = self._requests.get(request_id)
        if req is None:
            return None
        if self._stretch is not None:
            self._cut(float("-inf") if now is None else now)
            if self._stretch.lazy:
                self._settle()
        if req.state == _PENDING:
            self._pending = [e for e in self._pending if e[2] is not req]
        elif req.state == _WAITING:
            self.waiting.remove(req)
        elif req.state == _TRANSFERRING:
            self._transferring.remove(req)
        elif req.state == _RUNNING:
            self.running.remove(req)
        self._free_blocks(req)
        return self._finish(req, "abort", req.arrival if now is None else now)

    def has_work(self) -> bool:
        return bool(self.running or self.waiting or self._transferring or self._pending)

    def next_event_time(self) -> float | None:
        """Earliest time a queued-but-not-schedulable request becomes schedulable (a frontend
        delay or a KV transfer ending), or None. Drive: call ``step``; if it was ``idle``
        (nothing scheduled, nothing preempted), advance the clock to this time (or wait for the
        next ``add_request``)."""
        times = [r.ready_at for r in self._transferring]
        if self._pending:
            times.append(self._pending[0][0])
        if self._pinned and self.waiting:   # a pin's end can let a waiting request in
            times.append(self._pinned[0].expiry)
        return min(times) if times else None

    def lookup_cached_tokens(self, block_hashes: Sequence[int], num_tokens: int) -> int:
        """Prefix-cache hit in tokens a prompt would get now (no side effects)."""
        return len(self._lookup(block_hashes, num_tokens)) * self.block_size

    # ------------------------------------------------------------------ gauges

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        """Waiting in the scheduler, including decode-side requests pulling remote KV."""
        return len(self.waiting) + len(self._transferring)

    @property
    def num_free_blocks(self) -> int:
        """Blocks with refcount 0 (cached-but-unreferenced blocks included)."""
        return self._num_free

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def kv_usage(self) -> float:
        """vLLM's kv_cache_usage_perc: 1 - free/total, cached-unreferenced blocks count as free."""
        return 1.0 - self._num_free / self.num_gpu_blocks

    def num_allocated_blocks(self) -> int:
        """Blocks referenced by at least one request (counted from refcounts, for invariants)."""
        return sum(1 for r in self._ref if r > 0)

    def _refcount(self, block: int) -> int:
        """A block's refcount as vLLM's block pool holds it (0: free)."""
        r = self._ref[block]
        return r if r > 0 else 0

    def _count_free_hit(self, hit: list[int]) -> int:
        """``_count_free(hit)``, read off the run when the hit is a released run's tail, or
        known to be 0 when the lookup just found it all in blocks a live request holds."""
        if hit is self._held_hit:
            return 0
        r0 = self._ref[hit[0]]
        if r0 < 0:
            run = self._run_of[-r0]
            q = run.q
            k = len(hit)
            if not run.dirty and k <= len(q) - run.head and q[-k:] == hit[::-1]:
                return k
        return self._count_free(hit)

    def _count_free(self, blocks: Sequence[int]) -> int:
        """How many of ``blocks`` have refcount 0 (C-level passes; ``list.count`` of a bool is
        far cheaper than ``sum`` over bools, which leaves sum's int fast path)."""
        return _count_free(self._ref, blocks, self._num_shared)

    def _free_queue(self) -> list[int]:
        """The free blocks in LRU order, the next evicted first (for tests and invariants); with
        kv_pin_ttl_s, the pinned ones after the others, as allocation takes them."""
        ref = self._ref
        return [b for runs in (self._runs, self._pinned) for run in runs
                for b in run.q[run.head:] if ref[b] == -run.rid]

    @property
    def num_pinned_blocks(self) -> int:
        """Free blocks under a KV pin that had not ended at the last step's start."""
        return self._num_pinned

    def _live(self, run: _Run) -> int:
        """The run's blocks still in the free queue (a hit may have taken some)."""
        q = run.q[run.head:]
        return len(q) if not run.dirty else len(_select_equal(self._ref, q, -run.rid))

    def _expire_pins(self, now: float) -> None:
        """Pins that ended by ``now`` give their runs back to the free queue, where they would
        be without the pin: in release order (run ids grow with each release), so after its
        pin a run is evicted exactly when it would have been."""
        pinned = self._pinned
        runs = self._runs
        while pinned and (pinned[0].expiry <= now or self._num_pinned > self._pin_cap):
            run = pinned.popleft()
            self._num_pinned -= self._live(run)
            run.expiry = None
            k = len(runs)
            while k and runs[k - 1].rid > run.rid:
                k -= 1
            if k == len(runs):
                runs.append(run)
            else:
                runs.insert(k, run)

    def busy_ratio(self, now: float) -> float:
        """Fraction of the last ``busy_window_s`` engine seconds spent in steps (GPU-util stand-in)."""
        window = self._busy_window_s
        lo = now - window
        busy = 0.0
        for start, dur in self._recent_steps:
            end = start + dur
            if end <= lo:
                continue
            busy += min(end, now) - max(start, lo)
        return max(0.0, min(1.0, busy / window))

    # ------------------------------------------------------------------ the step

    def step(self, now: float, *, coalesce: bool = False) -> StepResult:
        """Run one scheduler step starting at engine time ``now``.

        ``coalesce``: when the step only decoded, also run the decode steps after it that
        would change nothing but token counts and blocks (up to the first one that finishes a
        request, meets a request becoming ready or would need more blocks than are free), or
        when the last running request is mid-prefill beside decoding ones, its chunks up to the
        last one, and return them as one result; the blocks they take are applied at the next
        ``step`` or ``abort`` (pool gauges read before that see the result's first step).
        A later ``add_request`` or ``abort`` that lands inside cuts the result back to the
        steps that began before it (``end_time`` moves earlier; the engine's state is then
        exactly as if only those steps had run), so a driver that re-reads ``end_time``
        after adding a request sees the same steps as without ``coalesce``. The offline
        simulator uses it; the HTTP server, which streams each token, does not."""
        if self._stretch is not None:
            if self._stretch.lazy:
                self._settle()
            self._stretch = None
        result = StepResult(now=now, end_time=now)
        if self._pinned:
            self._expire_pins(now)
        if self._pending or self._transferring:
            self._release_ready(now)
        if not self.running and not self.waiting:
            return result

        bs = self.block_size
        budget = self.max_num_batched_tokens
        threshold = self.long_prefill_token_threshold
        running = self.running
        scheduled: list[_Req] = []
        attn_sum = 0
        decode_ctx = 0
        # priority: what each running request scheduled this step added, so that a victim
        # chosen behind the scan can give it back (vLLM returns its tokens to the budget)
        given: dict[int, tuple[int, int, int]] | None = {} if self._by_priority else None

        # 1. RUNNING, in order. The requests that need no block and no registration (decoding,
        # mostly) go through _pool.running_plain, fcfs; the loop below takes the others.
        i = 0
        while i < len(running) and budget > 0:
            if given is None:
                i, budget, attn_add, ctx_add = _running_plain(running, i, budget, threshold, bs,
                                                              scheduled)
                attn_sum += attn_add
                decode_ctx += ctx_add
                if i >= len(running) or budget <= 0:
                    break
            req = running[i]
            computed = req.computed
            num_new = req.num_tokens - computed
            if threshold and num_new > threshold:
                num_new = threshold
            if num_new > budget:
                num_new = budget
            need = -(-(computed + num_new) // bs) - len(req.blocks)
            if need > 0 and need > self._num_free:   # (need > 0: no attribute read mid-block)
                while need > self._num_free:
                    if given is None:
                        victim = running.pop()
                    else:   # the lowest priority running, wherever it is (vLLM: max over running)
                        victim = max(running, key=_priority_key)
                        at = running.index(victim)
                        del running[at]
                        if at < i:   # already scheduled in this step: its tokens go back
                            n_back, attn_back, ctx_back = given.pop(id(victim))
                            budget += n_back
                            attn_sum -= attn_back
                            decode_ctx -= ctx_back
                            scheduled.remove(victim)
                            i -= 1
                    self._preempt(victim, now)
                    result.preempted.append(victim.id)
                    if victim is req:
                        break
                if req.state != _RUNNING:
                    break
            if need > 0:
                self._allocate(req, need)
            if req.registered < len(req.hashes):
                self._register(req, computed + num_new)
            if num_new == 1 and req.output:
                decode_ctx += computed + 1
                if given is not None:
                    given[id(req)] = (1, 0, computed + 1)
            else:
                attn_sum += num_new * (2 * computed + num_new)
                if given is not None:
                    given[id(req)] = (num_new, num_new * (2 * computed + num_new), 0)
            req.computed = computed + num_new
            budget -= num_new
            scheduled.append(req)
            i += 1

        # 2. WAITING, only if nothing was preempted this step.
        num_new = 0
        passes = 0 if result.preempted else 2   # the second only after a give-back
        blocked = None
        while passes and self.waiting:
            passes -= 1
            for req in self._admission_order(budget):
                if budget <= 0 or len(running) >= self.max_num_seqs:
                    break
                got = self._admit(req, budget, now, result)
                if got is None:
                    blocked = req
                    break       # blocks do not fit: head-of-line blocking
                if got == 0:
                    continue    # started a KV transfer: no budget, no running slot
                computed = req.computed - got
                attn_sum += got * (2 * computed + got)
                budget -= got
                scheduled.append(req)
                num_new += 1
            if blocked is not None and self._pin_blocked:
                # kv_pin_ttl_s: the head waits only for pinned blocks, so the requests behind
                # it that fit without them (above all a returning turn whose hit is its own
                # pinned KV) go first; else a pin would hold up the turn it is kept for.
                for req in list(islice(self.waiting, self.admission_window)):
                    if budget <= 0 or len(running) >= self.max_num_seqs:
                        break
                    if req is blocked or req.state != _WAITING:
                        continue
                    got = self._admit(req, budget, now, result)
                    if not got:
                        continue    # it does not fit either (or started a KV transfer)
                    computed = req.computed - got
                    attn_sum += got * (2 * computed + got)
                    budget -= got
                    scheduled.append(req)
                    num_new += 1
            # Nothing runs and the head did not fit: if waiting requests hold pulled KV, only
            # they can give blocks back. Without this, requests that each hold part of the
            # cache and wait for more would wait forever (nothing running ever frees a block).
            if (scheduled or running or result.transfers_started or not passes or blocked is None
                    or not self._give_back_pulled(result, blocked, now)):
                break

        if not scheduled:
            return result

        num_tokens = self.max_num_batched_tokens - budget
        if self.profile is not self._timed:   # (a caller may swap the profile)
            self._timed = self.profile
            self._step_time = self.profile.step_timer()
            self._decode_bases = {}
        duration = self._step_time(num_tokens, len(scheduled), attn_sum, decode_ctx, num_new)
        end = now + duration
        result.duration = duration
        result.end_time = end
        result.num_scheduled_tokens = num_tokens
        result.num_scheduled_reqs = len(scheduled)
        self.num_steps += 1
        self.busy_time += duration
        recent = self._recent_steps
        recent.append((now, duration))
        lo = now - self._busy_window_s
        while recent and recent[0][0] + recent[0][1] < lo:
            recent.popleft()

        # 3. Sample: every request whose pending tokens are all computed gets one token. Those
        # that neither get their first token nor finish go through _pool.sample_plain.
        emitted = result.emitted
        any_finished = False
        sampled = 0
        k = 0
        n_scheduled = len(scheduled)
        while k < n_scheduled:
            k, got = _sample_plain(scheduled, k, emitted)
            sampled += got
            if k >= n_scheduled:
                break
            req = scheduled[k]
            k += 1
            if req.computed < req.num_tokens:
                continue  # a non-final prefill chunk
            req.output += 1
            req.num_tokens += 1
            sampled += 1
            emitted[req.id] = req.output
            if req.first_token_time is None:
                req.first_token_time = end
                self.prompt_tokens += req.prompt
                result.first_token.append(req.id)
            if req.output >= req.max_tokens:
                any_finished = True
                req.state = _DONE
                params = self._transfer_params(req) if req.remote_decode else None
                pin_s = self.kv_pin_ttl_s if req.pin_s is None else req.pin_s
                if pin_s:
                    self._free_blocks(req, end + pin_s)
                else:
                    self._free_blocks(req)
                result.finished.append(self._finish(req, "stop" if req.stops else "length", end, params))
        self.generation_tokens += sampled
        if any_finished:
            self.running = [r for r in self.running if r.state == _RUNNING]
        elif (coalesce and not attn_sum and len(scheduled) == len(running) and not result.first_token
              and not result.preempted and not result.transfers_started
              and (not self.waiting or (self.admission is None and self.prefix_metrics == "after_alloc"))):
            # Only decoding happened, and every running request was scheduled. While the waiting
            # queue (if any) stays blocked and no request finishes or becomes ready, the next
            # steps are this one with each context one token longer (and a block for a request
            # whose context passes one): the same admission attempt fails (its inputs, the
            # cache and the batch, do not change, and fewer free blocks never let it in; see
            # _coalesce for its memoized hit), so run them here without the per-request work.
            # at_lookup metrics and an admission hook see every attempt.
            self._coalesce(result, decode_ctx)
        elif (coalesce and attn_sum and len(scheduled) == len(running) and not result.first_token
              and not result.preempted and not result.transfers_started and self.kv_events is None
              and not self._pinned and (not self.waiting or self.admission is None)):
            # One request prefills (chunked), the others decode: see _coalesce_prefill.
            self._coalesce_prefill(result)
        return result

    def _coalesce(self, result: StepResult, decode_ctx: int) -> None:
        running = self.running
        bs = self.block_size
        # The decoding requests may take blocks on the way (see _settle) when nothing else can
        # see the pool change: no KV events, no pin, and a blocked waiting queue's head whose
        # memoized hit has no free block that an allocation could evict (fewer free blocks
        # alone never let a request that did not fit in). Else the steps end before the first
        # block a request needs.
        grow = None
        if self.kv_events is None and not self._pinned:
            plan = _decode_plan(running, bs, _MAX_STRETCH, self._num_free)
            if plan is None:
                plan = _pool.PY.decode_plan(running, bs, _MAX_STRETCH, self._num_free)
            n, steps, index = plan
            if steps and self.waiting and self._hol_set and self._hol_touch_free:
                # A blocked head's memoized hit that loses a free block to these allocations
                # can let it in (a shorter hit counts fewer of its free blocks): end before the
                # step that evicts the first one.
                taken = self._peek(len(steps))
                if not self._hol_set.isdisjoint(taken):
                    hol_set = self._hol_set
                    first = next(m for m, b in enumerate(taken) if b in hol_set)
                    n = steps[first] - 1
                    cut = bisect.bisect_left(steps, steps[first])
                    steps, index = steps[:cut], index[:cut]
            if steps:
                grow = (steps, index)
        else:
            n = _decode_room(running, bs, 1 << 30)
            if n is None:
                n = _pool.PY.decode_room(running, bs, 1 << 30)
        if n <= 0:
            return
        horizon = self.next_event_time()
        if horizon is None:
            horizon = float("inf")
        num = len(running)
        t = result.end_time
        if not t < horizon:
            return
        # The n steps' durations (each context one token longer per request than the last:
        # step_time(num, num, 0, ctx, 0), as step() calls it, is decode_base(num) + kappa * ctx),
        # and their ends and busy times as running sums: the float operations a loop of
        # ``t = t + duration`` makes, in the same order (so the same bits), in one C call. The
        # steps that begin before the horizon are kept.
        base = self._decode_bases.get(num)
        if base is None:
            base = self._decode_bases[num] = self.profile.decode_base(num)
        args = (base, self.profile.kappa, decode_ctx + num, num, n, t, self.busy_time, horizon)
        times = _decode_times(*args)
        if times is None:
            times = _pool.PY.decode_times(*args)
        starts, ends, busys = times
        k = len(starts)
        if grow is not None and grow[0][0] > k:
            grow = None
        self._stretch = _Stretch(result, result.end_time, self.busy_time, starts, ends, busys, running,
                                 grow=grow)
        self._advance(k)

    def _coalesce_prefill(self, result: StepResult) -> None:
        """The steps after this one in which the last running request goes on with its chunked
        prefill and every other one decodes a token: while the prefill's chunk is not its last
        (no first token), the decoding requests need no block and none finishes, the prefill's
        blocks are free, no request becomes ready, and the waiting queue is not tried (the chunk
        takes the whole budget, or nothing waits), each step is this arithmetic and the same
        allocation and registration for the prefill's next chunk. Their durations are
        ``profile.step_time`` with the arguments step() would pass and end and busy times are
        summed in step()'s order (the same bits); the prefill's blocks are taken when the engine
        next steps or aborts (``_settle``), after a cut has had its say, in step order."""
        running = self.running
        fill = running[-1]
        decodes = running[:-1]
        for r in decodes:   # decoding: one pending token, the first one sampled
            if r.num_tokens - r.computed != 1 or not r.output or r.registered < len(r.hashes):
                return
        ndec = len(decodes)
        budget = self.max_num_batched_tokens - ndec
        if budget <= 0:
            return
        bs = self.block_size
        room = 1 << 30
        if decodes:
            room = _decode_room(decodes, bs, room)
            if room is None:
                room = _pool.PY.decode_room(decodes, bs, 1 << 30)
        horizon = self.next_event_time()
        if horizon is None:
            horizon = float("inf")
        t = result.end_time
        threshold = self.long_prefill_token_threshold
        check_budget = bool(self.waiting)
        computed = fill.computed
        num_tokens = fill.num_tokens
        nblocks = len(fill.blocks)
        free = self._num_free
        ctx = sum([r.computed for r in decodes]) + ndec   # each decode's context next step
        step_time = self._step_time
        busy = self.busy_time
        starts: list[float] = []
        ends: list[float] = []
        busys: list[float] = []
        needs: list[int] = []
        upto: list[int] = []
        k = 0
        while k < room and t < horizon:
            num_new = num_tokens - computed
            if threshold and num_new > threshold:
                num_new = threshold
            if num_new > budget:
                num_new = budget
            if num_new >= num_tokens - computed:
                break   # the last chunk: a first token (or a token), not coalesced
            if check_budget and num_new < budget:
                break   # budget left: the waiting queue would be tried
            need = -(-(computed + num_new) // bs) - nblocks
            if need > free:
                break   # a preemption
            if need > 0:
                free -= need
                nblocks += need
            duration = step_time(ndec + num_new, ndec + 1, num_new * (2 * computed + num_new), ctx, 0)
            computed += num_new
            ctx += ndec
            starts.append(t)
            t = t + duration
            ends.append(t)
            busy += duration
            busys.append(busy)
            needs.append(need)
            upto.append(computed)
            k += 1
        if not k:
            return
        self._stretch = _Stretch(result, result.end_time, self.busy_time, starts, ends, busys,
                                 decodes, (fill, needs, upto))
        self._advance(k)

    def _settle(self) -> None:
        """Apply what the coalesced result's kept steps did to the pool, in step order: a prefill's
        chunks (see _coalesce_prefill: each one's allocation, then its registration), or the
        decoding requests' new blocks (see _coalesce). After it no cut can take a step back, so
        the stretch ends."""
        st = self._stretch
        if st.fill is not None:
            fill, needs, upto = st.fill
            for j in range(st.k):
                need = needs[j]
                if need > 0:
                    self._allocate(fill, need)
                if fill.registered < len(fill.hashes):
                    self._register(fill, upto[j])
                fill.computed = upto[j]
        if st.grow is not None:
            # the decoding requests' blocks of the steps kept: taken from the free queue's head
            # in step() order (by step, then running order), which no free comes between
            steps, index = st.grow
            n = bisect.bisect_right(steps, st.k)
            if n:
                taken = self._take(n)
                self._claim(taken)
                plain = st.plain
                for b, i in zip(taken, index):
                    plain[i].blocks.append(b)
        self._stretch = None

    def _advance(self, k: int) -> None:
        """Move the coalesced result to ``k`` extra steps (fewer than now: a cut)."""
        st = self._stretch
        u = k - st.k
        if not u:
            return
        emitted = st.result.emitted
        plain = st.plain
        if not _advance_running(plain, u, emitted):
            _pool.PY.advance(plain, u, emitted)
        num = len(plain)
        self.generation_tokens += num * u
        self.num_steps += u
        self.busy_time = st.busys[k - 1] if k else st.busy0
        end = st.ends[k - 1] if k else st.end0
        res = st.result
        res.end_time = end
        res.duration = end - res.now
        res.num_steps = 1 + k
        self._recent_steps[-1] = (res.now, end - res.now)
        st.k = k

    def _cut(self, t: float) -> None:
        """Keep only the coalesced steps that began before ``t``."""
        st = self._stretch
        keep = bisect.bisect_left(st.starts, t, 0, st.k)
        if keep < st.k:
            self._advance(keep)

    # ------------------------------------------------------------------ internals

    def _release_ready(self, now: float) -> None:
        pending = self._pending
        if pending and pending[0][0] <= now:
            k = 0
            while k < len(pending) and pending[k][0] <= now:
                req = pending[k][2]
                req.state = _WAITING
                # vLLM's engine core takes new requests between steps (the QUEUED event):
                # one that is ready mid-step is queued when that step ends, i.e. at ``now``.
                req.queued_time = now
                if self._by_priority:
                    self._insert_by_priority(req)
                else:
                    self.waiting.append(req)
                k += 1
            del pending[:k]
        if self._transferring:
            done = [r for r in self._transferring if r.ready_at <= now]
            if done:
                self._transferring = [r for r in self._transferring if r.ready_at > now]
                for req in reversed(done):
                    # The pulled blocks now hold the prompt's KV: cache them, skip their compute.
                    n_full = len(req.blocks)
                    self._register(req, n_full * self.block_size)
                    req.computed = n_full * self.block_size
                    req.state = _WAITING
                    if req.blocks:
                        self.waiting.appendleft(req)
                    else:   # pulled nothing: a plain waiting request, not ahead of the holders
                        self._queue_behind_holders(req)

    def _admission_order(self, budget: int):
        waiting = self.waiting
        if self.admission is None:
            while waiting:
                yield waiting[0]    # _admit pops it on success
                # if it was not popped, the caller broke out of the loop
        else:
            window = [waiting[k] for k in range(min(len(waiting), self.admission_window))]
            views = []
            for req in window:
                if req.computed:    # pulled remote KV: nothing to look up
                    hit = req.computed
                else:
                    hit = len(self._lookup(req.hashes, req.num_tokens)) * self.block_size
                views.append(WaitingView(req.id, req.num_tokens, hit, req.num_tokens - hit, req.arrival))
            for k in self.admission(views, budget):
                req = window[k]
                if req.state == _WAITING:
                    yield req
            if not self.running and waiting:
                yield waiting[0]    # an idle engine always admits one: no stall, whatever the hook

    def _lookup(self, hashes: Sequence[int], num_tokens: int) -> list[int]:
        """Block ids of the longest cached prefix chain (capped at num_tokens - 1)."""
        limit = (num_tokens - 1) // self.block_size
        if limit > len(hashes):
            limit = len(hashes)
        if limit <= 0:
            return []
        cached = self._cached
        found: list[int] = []
        start = 0
        self._held_hit = None
        chain = self._chains.get(hashes[0])
        if chain is not None:
            # The blocks of the last request admitted with this first hash (a returning turn's
            # previous one, mostly): as far as they still hold this prompt's hashes, they are
            # what the dict would give (a block holds hash h exactly when the cache maps h to
            # it), found by list comparisons instead of a dict read a hash.
            found = _chain_prefix(chain[0], chain[1], hashes, limit, self._block_hash)
            start = len(found)
            if start == limit or hashes[start] not in cached:
                if found and chain[2].blocks is chain[1]:
                    # That request still holds every block of its list (a release swaps the
                    # list), so none of the hit is free: _count_free_hit need not count.
                    self._held_hit = found
                return found
        # The dict's reads past them, up to the first miss (see _pool.cached_prefix).
        if found:
            found += _cached_prefix(cached, hashes, start, limit)
            return found
        return _cached_prefix(cached, hashes, start, limit)

    def _note_chain(self, req: _Req) -> None:
        """Remember an admitted request's blocks for ``_lookup`` (see there), bounded."""
        hashes = req.hashes
        if not hashes:
            return
        chains = self._chains
        old = chains.pop(hashes[0], None)    # re-inserted: the dict's order is the order of use
        if old is not None:
            self._chains_size -= len(old[0])
        chains[hashes[0]] = (hashes, req.blocks, req)
        self._chains_size += len(hashes)
        if (len(chains) > _MAX_CHAINS
                or self._chains_size > _CHAIN_BLOCKS_PER_CACHE_BLOCK * self.num_gpu_blocks):
            for h in list(islice(chains, (len(chains) + 1) // 2)):   # the older half
                self._chains_size -= len(chains.pop(h)[0])

    def _count_prefix(self, req: _Req, hit_tokens: int) -> None:
        if self.prefix_metrics == "at_lookup":
            self.prefix_queries += req.num_tokens
            self.prefix_hits += hit_tokens
        elif not req.counted:
            self.prefix_queries += req.num_tokens
            self.prefix_hits += hit_tokens
        else:
            self.preempted_prefix_queries += req.num_tokens
            self.preempted_prefix_hits += hit_tokens
        req.counted = True

    def _admit(self, req: _Req, budget: int, now: float, result: StepResult) -> int | None:
        """Try to start ``req``: tokens scheduled, 0 for a started KV transfer, None if no room."""
        bs = self.block_size
        resumed_after_transfer = req.computed > 0
        if resumed_after_transfer:
            hit = []
            hit_tokens = req.computed
        elif req is self._hol_req:
            hit = self._hol_hit
            k = len(hit)
            limit = min(len(req.hashes), (req.num_tokens - 1) // bs)
            if k < limit and req.hashes[k] in self._cached:   # the chain grew since last try
                more = self._lookup(req.hashes[k:limit], (limit - k) * bs + 1)
                if more:
                    hit = hit + more
                    self._hol_hit = hit
                    self._hol_set.update(more)
                    self._hol_touch_free += self._count_free(more)
            hit_tokens = len(hit) * bs
        else:
            hit = self._lookup(req.hashes, req.num_tokens)
            hit_tokens = len(hit) * bs
        if self.prefix_metrics == "at_lookup" and not resumed_after_transfer:
            self._count_prefix(req, hit_tokens)

        if req.remote_prefill is not None and not resumed_after_transfer:
            # Decode side of P/D: hold the local hit, allocate room for the remote blocks, pull.
            n_full = min(len(req.hashes), (req.num_tokens - 1) // bs)
            wanted = req.remote_prefill.get("remote_block_ids")
            if isinstance(wanted, list):
                n_full = min(n_full, len(wanted))
            n_full = max(n_full, len(hit))
            need = (n_full - len(hit)) + self._count_free(hit)
            if need > self._num_free:
                return None
            self._touch(req, hit)
            if n_full > len(hit):
                self._allocate(req, n_full - len(hit))
            if self.prefix_metrics == "after_alloc":
                self._count_prefix(req, hit_tokens)
            req.cached_tokens = n_full * bs
            self._note_chain(req)
            # One pull per request, as vLLM's connector clears do_remote_prefill once it has
            # scheduled the load: after a preemption or a give-back it computes locally (its
            # pulled blocks stay cached), and a pull of no full block cannot repeat forever.
            req.remote_prefill = None
            req.state = _TRANSFERRING
            req.ready_at = now + self.profile.kv_transfer_s((n_full - len(hit)) * bs)
            self.waiting.remove(req)
            self._transferring.append(req)
            result.transfers_started.append(req.id)
            return 0

        num_new = req.num_tokens - hit_tokens
        threshold = self.long_prefill_token_threshold
        if threshold and num_new > threshold:
            num_new = threshold
        if num_new > budget:
            num_new = budget
        need_new = -(-(hit_tokens + num_new) // bs) - len(hit) - len(req.blocks)
        n_free = self._num_free
        memo = req is self._hol_req and hit is self._hol_hit
        fail = need_new > n_free
        touch_free = -1
        if not fail and need_new + len(hit) > n_free:   # the refcount-0 part of the hit matters
            touch_free = self._hol_touch_free if memo else self._count_free_hit(hit)
            fail = need_new + touch_free > n_free
        pin_fail = False
        if not fail and self._num_pinned and need_new:
            # A waiting request's new blocks may not come from pinned ones (its own hit on
            # them is fine): only unpinned free blocks, less the unpinned ones its hit takes.
            fail = pin_fail = need_new + self._unpinned_free(hit) > n_free - self._num_pinned
        if fail:
            self._pin_blocked = pin_fail
            if not memo:   # it will be retried next step: remember its hit until one is evicted
                self._hol_req, self._hol_hit, self._hol_set = req, hit, set(hit)
                # counted just above in the common case (a failure decided by the hit's free part)
                self._hol_touch_free = (touch_free if touch_free >= 0
                                        else self._count_free_hit(hit) if hit else 0)
            return None
        if req is self._hol_req:
            self._hol_req, self._hol_hit, self._hol_set = None, [], set()
        self._touch(req, hit)
        if need_new > 0:
            self._allocate(req, need_new)
        if self.prefix_metrics == "after_alloc" and not resumed_after_transfer:
            self._count_prefix(req, hit_tokens)
        self._register(req, hit_tokens + num_new)
        self._note_chain(req)
        if req.cached_tokens is None:
            req.cached_tokens = hit_tokens
        req.computed = hit_tokens + num_new
        if req.scheduled_time is None:
            req.scheduled_time = now
        req.state = _RUNNING
        if self.waiting and self.waiting[0] is req:
            self.waiting.popleft()
        else:
            self.waiting.remove(req)
        self.running.append(req)
        return num_new

    def _unpinned_free(self, blocks: Sequence[int]) -> int:
        """How many of ``blocks`` are free and not pinned."""
        ref = self._ref
        run_of = self._run_of
        return sum(1 for b in blocks if ref[b] < 0 and run_of[-ref[b]].expiry is None)

    def _touch(self, req: _Req, hit: list[int]) -> None:
        if not hit:
            return
        ref = self._ref
        k = len(hit)
        r0 = ref[hit[0]]
        hol_set = self._hol_set
        if r0 < 0:
            # A returning turn: its hit is the tail of the run the previous turn released
            # (released in reverse), all free. Check it with one C-level comparison and
            # take it out of the queue as one slice.
            run = self._run_of[-r0]
            q = run.q
            if not run.dirty and k <= len(q) - run.head and q[-k:] == hit[::-1]:
                del q[-k:]
                _fill(ref, hit, 1)
                self._num_free -= k
                if run.expiry is not None:
                    self._num_pinned -= k
                if hol_set:   # the memo's free blocks among them are held now
                    self._hol_touch_free -= len(hol_set.intersection(hit))
                req.blocks.extend(hit)
                req.registered = k
                return
        if hit is self._held_hit:
            # The lookup found all of it in blocks a live request holds (no release since):
            # none is free, so no queue entry changes; each refcount goes up by one, and
            # while no block is shared every one of them is 1.
            if self._num_shared:
                _incr(ref, hit)
            else:
                _fill(ref, hit, 2)
            self._num_shared += k
            req.blocks.extend(hit)
            req.registered = k
            return
        free, entries = _touch_blocks(hit, ref)
        taken = len(free)
        if taken:
            # the free ones' queue entries go stale, filtered when allocation reaches them
            run_of = self._run_of
            for r in dict.fromkeys(entries):
                run = run_of[-r]
                run.dirty = True
                if run.expiry is not None:
                    self._num_pinned -= entries.count(r)
            if hol_set:
                self._hol_touch_free -= len(hol_set.intersection(free))
        self._num_free -= taken
        self._num_shared += k - taken
        req.blocks.extend(hit)
        req.registered = k

    def _take(self, n: int) -> list[int]:
        """The ``n`` blocks at the free queue's head, in order, out of the queue."""
        runs = self._runs
        if runs:   # the common case: the head run, filtered, has more than n blocks
            run = runs[0]
            h = run.head
            q = run.q
            if not run.dirty and len(q) - h > n:
                run.head = h + n
                self._num_free -= n
                return q[h:h + n]
        ref = self._ref
        taken: list[int] = []
        need = n
        while need:
            if not runs and runs is self._runs:   # only pinned blocks are left: the oldest
                runs = self._pinned                 # pin's first (LRU among them)
                before = need
            run = runs[0]
            if run.dirty:   # drop the entries hits took one by one (C-level passes)
                q = run.q[run.head:]
                run.q = _select_equal(ref, q, -run.rid)
                run.head = 0
                run.dirty = False
            q = run.q
            h = run.head
            avail = len(q) - h
            if avail <= need:
                taken += q[h:] if h else q
                need -= avail
                runs.popleft()
                del self._run_of[run.rid]
            else:
                taken += q[h:h + need]
                run.head = h + need
                need = 0
        if runs is self._pinned:
            self._num_pinned -= before
        self._num_free -= n
        return taken

    def _peek(self, n: int) -> list[int]:
        """The blocks ``_take(n)`` would return (at most n; pinned ones not included), left in
        the queue."""
        ref = self._ref
        out: list[int] = []
        for run in self._runs:
            need = n - len(out)
            if need <= 0:
                break
            h = run.head
            if run.dirty:
                out += _select_equal(ref, run.q[h:], -run.rid)[:need]
            else:
                out += run.q[h:h + need]
        return out

    def _allocate(self, req: _Req, n: int) -> None:
        if n > self._num_free:
            raise RuntimeError(f"allocating {n} blocks with {self._num_free} free")
        taken = self._take(n)
        if self.kv_events is None:
            # _claim, its first pass inline (it returns n unless a block of the memo's hit goes)
            k = _evict_claim(taken, self._block_hash, self._cached, self._ref, 1, self._hol_set, 0)
            if k < n:
                self._claim_from(taken, k)
            req.blocks += taken
            return
        ref = self._ref
        block_hash = self._block_hash
        cached = self._cached
        hol_set = self._hol_set
        kv_events = self.kv_events
        append = req.blocks.append
        for b in taken:
            h = block_hash[b]
            if h is not None:
                del cached[h]     # evict
                block_hash[b] = None
                kv_events.append((0, h))
                if b in hol_set:
                    self._evict_memo(b)
            ref[b] = 1
            append(b)

    def _claim(self, taken: list[int]) -> None:
        """Blocks just taken from the free queue (no KV events): their hashes evicted, refcount 1.
        Evict and claim (_pool.evict_claim), stopping at each block of the head-of-line memo's
        hit that loses its hash, which the memo must hear of."""
        self._claim_from(taken, _evict_claim(taken, self._block_hash, self._cached, self._ref, 1,
                                             self._hol_set, 0))

    def _claim_from(self, taken: list[int], k: int) -> None:
        """_claim from ``taken[k]``, a block of the memo's hit that loses its hash."""
        ref = self._ref
        block_hash = self._block_hash
        cached = self._cached
        hol_set = self._hol_set
        n = len(taken)
        while k < n:
            b = taken[k]
            del cached[block_hash[b]]
            block_hash[b] = None
            self._evict_memo(b)
            ref[b] = 1
            k = _evict_claim(taken, block_hash, cached, ref, 1, hol_set, k + 1)

    def _evict_memo(self, b: int) -> None:
        """The memo's hit now ends before block ``b``, just evicted: a fresh lookup would stop
        there too (the blocks before it keep their hashes), and if the hash comes back the
        memo's "chain grew" check in _admit finds it. Evictions take a released run from its
        end, so b is mostly the hit's last block: found without a scan, cut in place (the memo
        owns its list)."""
        hit = self._hol_hit
        k = len(hit) - 1 if hit[-1] == b else hit.index(b)
        gone = hit[k:]
        self._hol_touch_free -= self._count_free(gone)
        self._hol_set.difference_update(gone)
        del hit[k:]

    def _register(self, req: _Req, num_computed: int) -> None:
        """Cache the prompt blocks that are full once ``num_computed`` tokens are computed."""
        upto = num_computed // self.block_size
        hashes = req.hashes
        if upto > len(hashes):
            upto = len(hashes)
        k = req.registered
        if upto <= k:
            return
        cached = self._cached
        block_hash = self._block_hash
        blocks = req.blocks
        kv_events = self.kv_events
        if kv_events is None:
            _register_blocks(cached, block_hash, hashes, blocks, k, upto)
            req.registered = upto
            return
        for idx in range(k, upto):
            h = hashes[idx]
            if h not in cached:   # another block may already hold this content
                b = blocks[idx]
                cached[h] = b
                block_hash[b] = h
                kv_events.append((1, req.id, idx))
        req.registered = upto

    def _free_blocks(self, req: _Req, pin_until: float | None = None) -> None:
        """Release the request's blocks: those left with no holder go to the free queue's tail
        as one run, the request's last block first (vLLM frees in reverse, so it is evicted first).
        ``pin_until``: a finished request under kv_pin_ttl_s; the run is pinned until then."""
        blocks = req.blocks
        req.blocks = []
        req.registered = 0
        if not blocks:
            return
        self._held_hit = None   # a release can free blocks of the last lookup's held hit
        ref = self._ref
        hol_set = self._hol_set
        rid = self._next_rid
        self._next_rid = rid + 1
        neg = -rid
        refs = _gather(ref, blocks) if self._num_shared else None
        n_last = refs.count(1) if refs is not None else len(blocks)
        if n_last == len(blocks):
            # No block shared with another request (known without reading a refcount when no
            # block of the engine is): every block goes free.
            q = blocks[::-1]
            _fill(ref, blocks, neg)
        elif refs[:len(blocks) - n_last].count(2) == len(blocks) - n_last:
            # A leading run shared with one other request (the session's next turn took it as
            # its hit while this one ran): it stays with that request, the rest goes free.
            shared = len(blocks) - n_last
            self._num_shared -= shared
            _fill(ref, blocks[:shared], 1)
            q = blocks[:shared - 1:-1] if shared else blocks[::-1]
            if not q:
                return
            _fill(ref, q, neg)
        else:
            q = _release(blocks, ref, neg)
            self._num_shared -= len(blocks) - len(q)   # each decrement that left a holder
            if not q:
                return
        if hol_set:   # the memo's blocks among those now free (one C-level pass, not a test each)
            self._hol_touch_free += len(hol_set.intersection(q))
        run = _Run(rid, q)
        if pin_until is None:
            self._runs.append(run)
        else:
            run.expiry = pin_until
            self._pinned.append(run)
            self._num_pinned += len(q)
            if self._num_pinned > self._pin_cap:   # over kv_pin_max_share: the oldest pins end now
                self._expire_pins(float("-inf"))
        self._run_of[rid] = run
        self._num_free += len(q)

    def _give_back_pulled(self, result: StepResult, blocked: _Req, now: float) -> bool:
        """The last waiting request other than ``blocked`` (the one that did not fit) that holds
        pulled KV blocks gives them back, as a preempted one: it starts over as a local prefill
        (its pulled blocks stay cached, so its lookup finds what was not evicted since). Called
        when nothing runs and ``blocked`` does not fit; False if no other waiting request holds
        blocks (then only a transfer in flight can change anything, and it lands later).
        ``blocked`` never gives its own back: it would take them again at once."""
        waiting = self.waiting
        for k in range(len(waiting) - 1, -1, -1):
            req = waiting[k]
            if req.blocks and req is not blocked:
                del waiting[k]
                self._preempt(req, now)
                result.preempted.append(req.id)
                return True
        return False

    def _queue_behind_holders(self, req: _Req) -> None:
        """Queue ``req`` ahead of every plain waiting request but behind the ones that hold KV
        blocks (pulled remote KV): vLLM drains its kv_holding_waiting queue first. Ahead of those,
        a request that cannot fit would block them while they hold the blocks it needs, and with
        nothing running nothing would ever free one. The holders stay a prefix of the queue.
        Under the priority policy, by ``(priority, arrival_time)`` among the non-holders."""
        if self._by_priority:
            self._insert_by_priority(req)
            return
        waiting = self.waiting
        k = 0
        while k < len(waiting) and waiting[k].computed and waiting[k].blocks:
            k += 1
        if k:
            waiting.insert(k, req)
        else:
            waiting.appendleft(req)

    def _insert_by_priority(self, req: _Req) -> None:
        """Queue ``req`` by ``(priority, arrival_time)`` behind the holders of pulled KV, after
        the requests of an equal key (a heap gives equal keys no order; this keeps it stable)."""
        waiting = self.waiting
        lo = 0
        n = len(waiting)
        while lo < n and waiting[lo].computed and waiting[lo].blocks:
            lo += 1
        key = _priority_key(req)
        j = n
        while j > lo and key < _priority_key(waiting[j - 1]):
            j -= 1
        if j == n:
            waiting.append(req)
        else:
            waiting.insert(j, req)

    def _preempt(self, req: _Req, now: float) -> None:
        self._free_blocks(req)
        req.computed = 0
        req.state = _WAITING
        req.preemptions += 1
        self.num_preemptions += 1
        self._queue_behind_holders(req)

    def _transfer_params(self, req: _Req) -> dict[str, Any]:
        n_full = min(len(req.hashes), (req.num_tokens - 1) // self.block_size, len(req.blocks))
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": list(req.blocks[:n_full]),
            "remote_engine_id": self.engine_id,
            "remote_host": None,
            "remote_port": None,
            "tp_size": 1,
        }

    def _finish(self, req: _Req, reason: str, when: float,
                params: dict[str, Any] | None = None) -> FinishedRequest:
        req.state = _DONE
        self._requests.pop(req.id, None)
        self.request_success[reason] = self.request_success.get(reason, 0) + 1
        return FinishedRequest(
            request_id=req.id, finish_reason=reason, num_prompt_tokens=req.prompt,
            num_output_tokens=req.output, num_cached_tokens=req.cached_tokens or 0,
            num_preemptions=req.preemptions, arrival_time=req.arrival, queued_time=req.queued_time,
            scheduled_time=req.scheduled_time, first_token_time=req.first_token_time,
            finish_time=when, kv_transfer_params=params)
