"""GET /metrics in Prometheus' text format: queue depth, batch sizes, latency, images served,
errors by status. Each server (each Ray Serve replica) has its own registry, so two servers in one
process never share counts; on Ray Serve a scrape reads the replica that answered it."""

from __future__ import annotations

PREFIX = "kasoku_serve"
# Seconds from a request's arrival to its answer: tiny models answer in tens of milliseconds,
# full-size ones on a CPU in minutes.
LATENCY_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, float("inf"))


class Metrics:
    def __init__(self, max_batch: int):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        reg = dict(registry=self.registry)
        self.queue_depth = Gauge(f"{PREFIX}_queue_depth", "Images waiting for an engine call", **reg)
        self.running = Gauge(f"{PREFIX}_running_images", "Images in the engine call now running", **reg)
        self.ready = Gauge(f"{PREFIX}_ready", "1 once the engines are loaded", **reg)
        self.batch_size = Histogram(f"{PREFIX}_batch_size", "Images per engine call",
                                    buckets=tuple(range(1, max_batch + 1)) + (float("inf"),), **reg)
        self.call_seconds = Histogram(f"{PREFIX}_call_seconds", "Seconds per engine call", buckets=LATENCY_BUCKETS,
                                      **reg)
        self.latency = Histogram(f"{PREFIX}_request_seconds", "Seconds from a request's arrival to its answer, "
                                 "answered requests", ["endpoint"], buckets=LATENCY_BUCKETS, **reg)
        self.images = Counter(f"{PREFIX}_images", "Images served", **reg)
        self.requests = Counter(f"{PREFIX}_requests", "Requests answered, by endpoint and HTTP status",
                                ["endpoint", "status"], **reg)
        self.errors = Counter(f"{PREFIX}_errors", "Error answers (status >= 400), by HTTP status", ["status"], **reg)

    def call(self, size: int, seconds: float) -> None:
        self.batch_size.observe(size)
        self.call_seconds.observe(seconds)

    def answered(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint=endpoint, status=str(status)).inc()
        if status >= 400:
            self.errors.labels(status=str(status)).inc()

    def render(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST


__all__ = ["LATENCY_BUCKETS", "Metrics"]
