"""The online latency a remote server's operator promises (an SLO), and the limit of batch
requests in flight there steered by it (docs/remote-engine.md, "Online latency").

Batch requests fill what online traffic leaves of a shared `vllm serve`; each one in a
step makes that step longer, and so every online user's time to first token. The limit of
engine/remote_limits.py is steered here by what online users see, at the SLO's percentile
(p99 by default) over a window with enough samples to know one:

- **The measure**: vLLM's own histogram of time to first token
  (`vllm:time_to_first_token_seconds`, every request the server served), read from its
  /metrics at each tick, less our batch requests' own share: a server started with
  `--enable-per-request-metrics` says each answer's time to first token, which the workers
  put in a Redis stream (`Ours`), and the prober takes them out of the histogram bucket by
  bucket. Where our answers do not say (another server, the flag off) the measure is the
  probes alone: one tiny streamed request at online priority every `slo_probe_interval`
  seconds, timed from the POST to its first token, which also measure the latency *alone*
  (no batch request in flight) and stand guard from the client's side.
- **Whether any online user is there now**: the server's requests running and waiting
  (vLLM's gauges) beyond our leases. With none for LULL_SECONDS the limit fills the lull
  (doubling per tick up to the fill cap; the ceiling where no online user was seen for
  QUIET_SECONDS, or none ever in the FIRST_QUIET_SECONDS since the prober started) and,
  when online users come back, drops at once to where the SLO held, aborting the batch
  requests above it (engine/remote.py sheds them; they run again later). The fill cap
  starts where the SLO holds, halves from what users coming back met where they met the
  SLO broken (ONSET_SECONDS), and doubles after a lull they came back from unharmed while
  under half of the SLO's budget over BUDGET_SECONDS (the share of online samples the
  percentile lets past it, counted over a full window at least) is spent. A server without
  vLLM's metrics is taken to always have online users.
- **The controller**: between the latency alone and the SLO, the measured percentile of
  the samples since the limit last moved decides once there are enough of them (ten for a
  p90, a hundred for a p99). A lull's fill and the return from it do not start a new
  window (the samples taken above the level are left out of it), so a p99's window fills
  across bursts of online users, each too short to fill one. Grown where the step's share
  of the room (in proportion to the limit) stays under `slo_band`, held up to it, cut past
  it; and cut at once, before a full window, when more samples are past the SLO than a
  full window may have. A growth is taken where the step's share of the room, in
  proportion to the limit, stays under `slo_band`; where it would not, one request more is
  still tried while the measured percentile is well under the band and the SLO's budget
  allows (a trial, on a full window too: trials on a fifth of one spent the budget within
  a minute on the CPU server here, and paused the batch for minutes): a server's first
  batch request costs online users more than each next one, which the proportion cannot
  know. A limit cut back from is not tried again for BUDGET_SECONDS. A limit of 1 that
  must be cut goes to 0 (paused) while online users are there: even one batch request in
  flight breaks the SLO; one is tried again after PAUSE_RETRY_SECONDS, the wait doubled
  after each retry that ends paused again (pause_retry_wait), and a lull resumes the batch
  meanwhile. The budget's window starts again at a pause: the samples that caused it are
  answered by it (and by the level not being tried again), so they do not hold back the
  retry and the trials after it for the rest of the budget's window.
- **The deadline floor**: the concurrency the server's batches need to meet their windows
  (the plan of jobs/capacity/plan.py, written to the server's state by the reconciler's
  pass). The SLO never cuts below it, nor pauses under it; the reason then says the SLO is
  traded for a deadline.

The 429/503/timeout cuts of remote_limits.ADJUST still apply on top.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
import time
import uuid
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from engine import remote_limits as limits
from engine.base import EngineError
from engine.endpoints import CHAT, COMPLETIONS

log = logging.getLogger(__name__)

OPTIONS: dict[str, Any] = {
    "ttft_slo_ms": None, "ttft_slo_factor": None, "ttft_slo_percentile": 99.0,
    "itl_slo_ms": None, "slo_probe_interval": 1.0, "slo_band": 0.8, "online_priority": 0,
}
# A percentile decides a growth once a window holds this many samples past it (at p99,
# 100 samples: the percentile is then the second largest, not one slow step's maximum).
TAIL_SAMPLES = 1
# Probe samples kept per server, newest first (enough for a p99 and its guard).
PROBES_KEPT = 200
# Probes sent with no batch request in flight that make the latency alone.
ALONE_KEPT = 100
ALONE_FIRST = 5
# Histogram windows are kept this long at most (the budget's window and a decision's).
BUDGET_SECONDS = 600.0
# No online request in the server for this long: a lull, filled with batch requests.
LULL_SECONDS = 3.0
# Online users seen within this long: a lull between them is filled up to the fill cap
# (which starts where the SLO holds and doubles after each lull users came back from
# unharmed); none seen for this long: up to the ceiling.
QUIET_SECONDS = 300.0
# Where no online user was seen since the prober started, quiet after this long: users of
# a server a worker starts beside take seconds to show in its counts, and a lull filled
# to the ceiling before they do has their first requests meet it.
FIRST_QUIET_SECONDS = 30.0
# Online users coming back after a lull are judged over this long: those that came in it
# met the lull's batch requests until they were aborted.
ONSET_SECONDS = 10.0
# Paused with online users there: one batch request is tried again after this long,
# doubled after each retry that ends paused again, up to half the budget's window.
PAUSE_RETRY_SECONDS = 30.0
# A growth the proportion would not take is tried where the percentile is under this
# share of the band.
TRIAL_SHARE = 0.75
# A deadline floor older than this was written by no live reconciler: ignored.
FLOOR_FRESH_SECONDS = 120.0
# Our answers' times to first token kept in the stream (the prober reads them each tick).
OURS_KEPT = 10000


@dataclass(frozen=True)
class Slo:
    """The SLO of one remote server, from its model's options."""

    ttft_ms: float | None  # the time to first token to hold, or
    factor: float | None  # a multiple of the time alone
    percentile: float
    itl_ms: float | None
    interval: float
    band: float
    online_priority: int | None
    endpoint: str  # what the probe asks: chat where served, else completions

    @property
    def budget(self) -> float:
        """The share of online samples that may be past the SLO (0.01 at p99)."""
        return 1 - self.percentile / 100

    @property
    def enough(self) -> int:
        """Samples a window needs before its percentile decides a growth."""
        return math.ceil(TAIL_SAMPLES / self.budget - 1e-9)


