"""``GET /metrics``: the runtime's statistics (``rt.stats()``) in Prometheus text format 0.0.4.

Counters end in ``_total``; TTFT and queue wait are histograms in seconds
(the runtime keeps them in milliseconds with fixed buckets); batch size,
queues, KV pools and memory are gauges. ``kvmem_http_requests_total`` counts
the gateway's responses by route, method and status.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import TYPE_CHECKING

from actors.metrics import HistogramSnapshot

if TYPE_CHECKING:
    from actors.supervisor import RuntimeStats

__all__ = ["render_metrics", "CONTENT_TYPE"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items()) + "}"


def _number(value: float) -> str:
    if value == math.inf:
        return "+Inf"
    if float(value).is_integer():
        return str(int(value))
    return repr(float(value))


class _Writer:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def family(self, name: str, kind: str, help_text: str) -> None:
        self.lines.append(f"# HELP {name} {help_text}")
        self.lines.append(f"# TYPE {name} {kind}")

    def sample(self, name: str, value: float, labels: dict[str, str] | None = None) -> None:
        self.lines.append(f"{name}{_labels(labels or {})} {_number(value)}")

    def metric(self, name: str, kind: str, help_text: str, value: float) -> None:
        self.family(name, kind, help_text)
        self.sample(name, value)

    def histogram_ms(self, name: str, help_text: str, hist: HistogramSnapshot) -> None:
        """A millisecond histogram as a Prometheus histogram in seconds."""
        self.family(name, "histogram", help_text)
        for bound, count in zip(hist.buckets, hist.counts, strict=True):
            le = "+Inf" if bound == math.inf else _number(bound / 1000.0)
            self.sample(f"{name}_bucket", count, {"le": le})
        self.sample(f"{name}_sum", hist.sum / 1000.0)
        self.sample(f"{name}_count", hist.count)


def render_metrics(stats: RuntimeStats, http_requests: Counter[tuple[str, str, int]]) -> str:
    """The exposition text for ``stats`` and the gateway's response counters."""
    w = _Writer()
    m, gpu, store, reg = stats.metrics, stats.gpu, stats.store, stats.registry

    w.family("kvmem_http_requests_total", "counter", "HTTP responses by route, method and status.")
    for (route, method, status), n in sorted(http_requests.items()):
        w.sample("kvmem_http_requests_total", n, {"route": route, "method": method, "status": str(status)})

    w.metric("kvmem_requests_total", "counter", "Turns handed to agents.", m.requests)
    w.metric("kvmem_requests_completed_total", "counter", "Turns that ran to the end.", m.completed)
    w.metric("kvmem_requests_cancelled_total", "counter", "Turns cancelled because their client left.", m.cancelled)
    w.metric("kvmem_requests_failed_total", "counter", "Turns that failed.", m.failed)
    w.metric("kvmem_tokens_reused_total", "counter", "Prompt tokens served from a KV cache.", m.tokens_reused)
    w.metric("kvmem_tokens_prefilled_total", "counter", "Prompt tokens run through the model.", m.tokens_prefilled)
    w.metric("kvmem_tokens_generated_total", "counter", "Tokens generated.", m.tokens_generated)
    w.family("kvmem_cache_hits_total", "counter", "Turns by where their starting cache came from (cold: none).")
    for tier in ("hot", "warm", "remote", "shared", "cold"):
        w.sample("kvmem_cache_hits_total", m.hits.get(tier, 0), {"tier": tier})
    w.histogram_ms("kvmem_ttft_seconds", "Time from submission to the first token.", m.ttft_ms)
    w.histogram_ms("kvmem_queue_wait_seconds", "Time from submission until the GPU admitted the turn.",
                   m.queue_wait_ms)

    w.metric("kvmem_batch_size", "gauge", "Sequences in the decode batch.", gpu.batch_size)
    w.metric("kvmem_prefilling", "gauge", "Sequences being prefilled.", gpu.prefilling)
    w.metric("kvmem_waiting", "gauge", "Turns waiting for admission.", gpu.waiting)
    w.metric("kvmem_waiting_for_memory", "gauge", "Turns waiting for KV memory.", gpu.waiting_for_memory)
    w.metric("kvmem_decode_steps_total", "counter", "Decode steps of the batch.", gpu.steps)
    w.metric("kvmem_prefill_chunks_total", "counter", "Prefill chunks run.", gpu.prefill_chunks)
    w.metric("kvmem_kv_budget_bytes", "gauge", "KV memory budget for running sequences.", gpu.pool.budget_bytes)
    w.metric("kvmem_kv_blocks_total", "gauge", "256-token blocks the KV budget holds.", gpu.pool.total_blocks)
    w.metric("kvmem_kv_blocks_used", "gauge", "Blocks held by running sequences.", gpu.pool.used_blocks)
    w.metric("kvmem_memory_active_bytes", "gauge", "Accelerator memory in use.", gpu.memory.active)
    w.metric("kvmem_memory_peak_bytes", "gauge", "Peak accelerator memory since the model loaded.", gpu.memory.peak)
    w.metric("kvmem_model_bytes", "gauge", "Bytes of the loaded model's weights.", gpu.memory.model)

    w.metric("kvmem_agents_live", "gauge", "Agent actors running.", stats.agents)
    w.metric("kvmem_hot_agents", "gauge", "Agents with a cache in the hot tier (RAM).", store.hot_agents)
    w.metric("kvmem_hot_cache_bytes", "gauge", "Bytes of the caches in the hot tier.", store.hot_bytes)
    w.metric("kvmem_dirty_caches", "gauge", "Hot caches not yet written to disk.", store.dirty)
    w.metric("kvmem_cache_writes_total", "counter", "Cache saves to disk.", store.writes)
    w.metric("kvmem_cache_write_errors_total", "counter", "Cache saves that failed.", store.write_errors)
    w.metric("kvmem_cache_bytes_written_total", "counter", "Bytes written to the cache directory.",
             store.bytes_written)
    w.metric("kvmem_cache_warm_loads_total", "counter", "Caches loaded from disk.", store.warm_loads)
    w.metric("kvmem_cache_misses_total", "counter", "Cache lookups that found nothing usable.", store.misses)
    w.metric("kvmem_cache_demotions_total", "counter", "Hot caches dropped to the warm tier.", store.demotions)
    w.metric("kvmem_cache_prefetched_total", "counter", "Caches read ahead from disk at start.", store.prefetched)
    w.metric("kvmem_cache_prefetch_hits_total", "counter", "Turns that took a cache read ahead at start.",
             store.prefetch_hits)
    w.metric("kvmem_cache_prefetch_held_bytes", "gauge", "Bytes of caches read ahead and not yet taken.",
             store.prefetch_held_bytes)

    if (remote := store.remote) is not None:
        w.family("kvmem_remote_up", "gauge", "Whether the shared tier (Redis) answered its last call (0: degraded).")
        w.sample("kvmem_remote_up", int(remote.up), {"url": remote.url})
        w.metric("kvmem_remote_pulls_total", "counter", "Caches brought from Redis onto this disk.", remote.pulls)
        w.metric("kvmem_remote_publishes_total", "counter", "Caches published to Redis.", remote.publishes)
        w.metric("kvmem_remote_stale_publishes_total", "counter",
                 "Publishes refused because a newer lease holder had published.", remote.stale_publishes)
        w.metric("kvmem_remote_unpublished", "gauge", "Caches saved while Redis was down, not yet published.",
                 remote.unpublished)
        w.metric("kvmem_remote_corrupt_total", "counter", "Caches in Redis that failed verification.",
                 remote.corrupt)
        w.metric("kvmem_remote_errors_total", "counter", "Redis calls that failed.", remote.errors)
        w.metric("kvmem_remote_bytes_sent_total", "counter", "Bytes sent to Redis.", remote.bytes_sent)
        w.metric("kvmem_remote_bytes_received_total", "counter", "Bytes received from Redis.",
                 remote.bytes_received)

    w.metric("kvmem_model_loads_total", "counter", "Model loads.", reg.loads)
    w.metric("kvmem_model_swaps_total", "counter", "Model swaps.", reg.swaps)
    w.family("kvmem_model_info", "gauge", "The loaded model (1) and its cache tag.")
    if reg.model is not None:
        w.sample("kvmem_model_info", 1, {"model": reg.model, "tag": reg.model_tag or ""})
    return "\n".join(w.lines) + "\n"
