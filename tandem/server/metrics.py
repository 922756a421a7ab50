"""The engine's figures in the Prometheus text exposition format (version 0.0.4)."""

from __future__ import annotations

from typing import Any

# executor stats key -> (metric name, help)
EXECUTOR_METRICS = {
    "collective_seconds": (
        "tandem_collective_seconds_total",
        "Seconds spent in collectives (all-reduce and friends) across steps.",
    ),
    "wire_bytes": ("tandem_wire_bytes_total", "Bytes sent on the wire by the head's communicator."),
    "collectives": ("tandem_collectives_total", "Collective operations run."),
    "stage_seconds": (
        "tandem_stage_transfer_seconds_total",
        "Seconds moving pipeline activations.",
    ),
    "group_failures": ("tandem_group_failures_total", "Groups that lost a rank (failures)."),
    "group_reforms": ("tandem_group_reforms_total", "Groups formed again after a failure."),
    "group_reform_attempts_failed": (
        "tandem_group_reform_attempts_failed_total",
        "Attempts to re-form a group that failed (retried until the deadline).",
    ),
    "group_shrinks": (
        "tandem_group_shrinks_total",
        "Groups re-planned over fewer ranks after a lost rank did not come back.",
    ),
}


def _histogram(name: str, help_: str, h: dict[str, Any]) -> list[str]:
    """`h` is `Histogram.snapshot()`: cumulative bucket counts, sum, count."""
    lines = [f"# HELP {name} {help_}", f"# TYPE {name} histogram"]
    for bound, count in h["buckets"]:
        lines.append(f'{name}_bucket{{le="{bound}"}} {count}')
    lines.append(f'{name}_bucket{{le="+Inf"}} {h["count"]}')
    lines.append(f"{name}_sum {h['sum']:.6f}")
    lines.append(f"{name}_count {h['count']}")
    return lines


def _single(name: str, kind: str, help_: str, value: float) -> list[str]:
    return [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{name} {value}"]


# PrefixCache.stats() key -> (metric name, type, help)
PREFIX_CACHE_METRICS = {
    "hits": (
        "tandem_prefix_cache_hits_total",
        "counter",
        "Requests that continued or copied a cached sequence (prefilled only the rest of "
        "their prompt).",
    ),
    "misses": (
        "tandem_prefix_cache_misses_total",
        "counter",
        "Requests that found no kept sequence sharing enough of their prompt.",
    ),
    "reused_tokens": (
        "tandem_prefix_cache_cached_tokens_total",
        "counter",
        "Prompt tokens taken from the prefix cache (continued or copied) instead of prefilled.",
    ),
    "copies": (
        "tandem_prefix_cache_copies_total",
        "counter",
        "Hits served by copying a shared prefix (another request's KV cache) into a fresh slot.",
    ),
    "evictions": (
        "tandem_prefix_cache_evictions_total",
        "counter",
        "Kept sequences released for a request that needed their slot.",
    ),
    "entries": ("tandem_prefix_cache_entries", "gauge", "Finished sequences kept for reuse."),
    "held_tokens": (
        "tandem_prefix_cache_held_tokens",
        "gauge",
        "Tokens whose KV cache the kept sequences hold.",
    ),
    "held_blocks": (
        "tandem_prefix_cache_blocks",
        "gauge",
        "KV cache blocks the indexed sequences (kept and running) hold, a shared block once.",
    ),
    "cache_bytes": (
        "tandem_prefix_cache_bytes",
        "gauge",
        "Bytes of the KV blocks only kept sequences hold (what --cache-mem bounds).",
    ),
}


def _prefix_cache(stats: dict[str, int] | None) -> list[str]:
    """The prefix cache's series; none when it is off."""
    lines: list[str] = []
    for key, (name, kind, help_) in PREFIX_CACHE_METRICS.items():
        if stats is not None and key in stats:
            lines += _single(name, kind, help_, stats[key])
    return lines


def render_metrics(
    m: dict[str, Any], healthy: bool, http_requests: dict[tuple[str, int], int]
) -> str:
    """`m` is `ServingEngine.metrics()`; `http_requests` counts (path, status) pairs."""
    lines = [
        "# HELP tandem_http_requests_total HTTP requests by path and status code.",
        "# TYPE tandem_http_requests_total counter",
    ]
    for (path, status), n in sorted(http_requests.items()):
        lines.append(f'tandem_http_requests_total{{path="{path}",status="{status}"}} {n}')
    lines += [
        "# HELP tandem_requests_total Generations finished, by reason.",
        "# TYPE tandem_requests_total counter",
    ]
    for reason, n in sorted(m["requests_finished"].items()):
        lines.append(f'tandem_requests_total{{finish_reason="{reason}"}} {n}')
    lines += _single(
        "tandem_prompt_tokens_total", "counter", "Prompt tokens admitted.", m["prompt_tokens"]
    )
    lines += _single(
        "tandem_generation_tokens_total", "counter", "Tokens generated.", m["generated_tokens"]
    )
    lines += _single("tandem_steps_total", "counter", "Batched forward steps run.", m["steps"])
    lines += _single(
        "tandem_step_seconds_total", "counter", "Seconds inside forward steps.", m["step_seconds"]
    )
    lines += _single(
        "tandem_replayed_sequences_total",
        "counter",
        "Sequences prefilled again from their tokens after their group re-formed.",
        m.get("replayed_sequences", 0),
    )
    lines += _prefix_cache(m.get("prefix_cache"))
    lines += _single("tandem_requests_running", "gauge", "Requests in the batch.", m["running"])
    lines += _single("tandem_requests_waiting", "gauge", "Requests queued.", m["waiting"])
    lines += _single("tandem_healthy", "gauge", "1 when the cluster is whole.", int(healthy))
    lines += _histogram("tandem_time_to_first_token_seconds", "Time to first token.", m["ttft"])
    lines += _histogram(
        "tandem_decode_step_seconds",
        "Latency of decode-only steps (one token per running request).",
        m["decode_latency"],
    )
    for key, value in sorted(m["executor"].items()):
        name, help_ = EXECUTOR_METRICS.get(
            key, (f"tandem_executor_{key}", f"Executor figure {key}.")
        )
        if isinstance(value, int | float):
            lines += _single(name, "counter", help_, value)
    return "\n".join(lines) + "\n"