def number_option(name: str, option: str, value: Any, *, low: float,
                  high: float = math.inf, what: str) -> float:
    """A remote model's numeric option, checked: above `low`, below `high`."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not (
            math.isfinite(value) and low < value < high):
        raise EngineError(f"model {name!r}: {option} must be {what}, not {value!r}")
    return float(value)


def parse(name: str, options: dict[str, Any], endpoints: Sequence[str]) -> Slo | None:
    """The SLO the options set, or None without one; a clear EngineError for a bad one."""
    ttft, factor = options.get("ttft_slo_ms"), options.get("ttft_slo_factor")
    itl = options.get("itl_slo_ms")
    if ttft is not None and factor is not None:
        raise EngineError(f"model {name!r}: set ttft_slo_ms or ttft_slo_factor, not both")
    if ttft is None and factor is None:
        if itl is not None:
            raise EngineError(f"model {name!r}: itl_slo_ms needs ttft_slo_ms or "
                              "ttft_slo_factor")
        return None
    endpoint = CHAT if CHAT in endpoints or not endpoints else (
        COMPLETIONS if COMPLETIONS in endpoints else "")
    if not endpoint:
        raise EngineError(f"model {name!r}: an SLO needs a model serving "
                          f"{CHAT} or {COMPLETIONS} (the probe is a one-token answer)")
    priority = options.get("online_priority", OPTIONS["online_priority"])
    if priority is not None and (isinstance(priority, bool) or not isinstance(priority, int)):
        raise EngineError(f"model {name!r}: online_priority must be an integer or null, "
                          f"not {priority!r}")
    get = {**OPTIONS, **options}.get
    return Slo(
        ttft_ms=None if ttft is None else number_option(
            name, "ttft_slo_ms", ttft, low=0, what="milliseconds above 0"),
        factor=None if factor is None else number_option(
            name, "ttft_slo_factor", factor, low=1,
            what="a multiple above 1 of the time to first token alone"),
        percentile=number_option(name, "ttft_slo_percentile", get("ttft_slo_percentile"), low=0,
                           high=100, what="a percentile between 0 and 100 (e.g. 99)"),
        itl_ms=None if itl is None else number_option(name, "itl_slo_ms", itl, low=0,
                                                what="milliseconds above 0"),
        interval=number_option(name, "slo_probe_interval", get("slo_probe_interval"), low=0.05,
                         what="seconds above 0.05"),
        band=number_option(name, "slo_band", get("slo_band"), low=0, high=1,
                     what="a fraction between 0 and 1 of the room below the SLO"),
        online_priority=priority, endpoint=endpoint)


def percentile(values: Sequence[float], p: float) -> float:
    """Nearest rank: the smallest value with at least p% of the values at or below it."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)]


def apart(at: float, spans: Sequence[tuple[float, float]]) -> bool:
    """Whether the time `at` falls in one of `spans` ((start, end])."""
    return any(start < at <= end for start, end in spans)


@dataclass(frozen=True)
class Tail:
    """A window of online samples as the controller reads it: how many, the SLO's
    percentile of them (ms), and how many are past the SLO."""

    n: float
    value_ms: float | None
    # Samples past the SLO: of a histogram's bucket across it, the share past it.
    over: float
    # Those past it for certain (a histogram's buckets wholly past it); None: `over`
    # (exact samples). With no bucket edge at the SLO the two differ: vLLM's own edges
    # are 250 ms apart above 250 ms, and a bucket across the SLO holds users who met it.
    sure: float | None = None

    @property
    def surely_over(self) -> float:
        return self.over if self.sure is None else self.sure

    def certain_over(self, slo: Slo) -> bool:
        """More samples past the SLO for certain than a full window may hold: the
        percentile of any window holding these is past it, however many samples come
        next."""
        return self.surely_over > slo.budget * max(self.n, slo.enough) + 1e-6

    def spent(self, slo: Slo) -> float:
        """The samples past the SLO over those its percentile lets past, in a full window
        at least: a few samples with none past it spend nothing, one past it in a few
        spends a full window's share."""
        return self.over / (slo.budget * max(self.n, slo.enough))


def samples_tail(values_ms: Sequence[float], p: float, target_ms: float | None) -> Tail:
    """The tail of exact samples (the probes'): nearest rank."""
    if not values_ms:
        return Tail(0, None, 0)
    over = sum(v > target_ms for v in values_ms) if target_ms is not None else 0
    return Tail(len(values_ms), percentile(values_ms, p), over)


def histogram_tail(edges: Sequence[float], counts: Sequence[float], p: float,
                   target_ms: float | None) -> Tail:
    """The tail of a histogram (upper edges in seconds, ascending, the last +Inf; counts
    per bucket), read as Prometheus' histogram_quantile does: linear within a bucket.
    A bucket edge at the SLO makes its count past the SLO exact (`over` and `sure` meet)."""
    n = sum(counts)
    if n <= 0:
        return Tail(0, None, 0)
    rank = p / 100 * n
    value = lower = 0.0
    seen = 0.0
    for edge, count in zip(edges, counts, strict=True):
        if count > 0 and seen + count >= rank:
            value = lower if math.isinf(edge) else lower + (edge - lower) * (
                (rank - seen) / count)
            break
        seen += count
        lower = lower if math.isinf(edge) else edge
    over = sure = 0.0
    if target_ms is not None:
        target, lower = target_ms / 1000, 0.0
        for edge, count in zip(edges, counts, strict=True):
            if lower >= target:
                over += count
                sure += count
            elif edge > target:
                over += count if math.isinf(edge) else count * (edge - target) / (
                    edge - lower)
            lower = edge
    return Tail(n, value * 1000, over, sure)


