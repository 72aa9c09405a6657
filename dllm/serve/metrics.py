"""The server's Prometheus metrics (prometheus-client), one registry per app.

Requests by endpoint and status (499: the client went away), queue depth and running lanes (read from the engine
when scraped), generated tokens, model calls, and per choice tokens per model call and acceptance; latency and time
to first token (the first final text of a stream; a whole answer's latency otherwise) as histograms; the engine's
batches and the lane calls they carried.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

_SECONDS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Metrics:
    def __init__(self):
        self.registry = registry = CollectorRegistry()
        self.requests = Counter("dllm_requests", "Requests by endpoint and HTTP status", ["endpoint", "status"],
                                registry=registry)
        self.queue_depth = Gauge("dllm_queue_depth", "Lanes waiting for a place", registry=registry)
        self.running = Gauge("dllm_running_rows", "Lanes decoding (one per choice)", registry=registry)
        self.batches = Gauge("dllm_engine_batches", "Engine steps so far (one batch of model calls each)",
                             registry=registry)
        self.calls = Gauge("dllm_engine_lane_calls", "Lane model calls answered by the engine so far",
                           registry=registry)
        self.tokens = Counter("dllm_generated_tokens", "Completion tokens returned", registry=registry)
        self.model_calls = Counter("dllm_model_calls", "Model calls of finished choices", registry=registry)
        self.tokens_per_call = Histogram("dllm_tokens_per_call", "Generated tokens per model call, per choice",
                                         buckets=(0.5, 1, 1.5, 2, 3, 4, 6, 8, 12, 16), registry=registry)
        self.acceptance = Histogram("dllm_acceptance_rate", "Accepted / drafted tokens, per choice of a "
                                    "speculative sampler", buckets=(0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0),
                                    registry=registry)
        self.latency = Histogram("dllm_request_latency_seconds", "Request latency", buckets=_SECONDS,
                                 registry=registry)
        self.first_token = Histogram("dllm_time_to_first_token_seconds", "Time to the first final text",
                                     buckets=_SECONDS, registry=registry)

    def watch(self, engine) -> None:
        """Read the engine's gauges when scraped."""
        self.queue_depth.set_function(lambda: engine.queued)
        self.running.set_function(lambda: engine.active)
        self.batches.set_function(lambda: engine.counts.batches)
        self.calls.set_function(lambda: engine.counts.calls)

    def finished(self, job, outcomes, started: float, first_token: float | None) -> None:
        now = time.monotonic()
        self.requests.labels(job.endpoint, "200").inc()
        self.latency.observe(now - started)
        self.first_token.observe((first_token or now) - started)
        for outcome in outcomes:
            self.tokens.inc(outcome.completion_tokens)
            stats = outcome.stats
            if stats.get("model_calls"):
                self.model_calls.inc(stats["model_calls"])
            if stats.get("tokens_per_call") is not None:
                self.tokens_per_call.observe(stats["tokens_per_call"])
            if stats.get("acceptance_rate") is not None:
                self.acceptance.observe(stats["acceptance_rate"])

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
