"""Processor settings: one frozen object built by the CLI and read everywhere else."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from pdproc.targets import AllowList, HostPort

DEFAULT_PD_PATHS = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/responses",
    "/inference/v1/generate",
)
MiB = 1024 * 1024


class BootstrapPolicy(Enum):
    """What to do when no prefill can be used for a request (bootstrap failed, pod known down)."""

    REJECT = "reject"  # 502 to the client, as llm-d does
    DECODE_ONLY = "decode-only"  # let the decode pod do the whole request alone


@dataclass(frozen=True)
class Settings:
    listen: str = "0.0.0.0:9002"
    prefill_pool: tuple[HostPort, ...] = ()
    # Names (a headless Service) whose A/AAAA records are pool members, re-resolved.
    prefill_dns: tuple[HostPort, ...] = ()
    dns_refresh_s: float = 10.0
    allow: AllowList = field(default_factory=AllowList)
    pd_paths: frozenset[str] = frozenset(DEFAULT_PD_PATHS)
    bootstrap_port: int = 8998
    bootstrap_timeout_s: float = 5.0
    # Engine ids change when a prefill pod restarts; a bounded lifetime caps how long a stale
    # id can be served even if no prefill fails to tell us.
    engine_cache_ttl_s: float = 60.0
    engine_cache_size: int = 4096
    # Older entries are still used but re-queried in the background, so an id change that
    # no failure revealed (a pod restarted between two requests) is picked up quickly.
    engine_refresh_s: float = 5.0
    prefill_timeout_s: float = 60.0
    # Must not exceed the filter's max_message_timeout, or Envoy ignores our hold request.
    envoy_max_message_timeout_s: float = 300.0
    max_body_bytes: int = 16 * MiB
    on_bootstrap_error: BootstrapPolicy = BootstrapPolicy.REJECT
    breaker_failures: int = 5
    breaker_cooldown_s: float = 10.0  # the longest; the first wait is 1 s
    drain_timeout_s: float = 30.0
    # After SIGTERM, keep serving this long while health checks report NOT_SERVING, so Envoy
    # moves new streams to other replicas before this one refuses them.
    shutdown_delay_s: float = 2.0
    max_prefill_connections: int = 1024
    metrics_listen: str | None = None
    log_bodies: bool = False

    @property
    def grpc_max_message_bytes(self) -> int:
        # Envoy frames the buffered body in one gRPC message. Receive more than we accept, so
        # an oversized body reaches our 413 instead of failing the stream (which Envoy's
        # failure_mode_allow would turn into an unprocessed request).
        return max(self.max_body_bytes + MiB, 64 * MiB)
