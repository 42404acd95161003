"""`GET /metrics`: the server's counters in Prometheus' text format (prometheus_client).

    requests (AccessLog) ──> requests_total{route, status}
    each choice's Finish ──> tokens, TTFT, time per output token, drafts
    a scrape ──────────────> queue, running rows, store sizes / evictions (read then)

One registry per server (not prometheus_client's global one), so several
servers in one process (the tests) count apart. Names start `segcache_`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

if TYPE_CHECKING:
    from .engine import Usage

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
TIERS = ("ram", "disk", "remote")
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


class Metrics:
    """The counters of one server; `scrape()` writes them with the state read now.

    Args:
        scheduler: the worker's Scheduler (queue depth, running rows), or None.
        store: the PrefixStore (sizes, entries, evictions by tier), or None.
    """

    def __init__(self, scheduler=None, store=None):
        self.scheduler = scheduler
        self.store = store
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("segcache_requests", "HTTP requests answered, by route and status",
                                ["route", "status"], registry=r)
        self.ttft = Histogram("segcache_time_to_first_token_seconds", "Arrival to first token, per choice",
                              buckets=_TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("segcache_time_per_output_token_seconds",
                              "Seconds per generated token after the first, per choice", buckets=_TPOT_BUCKETS,
                              registry=r)
        self.prompt = Counter("segcache_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.cached = Counter("segcache_cached_tokens", "Prompt tokens resumed from the prefix store, by tier",
                              ["tier"], registry=r)
        self.generated = Counter("segcache_generated_tokens", "Tokens generated", registry=r)
        self.drafted = Counter("segcache_draft_tokens", "Draft tokens proposed, by drafter", ["drafter"], registry=r)
        self.accepted = Counter("segcache_accepted_tokens", "Draft tokens the target accepted, by drafter",
                                ["drafter"], registry=r)
        self._snapshot: dict = {}
        r.register(_State(self))

    def request(self, route: str, status: int) -> None:
        self.requests.labels(route, str(status)).inc()

    def finished(self, usage: "Usage", first: bool, seconds: float) -> None:
        """One choice ended (`first`: the request's choice 0, whose prompt is counted);
        `seconds`: since the request arrived at the HTTP side."""
        if first:
            self.prompt.inc(usage.prompt_tokens)
            if usage.cached_tokens:
                self.cached.labels(tier_label(usage.tier)).inc(usage.cached_tokens)
        self.generated.inc(usage.completion_tokens)
        if usage.completion_tokens:
            self.ttft.observe(usage.ttft)
        if usage.completion_tokens > 1:
            self.tpot.observe(max(0.0, seconds - usage.ttft) / (usage.completion_tokens - 1))
        if usage.drafter != "plain":
            self.drafted.labels(usage.drafter).inc(usage.drafted)
            self.accepted.labels(usage.drafter).inc(usage.accepted)

    def read_state(self) -> None:
        """Read the store's sizes (it takes the store's lock: call off the event loop)."""
        store = self.store
        self._snapshot = store.stats() if store is not None and not store.closed else {}

    def scrape(self) -> bytes:
        """The text format, with the state `read_state` read last."""
        return generate_latest(self.registry)


def tier_label(tier: str) -> str:
    """A Usage tier as one label: "ram+disk" counts as "disk" (the slowest tier it needed)."""
    parts = tier.split("+")
    for t in reversed(TIERS):
        if t in parts:
            return t
    return tier


def cached_by_tier(usage: "Usage") -> dict:
    """The cached tokens under their tier's label ({} when none)."""
    return {tier_label(usage.tier): usage.cached_tokens} if usage.cached_tokens else {}


class _State:
    """The gauges read at scrape time: queue, rows, the store's tiers."""

    def __init__(self, metrics: Metrics):
        self.metrics = metrics

    def describe(self):
        return []

    def collect(self):
        m = self.metrics
        queue = GaugeMetricFamily("segcache_queue_depth", "Requests waiting to be admitted")
        rows = GaugeMetricFamily("segcache_running_rows", "Rows decoding or prefilling now")
        s = m.scheduler
        if s is not None:
            queue.add_metric([], len(s.waiting))
            rows.add_metric([], sum(job.request.n for job in list(s.running)))
        yield queue
        yield rows
        st: Optional[dict] = m._snapshot
        size = GaugeMetricFamily("segcache_store_bytes", "Prefix store bytes held, by tier", labels=["tier"])
        entries = GaugeMetricFamily("segcache_store_entries", "Prefix store records held, by tier",
                                    labels=["tier"])
        evictions = CounterMetricFamily("segcache_store_evictions", "Records evicted, by tier", labels=["tier"])
        for tier in ("ram", "disk"):
            if st:
                size.add_metric([tier], st.get(f"{tier}_bytes", 0))
                entries.add_metric([tier], st.get(f"{tier}_entries", 0))
                evictions.add_metric([tier], st.get(f"{tier}_evictions", 0))
        yield size
        yield entries
        yield evictions