@dataclass(frozen=True)
class Decision:
    limit: float
    # "slo", "paused", "deadline_floor", "ceiling", "no_online_traffic", "measuring"
    reason: str
    # The requests in flight above the new limit are aborted, not run to their end: online
    # users are back after a lull, or even one batch request breaks the SLO.
    shed: bool = False
    # Cut for what online users met (not for their return after a lull).
    cut: bool = False


def pressure(measured: float, *, alone: float, target: float) -> float:
    """Where `measured` stands in the room between the latency alone (0) and the SLO (1)."""
    room = max(target - alone, 1e-3 * target)
    return (measured - alone) / room


def decide(*, pressure_now: float | None, over: bool, enough: bool, band: float,
           limit: float, ceiling: float, floor: float, binding: bool, online: bool,
           slo_limit: float | None, fill_cap: float | None = None, draining: bool = False,
           retry: bool = False, pressure_cut: float | None = None,
           trial: bool = False, tried: float | None = None) -> Decision:
    """The next limit. `pressure_now`: the measured percentile's place between alone and
    the SLO (None: nothing to go by yet); `pressure_cut`: the same where a cut is decided,
    where it reads lower (the measure's samples that may be ours left out); `over`: more
    samples past the SLO than a full window may hold; `enough`: the window holds enough
    samples for its percentile to decide a growth; `binding`: the limit, not the batch,
    bounds the requests in flight (growing an unused limit says nothing of what it would
    do); `slo_limit`: where the
    SLO last held; `fill_cap`: how high a lull is filled (the ceiling where None);
    `draining`: more requests are in flight than the limit (a cut not yet felt: the
    requests above it still run to their end, and cutting again would overshoot);
    `retry`: paused long enough to try one batch request again; `trial`: the budget
    allows a growth the proportion would not take; `tried`: the lowest limit cut back
    from lately (growth stays under it)."""
    # A floor asks for requests in flight: at least one (never paused under it).
    floor = min(max(floor, 1.0), ceiling) if floor > 0 else 0.0
    if not online:
        top = ceiling if fill_cap is None else max(min(ceiling, fill_cap), slo_limit or 0.0)
        grown = min(top, max(limit * 2, limit + 1)) if binding else min(limit, top)
        new = max(grown, floor)
        return Decision(new, "ceiling" if new >= ceiling else "no_online_traffic")

    def held(new: float, shed: bool = False, cut: bool = False) -> Decision:
        if new < floor:
            return Decision(floor, "deadline_floor", cut=cut)
        return Decision(new, "paused" if new < 1 else "slo", shed, cut)

    if slo_limit is not None and limit > slo_limit:
        # Online users are back: straight to where the SLO held, the excess aborted.
        return held(slo_limit, shed=True)
    if pressure_now is None:
        new = max(limit, floor)
        if new > limit:
            return Decision(new, "deadline_floor")
        return Decision(new, "paused" if new < 1 else "measuring")
    cut_at = pressure_now if pressure_cut is None else pressure_cut
    cut = over or (enough and cut_at >= band)
    if limit < 1:
        # Paused: tried again only after a while, with the time paused as its window,
        # where online users alone leave room under the band.
        if retry and not cut and enough and pressure_now < band:
            return held(1.0)
        return held(0.0)
    if cut and limit <= 1:
        if over or cut_at >= 1.0:
            return held(0.0, shed=True, cut=True)  # one batch request breaks the SLO: none
        # Past the band, not the SLO: one request holds. The band is a margin for the
        # steps between limits; the latency alone it is measured from is the probes',
        # under the online users' own (a one-token "Hi" against their prompts), so at 1
        # it can read past the band where users still meet the SLO.
        return held(limit)
    if cut and draining:
        return held(limit)
    if cut:
        worst = max(cut_at, band, 1.0 if over else 0.0)
        return held(max(1.0, limit * max(0.5, min(0.85, band / worst * 0.85))), cut=True)
    if enough and binding:
        # Far below the band the step is larger: a p99's window is long to wait for. A
        # step is taken where the room it uses, in proportion to the requests in flight
        # (a CPU server's steps grow so), stays under the band; else one request more as
        # a trial, where the budget allows it and the percentile is well under the band.
        step = 0.5 if pressure_now < band / 4 else 0.1
        new = min(ceiling, limit + max(1.0, step * limit))
        if tried is not None and limit < tried <= new:
            new = tried - 1
        if new > limit and pressure_now * new / limit < band:
            return Decision(max(new, floor), "ceiling" if new >= ceiling else "slo")
        if new > limit and trial and pressure_now < band * TRIAL_SHARE:
            new = min(new, limit + 1)
            return Decision(max(new, floor), "ceiling" if new >= ceiling else "slo")
    new = max(limit, floor)
    if new > limit:
        return Decision(new, "deadline_floor")
    return Decision(new, "ceiling" if new >= ceiling else "slo")


def window_start(steered_at: float, now: float, *, online: bool,
                 decision: Decision) -> float:
    """When the window of samples that steers the limit starts once `decision` moved it
    (from a window begun at `steered_at`): a lull's fill, and the return from it to where
    the SLO held, keep the window of that level (the samples taken above it are left out);
    a move of the level itself starts a new one."""
    kept = not online or (decision.shed and not decision.cut)
    return steered_at if kept else now


def pause_retry_wait(fails: int) -> float:
    """How long a pause lasts before one batch request is tried again, after `fails`
    pauses with no window held at one request or more between them (the first pause: 1).
    A retry that fails costs online users about two samples past the SLO (a pause at one
    request needs two); doubling the wait bounds what failing retries spend to a few in
    the budget's window."""
    return min(BUDGET_SECONDS / 2, PAUSE_RETRY_SECONDS * 2 ** max(0, fails - 1))


