"""The router's counters, gauges and the migration-pause histogram, written in Prometheus' text format.

Plain Python under one lock: the router updates them from its event loop
and ``/metrics`` reads them there too, so no client library is needed.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Iterable, Sequence

__all__ = ["Histogram", "Metrics", "PAUSE_BUCKETS_S", "RELAY_BUCKETS_S"]

#: Migration pauses (seconds) worth telling apart: a decode step of a small model to a recompute of 16k tokens.
PAUSE_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
#: A streamed token's time in the router (read from the backend to handed to the HTTP server), in seconds.
RELAY_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25)


class Histogram:
    """A histogram as Prometheus keeps one: cumulative bucket counts (``counts``), a sum and a count.

    Each observation increments one bucket (found by bisection: the relay
    histogram counts every streamed token); the cumulative counts are summed
    when read.
    """

    def __init__(self, buckets: Sequence[float]) -> None:
        self.buckets = tuple(sorted(buckets))
        self._hits = [0] * (len(self.buckets) + 1)  # per bucket, not cumulative; the last one is +Inf's
        self.total = 0.0
        self.count = 0

    @classmethod
    def from_cumulative(cls, buckets: Sequence[float], counts: Sequence[int], count: int) -> Histogram:
        """A histogram from Prometheus' cumulative bucket counts (in ``buckets``' order) and its total count."""
        h = cls(buckets)
        below = 0
        for i, n in enumerate(counts):
            h._hits[i] = n - below
            below = n
        h._hits[-1] = count - below
        h.count = count
        return h

    @property
    def counts(self) -> list[int]:
        """The cumulative count of each bucket (observations ``<=`` its edge)."""
        out, running = [], 0
        for n in self._hits[:-1]:
            running += n
            out.append(running)
        return out

    def observe(self, value: float) -> None:
        """Count one observation."""
        # NaN belongs to no finite bucket (bisect would put it in the first): +Inf's alone, as Prometheus counts it.
        i = bisect.bisect_left(self.buckets, value) if value == value else len(self.buckets)
        self._hits[i] += 1
        self.total += value
        self.count += 1

    def quantile(self, q: float) -> float | None:
        """The ``q`` quantile, interpolated within its bucket as Prometheus' ``histogram_quantile`` does."""
        if not self.count:
            return None
        rank, below, lower = q * self.count, 0, 0.0
        for edge, n in zip(self.buckets, self.counts):
            if n >= rank:
                return lower + (edge - lower) * (rank - below) / max(n - below, 1)
            below, lower = n, edge
        return self.buckets[-1]

    def lines(self, name: str) -> Iterable[str]:
        """The histogram's sample lines."""
        for edge, n in zip(self.buckets, self.counts):
            yield f'{name}_bucket{{le="{edge}"}} {n}'
        yield f'{name}_bucket{{le="+Inf"}} {self.count}'
        yield f"{name}_sum {self.total:.6f}"
        yield f"{name}_count {self.count}"


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class Metrics:
    """What ``GET /metrics`` reports.

    Attributes:
        requests: requests routed, per backend URL (first leg only).
        migrations: migrations by result (``ok``, ``failed``).
        failovers: requests continued elsewhere after their backend failed.
        pauses: the client-visible pause of each migration (the source's last
            token, from when the client's side took it, to the destination's
            first, when it was read), in seconds.
        relay: each streamed event's time in the router (read from its
            backend, or from when its client took the event before if that
            was later, to handed to the HTTP server), in seconds: the latency
            the router adds to every token, without the time a client that
            reads slowly keeps it waiting.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: dict[str, int] = {}
        self.migrations: dict[str, int] = {"ok": 0, "failed": 0}
        self.failovers = 0
        self.pauses = Histogram(PAUSE_BUCKETS_S)
        self.relay = Histogram(RELAY_BUCKETS_S)

    def routed(self, backend: str) -> None:
        """Count a request sent to ``backend``."""
        with self._lock:
            self.requests[backend] = self.requests.get(backend, 0) + 1

    def migrated(self, ok: bool, pause_s: float | None = None) -> None:
        """Count a migration, and its pause when it succeeded."""
        with self._lock:
            self.migrations["ok" if ok else "failed"] += 1
            if ok and pause_s is not None:
                self.pauses.observe(pause_s)

    def relayed(self, seconds: float) -> None:
        """Count one streamed event's time in the router."""
        with self._lock:
            self.relay.observe(seconds)

    def failed_over(self) -> None:
        """Count a request continued on another backend after its own failed."""
        with self._lock:
            self.failovers += 1

    def render(self, in_flight: dict[str, int], healthy: dict[str, bool], draining: dict[str, bool]) -> str:
        """The Prometheus text exposition (format 0.0.4) of every metric, with the backends' current state."""
        with self._lock:
            out = [
                "# HELP hurray_router_in_flight Requests in flight, per backend.",
                "# TYPE hurray_router_in_flight gauge",
                *(f'hurray_router_in_flight{{backend="{_label(b)}"}} {n}' for b, n in in_flight.items()),
                "# HELP hurray_router_backend_up Whether the backend passes its health checks (1) or not (0).",
                "# TYPE hurray_router_backend_up gauge",
                *(f'hurray_router_backend_up{{backend="{_label(b)}"}} {int(ok)}' for b, ok in healthy.items()),
                "# HELP hurray_router_backend_draining Whether the backend is drained (1): it gets no new requests.",
                "# TYPE hurray_router_backend_draining gauge",
                *(f'hurray_router_backend_draining{{backend="{_label(b)}"}} {int(d)}' for b, d in draining.items()),
                "# HELP hurray_router_requests_total Requests routed, per backend of their first leg.",
                "# TYPE hurray_router_requests_total counter",
                *(f'hurray_router_requests_total{{backend="{_label(b)}"}} {n}' for b, n in self.requests.items()),
                "# HELP hurray_router_migrations_total Live migrations, by result.",
                "# TYPE hurray_router_migrations_total counter",
                *(f'hurray_router_migrations_total{{result="{r}"}} {n}' for r, n in self.migrations.items()),
                "# HELP hurray_router_failovers_total Requests continued on another backend after theirs failed.",
                "# TYPE hurray_router_failovers_total counter",
                f"hurray_router_failovers_total {self.failovers}",
                "# HELP hurray_router_migration_pause_seconds The source's last token to the destination's first.",
                "# TYPE hurray_router_migration_pause_seconds histogram",
                *self.pauses.lines("hurray_router_migration_pause_seconds"),
                "# HELP hurray_router_relay_seconds A streamed event's time in the router, backend to client.",
                "# TYPE hurray_router_relay_seconds histogram",
                *self.relay.lines("hurray_router_relay_seconds"),
            ]
        return "\n".join(out) + "\n"
