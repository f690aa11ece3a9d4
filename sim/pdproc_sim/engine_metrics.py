"""The Prometheus page a vLLM engine serves at /metrics, for the parts the simulator models:
prompt tokens by source, prefix-cache queries and hits, KV cache usage, and the requests
waiting and running, per engine (DP rank), under vLLM's metric names and labels."""

from __future__ import annotations

from pdproc_sim.prefix_cache import SOURCES, EngineCaches


def _sample(name: str, labels: dict[str, str], value: float) -> str:
    text = ",".join(f'{key}="{val}"' for key, val in labels.items())
    return f"{name}{{{text}}} {value:g}"


def render(caches: EngineCaches, model: str) -> str:
    lines: list[str] = []

    def family(name: str, kind: str, help_text: str) -> None:
        lines.append(f"# HELP {name} {help_text}")
        lines.append(f"# TYPE {name} {kind}")

    ranks = range(len(caches.caches))
    family(
        "vllm:prompt_tokens_by_source_total",
        "counter",
        "Number of prompt tokens by source (computed, prefix cache hit, KV transfer).",
    )
    for rank in ranks:
        for source in SOURCES:
            labels = {"engine": str(rank), "model_name": model, "source": source}
            value = caches.tokens_by_source[rank, source]
            lines.append(_sample("vllm:prompt_tokens_by_source_total", labels, value))
    gauges = (
        ("vllm:prefix_cache_queries_total", "counter", "Prompt tokens queried.", caches.queries),
        ("vllm:prefix_cache_hits_total", "counter", "Prompt tokens found cached.", caches.hits),
    )
    for name, kind, help_text, values in gauges:
        family(name, kind, help_text)
        for rank in ranks:
            labels = {"engine": str(rank), "model_name": model}
            lines.append(_sample(name, labels, values[rank]))
    per_rank = (
        (
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            [c.usage for c in caches.caches],
        ),
        ("vllm:num_requests_waiting", "Requests waiting to be processed.", caches.waiting),
        ("vllm:num_requests_running", "Requests in model execution batches.", caches.running),
    )
    for name, help_text, series in per_rank:
        family(name, "gauge", help_text)
        for rank in ranks:
            labels = {"engine": str(rank), "model_name": model}
            lines.append(_sample(name, labels, float(series[rank])))
    return "\n".join(lines) + "\n"