def next_fill_cap(cap: float, *, onset_bad: bool | None, reached: float, spent: float,
                  slo_limit: float, ceiling: float) -> float:
    """How high the next lull is filled. `onset_bad`: whether online users coming back
    after the last lull (which reached `reached`) met a time to first token past the SLO
    before its batch requests were aborted (None: no lull ended since); `spent`: the
    samples past the SLO over those the percentile allows in the budget's window (in a
    full window at least: a few samples say nothing of a p99). Halved from what users met where
    they met the SLO broken (never below where the SLO holds; a half under 1 is none: lulls
    are not filled); doubled after a lull filled to it that users came back from
    unharmed, while under half the budget is spent: each try of a higher fill may cost
    the budget a slow sample or two."""
    if onset_bad:
        half = min(cap, reached) / 2
        return max(slo_limit, half if half >= 1 else 0.0)
    if onset_bad is False and reached >= cap and spent < 0.5 and cap < ceiling:
        return min(ceiling, max(1.0, cap * 2))
    return cap


# KEYS: state. ARGV: the limit read, the new limit, reason, ceiling, when the window of
# samples that steers the limit starts (the prober's clock, which its samples carry).
# Written only if no one changed the limit meanwhile (a 429's cut since is kept).
STEER = """
local ceiling = tonumber(ARGV[4])
local limit = math.min(tonumber(redis.call('HGET', KEYS[1], 'limit') or ceiling), ceiling)
if math.abs(limit - tonumber(ARGV[1])) > 1e-6 then
  return tostring(limit)
end
redis.call('HSET', KEYS[1], 'limit', ARGV[2], 'reason', ARGV[3], 'steered_at', ARGV[5])
return ARGV[2]
"""


def keys(base_url: str) -> tuple[str, str, str, str]:
    """(probe lock, probe samples, samples alone, our answers' times to first token)
    keys of the server at `base_url`."""
    prefix = f"{limits.KEY_PREFIX}{limits.server_id(base_url)}"
    return f"{prefix}:prober", f"{prefix}:probes", f"{prefix}:alone", f"{prefix}:ours"


_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
TTFT_BUCKET = "vllm:time_to_first_token_seconds_bucket"


@dataclass(frozen=True)
class Scrape:
    """What the prober reads of vLLM's /metrics for one model (every engine summed)."""

    running: float
    waiting: float
    # The TTFT histogram, cumulative: upper edges (seconds, ascending, +Inf last) and the
    # count at or below each; empty where the page has none.
    edges: tuple[float, ...] = ()
    cumulative: tuple[float, ...] = ()


def vllm_scrape(text: str, model: str) -> Scrape | None:
    """The running and waiting gauges and the TTFT histogram of `model` in vLLM's
    Prometheus text; None when the text has no such gauges (not vLLM)."""
    gauges = {"vllm:num_requests_running": 0.0, "vllm:num_requests_waiting": 0.0}
    found = False
    buckets: dict[float, float] = {}
    for line in text.splitlines():
        if not line.startswith(("vllm:num_requests_", TTFT_BUCKET)):
            continue
        name, _, rest = line.partition("{")
        labels_text, _, value = rest.rpartition("}") if rest else ("", "", line.split()[-1])
        name = name.split()[0]
        labels = dict(_LABEL.findall(labels_text))
        if labels.get("model_name", model) != model:
            continue
        try:
            number = float(value.split()[0])
        except (IndexError, ValueError):
            continue
        if name in gauges:
            gauges[name] += number
            found = True
        elif name == TTFT_BUCKET and "le" in labels:
            try:
                edge = float(labels["le"])
            except ValueError:
                continue
            buckets[edge] = buckets.get(edge, 0.0) + number
    if not found:
        return None
    edges = tuple(sorted(buckets))
    return Scrape(gauges["vllm:num_requests_running"], gauges["vllm:num_requests_waiting"],
                  edges, tuple(buckets[e] for e in edges))


@dataclass(frozen=True)
class Sample:
    at: float
    ttft_ms: float
    itl_ms: float | None
    ours: int  # batch requests of every worker in flight when it was sent

    def encode(self) -> str:
        return json.dumps([round(self.at, 3), round(self.ttft_ms, 2), self.itl_ms, self.ours])

    @classmethod
    def decode(cls, raw: bytes | str) -> Sample | None:
        try:
            at, ttft, itl, ours = json.loads(raw)
            return cls(float(at), float(ttft), None if itl is None else float(itl), int(ours))
        except (ValueError, TypeError):
            return None


@dataclass
class Tick:
    at: float  # when the server's page was read
    # The server's counts per bucket since the tick before, less those of our answers
    # whose first token came within it (taken out as our answers come in).
    online: list[float]
    leases: frozenset[bytes]  # ours held while the page was read


def without_top(counts: Sequence[float], drop: float) -> tuple[float, ...]:
    """`counts` with `drop` samples taken from its highest buckets."""
    out = list(counts)
    for i in range(len(out) - 1, -1, -1):
        if drop <= 0:
            break
        taken = min(out[i], drop)
        out[i] -= taken
        drop -= taken
    return tuple(out)


def without_like(counts: Sequence[float], drop: float,
                 like: Sequence[float]) -> tuple[float, ...]:
    """`counts` with `drop` samples taken out spread as `like`'s are (unchanged where
    `like` holds none)."""
    total = sum(like)
    if not total:
        return tuple(counts)
    return tuple(max(0.0, c - drop * w / total) for c, w in zip(counts, like, strict=True))


@dataclass
class Histogram:
    """The online part of vLLM's TTFT histogram, per tick: the server's counts since the
    tick before less our answers' (the probes stay: they are online requests).

    The server counts a request's first token when it comes, we when its answer does: each
    answer of ours is taken out of the tick its first token came in (when it was sent,
    plus its time to first token). Our requests still in flight may have had theirs, counted by
    the server and not yet by us: a window holds at most as many of those as it has
    leases of ours still held, in buckets not known yet. `window` says how many, and the
    controller reads the window two ways: without them spread as our answers' times are
    (for a growth), and without them taken from its top (for a cut: none on them)."""

    edges: tuple[float, ...] = ()
    last: tuple[float, ...] = ()  # the server's cumulative counts at the last tick
    begun: float = 0.0  # the first read: first tokens before it are in no tick
    ours_id: str = ""  # the last of our answers taken out
    ticks: deque[Tick] = field(default_factory=deque)
    early: list[tuple[float, int]] = field(default_factory=list)  # for the next tick
    timed: bool = False  # an answer of ours with its time was taken out
    ours: list[float] = field(default_factory=list)  # our answers per bucket, all told

    def take_out(self, first_at: float, bucket: int) -> None:
        """One answer of ours, out of the tick its first token came in."""
        self.timed = True
        if len(self.ours) != len(self.edges):
            self.ours = [0.0] * len(self.edges)
        self.ours[bucket] += 1
        if first_at <= self.begun:
            return  # in the first read's counts, which no window holds
        for index in range(len(self.ticks) - 1, -1, -1):
            before = self.ticks[index - 1].at if index else self.begun
            if first_at > before:
                if first_at > self.ticks[index].at:
                    break  # after the newest read: the next tick's
                self.ticks[index].online[bucket] -= 1
                return
        else:
            return  # before the oldest tick kept
        self.early.append((first_at, bucket))

    def add(self, tick: Tick) -> None:
        self.ticks.append(tick)
        early, self.early = self.early, []
        for first_at, bucket in early:
            self.ours[bucket] -= 1  # counted once, when it came
            self.take_out(first_at, bucket)

    def window(self, since: float, held: set[bytes], until: float = math.inf,
               left_out: Sequence[tuple[float, float]] = ()
               ) -> tuple[tuple[float, ...], int]:
        """Online counts per bucket since `since` (to `until`; ticks in the spans `left_out` not
        counted), and how many of our leases held now were held at a tick in it (at most that
        many of our first tokens are still in those counts). Our answer's time to first token is
        a little shorter than the server's count of it (which starts at the request's arrival in
        its front end and ends when the front end has the token): where a bucket is left below
        0, the deficit is ours counted a bucket or more higher, and is taken from there."""
        sums = [0.0] * len(self.edges)
        pending: set[bytes] = set()
        for tick in self.ticks:
            if since < tick.at <= until and not apart(tick.at, left_out):
                for i, c in enumerate(tick.online):
                    sums[i] += c
                pending |= tick.leases & held
        deficit = 0.0
        for i, count in enumerate(sums):
            sums[i] = max(0.0, count + deficit)
            deficit = min(0.0, count + deficit)
        return tuple(sums), len(pending)

    def bucket(self, seconds: float) -> int:
        for i, edge in enumerate(self.edges):
            if seconds <= edge:
                return i
        return len(self.edges) - 1


class Steering:
    """The SLO's half of a remote engine, on its event loop: probes and reads the server's
    metrics while it holds the server's probe lock, keeps the latency alone, and steers
    the shared limit. `ready` is set once a time alone is known where the SLO is a
    multiple of it (or could not be measured): the engine grants no slot before, so the
    first probes see no batch. Every engine records its own answers' times to first token
    (`answered`), whichever engine probes."""

    def __init__(self, *, slo: Slo, engine: Any) -> None:
        self.slo = slo
        self.engine = engine  # the RemoteEngine: its HTTP and Redis clients, keys, auth
        self.lock_key, self.samples_key, self.alone_key, self.ours_key = keys(engine.base_url)
        self.me = uuid.uuid4().hex
        self.ready = asyncio.Event()
        self.filling = False  # a lull is being filled: online users' return looked for often
        self._metrics_ok = True
        self._scraped = False
        self._target_ms: float | None = None  # the SLO in ms, once known
        self._histogram = Histogram()
        # Taken as online until a first lull is seen.
        self._present_at = time.monotonic()
        self._untimed: int | None = None
        self._untimed_at = -math.inf
        self._budget_since = time.time()
        # Online users last seen in the server's own counts; none yet: as if seen long
        # enough ago that the quiet begins FIRST_QUIET_SECONDS from now.
        self._seen_at = time.monotonic() - QUIET_SECONDS + FIRST_QUIET_SECONDS
        self._last_at = time.time()  # the last tick
        # A lull now: (when the last tick with online users was, the highest limit since);
        # users back from one: the same, judged ONSET_SECONDS after.
        self._lull: tuple[float, float] | None = None
        self._onset: tuple[float, float] | None = None
        # Spans of time (start, end] whose samples were taken with the limit above where
        # the SLO holds (a lull filled, users back until its excess was aborted): they are
        # no measure of that level, and are left out of the window that steers it, which
        # a lull's fill does not end (a p99's window fills across bursts of users).
        # One span per time above, grown at each tick while it lasts.
        self._apart: deque[tuple[float, float]] = deque()
        self._above_since: float | None = None  # the limit above that level since then

    # -- the probe ------------------------------------------------------------------

    def _probe_body(self) -> dict[str, Any]:
        tokens = 4 if self.slo.itl_ms is not None else 1
        body: dict[str, Any] = {"model": self.engine.model, "max_tokens": tokens,
                                "temperature": 0, "stream": True}
        if self.slo.endpoint == CHAT:
            body["messages"] = [{"role": "user", "content": "Hi"}]
        else:
            body["prompt"] = "Hi"
        if self.slo.online_priority is not None:
            body["priority"] = self.slo.online_priority
        return body

    async def probe(self) -> tuple[float, float | None] | None:
        """(time to first token, mean inter-token gap) in ms of one probe; None when the
        server could not be reached or refused it. A probe that times out is a sample of
        its timeout: online users waited at least that long. Once the SLO is known a
        probe waits at most twice it: past the SLO is all a decision needs to know, and a
        probe waited out would hold the next decision back as long as the server is slow."""
        url = self.engine.base_url + self.slo.endpoint[3:]
        timeout = max(0.5, 2 * self._target_ms / 1000) if self._target_ms else 10.0
        started = time.monotonic()
        stamps: list[float] = []
        try:
            async with self.engine._http.stream(
                    "POST", url, json=self._probe_body(), headers=self.engine._auth,
                    timeout=httpx.Timeout(timeout, connect=5.0)) as response:
                if response.status_code != 200:
                    # Without samples the limit holds where it is ("measuring"): say why.
                    if self.engine._first_in(60.0, "probe_refused"):
                        log.warning("remote %s: the SLO probe was answered %d; the limit "
                                    "holds until probes pass", self.engine.base_url,
                                    response.status_code)
                    return None
                async for line in response.aiter_lines():
                    if line.startswith("data: {") and '"choices"' in line:
                        stamps.append(time.monotonic())
        except httpx.TimeoutException:
            if stamps:  # the first token came: the gaps after it were too long
                return (stamps[0] - started) * 1000, (time.monotonic() - stamps[-1]) * 1000
            return (time.monotonic() - started) * 1000, None
        except httpx.HTTPError:
            return None
        if not stamps:
            return None
        itl = ((stamps[-1] - stamps[0]) / (len(stamps) - 1) * 1000
               if len(stamps) > 1 else None)
        return (stamps[0] - started) * 1000, itl

    # -- our answers ----------------------------------------------------------------

    async def answered(self, body: dict[str, Any], *, sent_at: float) -> None:
        """One of our batch answers, to a request POSTed at `sent_at` (time.time()): its
        time to first token as the server counted it (vLLM's per-request metrics: queue
        time and time to first token once scheduled), for the prober to take out of the
        server's histogram, at the tick its first token came in; counted as untimed where
        the answer does not say (the histogram is then no measure of online users)."""
        metrics = body.get("metrics")
        ttft = metrics.get("time_to_first_token_ms") if isinstance(metrics, dict) else None
        redis = self.engine._redis
        try:
            if isinstance(ttft, int | float) and not isinstance(ttft, bool):
                queued = metrics.get("queue_time_ms") if isinstance(metrics, dict) else 0
                queued = queued if isinstance(queued, int | float) and not isinstance(
                    queued, bool) else 0
                seconds = (ttft + queued) / 1000
                await redis.xadd(self.ours_key, {
                    "s": f"{seconds:.6f}", "at": f"{sent_at + seconds:.6f}"},
                    maxlen=OURS_KEPT, approximate=True)
            else:
                await redis.hincrby(self.engine._state_key, "untimed", 1)
        except Exception as e:
            log.warning("remote %s: an answer's time to first token not recorded (%s)",
                        self.engine.base_url, e)

    # -- the loop -------------------------------------------------------------------

    async def run(self) -> None:
        redis = self.engine._redis
        try:
            await self._first_alone(redis)
        finally:
            self.ready.set()
        probed = -math.inf
        while True:
            # While a lull is filled, online users' return is looked for four times a
            # probe interval: each tick of delay is batch work they find in their way.
            await asyncio.sleep(self.slo.interval / (4 if self.filling else 1))
            try:
                if await self._lead(redis):
                    probe = time.monotonic() - probed >= self.slo.interval * 0.9
                    if probe:
                        probed = time.monotonic()
                    await self._tick(redis, probe=probe)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # Redis or the server gone: the next tick tries again
                log.warning("remote %s: SLO tick failed (%s)", self.engine.base_url, e)

    async def _lead(self, redis: Any) -> bool:
        """Whether this engine is the server's prober (taking the lock when free)."""
        ttl = int(self.slo.interval * 3000)
        if await redis.set(self.lock_key, self.me, nx=True, px=ttl):
            return True
        holder = await redis.get(self.lock_key)
        if holder is not None and holder.decode() == self.me:
            await redis.pexpire(self.lock_key, ttl)
            return True
        return False

    async def _first_alone(self, redis: Any) -> None:
        """Where no time alone is known: a few probes before the first batch request (one
        after another), so the SLO has its room below it (and a multiple its base)."""
        if await redis.llen(self.alone_key) >= ALONE_FIRST:
            return
        for _ in range(ALONE_FIRST * 2):
            if await redis.zcard(self.engine._leases_key) > 0:
                return  # another worker's batch is running: alone is not to be had now
            got = await self.probe()
            if got is not None:
                await self._keep(redis, Sample(time.time(), got[0], got[1], 0))
                if await redis.llen(self.alone_key) >= ALONE_FIRST:
                    return

    async def _keep(self, redis: Any, sample: Sample) -> None:
        pipe = redis.pipeline()
        pipe.lpush(self.samples_key, sample.encode())
        pipe.ltrim(self.samples_key, 0, PROBES_KEPT - 1)
        if sample.ours == 0:
            pipe.lpush(self.alone_key, sample.encode())
            pipe.ltrim(self.alone_key, 0, ALONE_KEPT - 1)
        pipe.hincrby(self.engine._state_key, "probes", 1)
        await pipe.execute()

    async def _scrape(self) -> Scrape | None:
        """vLLM's metrics now; None without them (no metrics_url, not vLLM's page, or it
        did not answer: online users are then taken to be there)."""
        if not self.engine.metrics_url or not self._metrics_ok:
            return None
        try:
            status, raw = await self.engine._get(self.engine.metrics_url,
                                                 self.engine._metrics_auth,
                                                 timeout=httpx.Timeout(5.0))
        except Exception:
            return None
        found = vllm_scrape(raw.decode("utf-8", "replace"), self.engine.model) \
            if status == 200 else None
        if found is None:
            # A page that never was vLLM's is not asked again.
            self._metrics_ok = self._scraped
            return None
        self._scraped = True
        return found

    async def _take_histogram(self, redis: Any, scrape: Scrape, read_at: float,
                              leases: frozenset[bytes]) -> None:
        """The server's TTFT counts since the last tick, and our answers since then taken
        out of the ticks their first tokens came in."""
        h = self._histogram
        if not scrape.edges:
            h.ticks.clear()
            return
        if scrape.edges != h.edges or any(c < last for c, last in
                                          zip(scrape.cumulative, h.last, strict=True)):
            # A first read, another page (new buckets) or a restarted server: a baseline.
            newest = await redis.xrevrange(self.ours_key, count=1)
            self._histogram = Histogram(edges=scrape.edges, last=scrape.cumulative,
                                        begun=read_at,
                                        ours_id=_text(newest[0][0]) if newest else "0-0")
            return
        served = [c - last for c, last in zip(scrape.cumulative, h.last, strict=True)]
        h.last = scrape.cumulative
        h.add(Tick(read_at, [served[0]] + [served[i] - served[i - 1]
                                           for i in range(1, len(served))], leases))
        for entry_id, fields in await redis.xrange(self.ours_key, min=f"({h.ours_id}",
                                                   max="+"):
            h.ours_id = _text(entry_id)
            try:
                h.take_out(float(fields[b"at"]), h.bucket(float(fields[b"s"])))
            except (KeyError, ValueError):
                continue
        while h.ticks and h.ticks[0].at < read_at - BUDGET_SECONDS:
            h.begun = h.ticks.popleft().at

    async def _tick(self, redis: Any, *, probe: bool = True) -> None:
        state_key, leases_key = self.engine._state_key, self.engine._leases_key
        if probe:
            ours = int(await redis.zcard(leases_key))
            got = await self.probe()
            if got is not None:
                await self._keep(redis, Sample(time.time(), got[0], got[1], ours))
        before = await redis.zrange(leases_key, 0, -1)
        scrape = await self._scrape()
        read_at = time.time()
        if self._above_since is not None:
            if self._apart and self._apart[-1][0] == self._above_since:
                self._apart.pop()
            self._apart.append((self._above_since, read_at))
        while self._apart and self._apart[0][1] < read_at - BUDGET_SECONDS:
            self._apart.popleft()
        pipe = redis.pipeline()
        pipe.zrange(leases_key, 0, -1)
        pipe.lrange(self.samples_key, 0, -1)
        pipe.lrange(self.alone_key, 0, -1)
        pipe.hmget(state_key, "limit", "steered_at", "floor", "floor_at", "slo_limit",
                   "fill_cap", "paused_at", "untimed", "tried", "tried_at", "pause_fails")
        after, raw_samples, raw_alone, fields = await pipe.execute()
        now, clock = time.time(), time.monotonic()
        in_flight = len(after)
        # Online requests in the server now: its running and waiting beyond every lease
        # held while it was read (each of ours there holds one from before its POST to
        # after its answer).
        present = scrape is None or \
            scrape.running + scrape.waiting > len(set(before) | set(after))
        if present:
            self._present_at = clock
            if scrape is not None:
                self._seen_at = clock
        online = clock - self._present_at < LULL_SECONDS
        if not online and self._lull is None:
            self._lull = (self._last_at, float(fields[0] or 0))
        elif online and self._lull is not None:
            self._onset, self._lull = self._lull, None
        untimed = int(fields[7] or 0)
        if self._untimed is not None and untimed != self._untimed:
            self._untimed_at = clock
        self._untimed = untimed
        if scrape is not None:
            await self._take_histogram(redis, scrape, read_at,
                                       frozenset(before) | frozenset(after))
        samples = [s for s in map(Sample.decode, raw_samples) if s is not None]
        alone = [s for s in map(Sample.decode, raw_alone) if s is not None]
        ceiling = float(self.engine.ceiling)
        limit = min(float(fields[0] or self.engine.initial), ceiling)
        steered_at = float(fields[1] or 0)
        floor = float(fields[2] or 0) if now - float(fields[3] or 0) \
            < FLOOR_FRESH_SECONDS else 0.0
        # Where the SLO last held with online users there; where it never held, the
        # limit a server not yet seen starts at.
        slo_limit = float(fields[4]) if fields[4] else float(self.engine.initial)
        # Where the SLO holds (one request at least) until lulls show how much more users
        # coming back can meet.
        fill_cap = float(fields[5]) if fields[5] else max(1.0, slo_limit)
        p = self.slo.percentile
        alone_ttft = percentile([s.ttft_ms for s in alone], p) if alone else None
        target = self.slo.ttft_ms
        if target is None and self.slo.factor is not None and alone_ttft:
            target = self.slo.factor * alone_ttft
        self._target_ms = target
        # The measure: the server's histogram where every answer of ours said its time to
        # first token this long; else the probes.
        h = self._histogram
        by_histogram = h.timed and bool(h.ticks) and \
            clock - self._untimed_at >= BUDGET_SECONDS
        self._budget_since = max(self._budget_since, now - BUDGET_SECONDS)
        recent = [s for s in samples if s.at > steered_at and not apart(s.at, self._apart)]
        probes = samples_tail([s.ttft_ms for s in recent], p, target)
        if by_histogram:
            # Read two ways (Histogram): our first tokens possibly not taken out yet spread
            # as our answers' are, for a growth; taken from the top, for a cut.
            held = set(after)
            counts, pending = h.window(steered_at, held, left_out=self._apart)
            tail = histogram_tail(h.edges, without_like(counts, pending, h.ours), p, target)
            low = histogram_tail(h.edges, without_top(counts, pending), p, target)
            counts, pending = h.window(self._budget_since, held)
            budget = histogram_tail(h.edges, without_top(counts, pending), p, target)
        else:
            tail = low = probes
            budget = samples_tail(
                [s.ttft_ms for s in samples if s.at > self._budget_since], p, target)
        itl = percentile([s.itl_ms for s in recent if s.itl_ms is not None], p) \
            if any(s.itl_ms is not None for s in recent) else None
        now_pressure: float | None = None
        cut_pressure: float | None = None
        over = False
        if target is not None and tail.value_ms is not None:
            base = min(alone_ttft or 0, target)
            now_pressure = pressure(tail.value_ms, alone=base, target=target)
            cut_pressure = now_pressure if low.value_ms is None else pressure(
                low.value_ms, alone=base, target=target)
            # The probes stand guard from the client's side (the server's histogram
            # starts at its front end).
            over = low.certain_over(self.slo) or probes.certain_over(self.slo)
            if self.slo.itl_ms is not None and itl is not None:
                alone_itl = [s.itl_ms for s in alone if s.itl_ms is not None]
                base = min(percentile(alone_itl, p), self.slo.itl_ms) if alone_itl else 0.0
                itl_pressure = pressure(itl, alone=base, target=self.slo.itl_ms)
                now_pressure = max(now_pressure, itl_pressure)
                cut_pressure = max(cut_pressure, itl_pressure)
                over = over or samples_tail(
                    [s.itl_ms for s in recent if s.itl_ms is not None], p,
                    self.slo.itl_ms).certain_over(self.slo)
        paused_at = float(fields[6] or 0)
        onset_bad: bool | None = None
        reached = 0.0
        if self._onset is not None and now - self._onset[0] >= ONSET_SECONDS \
                and target is not None:
            came, until = self._onset[0], self._onset[0] + ONSET_SECONDS
            bad = float(sum(s.ttft_ms > target for s in samples if came < s.at <= until))
            if by_histogram:
                counts, pending = h.window(came, set(after), until)
                bad += histogram_tail(h.edges, without_top(counts, pending), p,
                                      target).surely_over
            onset_bad, reached = bad >= 1, self._onset[1]
            self._onset = None
        spent = budget.spent(self.slo)
        moved = next_fill_cap(fill_cap, onset_bad=onset_bad, reached=reached, spent=spent,
                              slo_limit=slo_limit, ceiling=ceiling)
        moved_cap = moved != fill_cap
        if moved_cap:  # each move starts the budget's window afresh
            fill_cap, self._budget_since = moved, now
        quiet = clock - self._seen_at >= QUIET_SECONDS
        # The budget allows a trial growth: under half of it spent. A retry from a pause
        # waits by its own clock instead (pause_retry_wait): the samples past the SLO that
        # caused the pause were answered by it, and the budget starts again there.
        may_try = spent < 0.5
        fails = int(fields[10] or 0)
        tried = float(fields[8]) if fields[8] and now - float(fields[9] or 0) \
            < BUDGET_SECONDS else None
        decision = decide(pressure_now=now_pressure, pressure_cut=cut_pressure, over=over,
                          enough=tail.n >= self.slo.enough, band=self.slo.band, limit=limit,
                          ceiling=ceiling, floor=floor, binding=in_flight + 1 >= int(limit),
                          online=online, slo_limit=slo_limit,
                          fill_cap=None if quiet else fill_cap,
                          draining=in_flight > max(1, int(limit)),
                          retry=bool(paused_at)
                          and now - paused_at >= pause_retry_wait(fails),
                          trial=may_try, tried=tried)
        if self._lull is not None:
            self._lull = (self._lull[0], max(self._lull[1], decision.limit))
        self._last_at = now
        shown: dict[str, Any] = {
            "slo_percentile": p, "online": int(online), "floor_now": floor,
            "slo_ms": "" if target is None else round(target, 1),
            "online_ms": "" if low.value_ms is None else round(low.value_ms, 1),
            "alone_ms": "" if alone_ttft is None else round(alone_ttft, 1),
            "itl_slo_ms": self.slo.itl_ms or "",
            "online_itl_ms": "" if itl is None else round(itl, 1),
            "slo_samples": round(tail.n), "slo_measure": "histogram" if by_histogram
            else "probes", "budget_spent": round(spent, 3), "slo_seen_at": round(now, 3)}
        if moved_cap:
            shown["fill_cap"] = round(fill_cap, 3)
        if decision.cut and limit >= 1:
            # Not grown back to where it was cut from while the budget's window lasts.
            shown["tried"] = round(min(limit, tried if tried is not None else limit), 3)
            shown["tried_at"] = round(now, 3)
        if online and decision.reason != "measuring":
            # Where the SLO holds now: where the limit comes back to when online users
            # return after a lull.
            shown["slo_limit"] = round(decision.limit, 3)
            if decision.limit >= 1:
                shown["paused_at"] = ""
                if fails and limit >= 1 and tail.n >= self.slo.enough and not decision.cut:
                    shown["pause_fails"] = 0  # a full window held: retries are prompt again
            elif slo_limit >= 1 or not paused_at:
                shown["paused_at"] = round(now, 3)  # the SLO's level is now none
                shown["pause_fails"] = fails + 1
                # The pause answers the samples that caused it; what a retry and the
                # trials after it spend is counted from here (not again for minutes).
                self._budget_since = now
        await redis.hset(state_key, mapping={k: str(v) for k, v in shown.items()})
        self.filling = not online and decision.limit > slo_limit
        if not (self.filling or decision.shed):
            self._above_since = None
        elif self._above_since is None:
            self._above_since = now
        if abs(decision.limit - limit) > 1e-6:
            steered = await self.engine._steer(keys=[state_key], args=[
                repr(limit), repr(decision.limit), decision.reason, ceiling,
                repr(window_start(steered_at, now, online=online, decision=decision))])
            if decision.shed and abs(float(steered) - decision.limit) < 1e-6:
                await redis.hset(state_key, "shed_at", repr(now))
        else:
            await redis.hset(state_key, "reason", decision.reason)



def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
