"""Bounds on what connections to pdproc's own listeners may hold, and the descriptor
limit they are checked against at start, so pdproc running out of descriptors is seen at
start, never blamed on a pod.

Every connection holds a file descriptor. Without bounds, half-open connections (a request
head never finished on the metrics port, a TCP connection that never starts its HTTP/2 or
TLS handshake on the gRPC port) pile up until pdproc cannot open a socket to a prefill
pod any more. So:

- the gRPC listener drops a connection whose handshake (TLS and HTTP/2 settings) has not
  completed in GRPC_HANDSHAKE_TIMEOUT_S, accepts at most GRPC_MAX_CONNECTIONS at once, and
  pings idle peers so a vanished Envoy's connections end too;
- the metrics/health listener closes every connection HTTP_CONNECTION_LIFETIME_S after it
  opened, once its current request is answered (so a request head never finished is
  dropped then), idle ones after HTTP_IDLE_TIMEOUT_S, and keeps at most
  HTTP_MAX_CONNECTIONS open (a new one beyond them closes the oldest);
- at start, the soft RLIMIT_NOFILE is raised to the hard limit, and checked against what
  the settings can hold open at once (`needed_descriptors`): below it pdproc warns, below
  MIN_DESCRIPTORS it refuses to start.

Envoy opens a few long-lived HTTP/2 connections per worker thread to each pdproc, and a
scraper one or two: the bounds are far above honest use.
"""

from __future__ import annotations

import resource
from dataclasses import dataclass

GRPC_HANDSHAKE_TIMEOUT_S = 10.0
GRPC_MAX_CONNECTIONS = 512
GRPC_KEEPALIVE_TIME_S = 60.0
GRPC_KEEPALIVE_TIMEOUT_S = 20.0
HTTP_IDLE_TIMEOUT_S = 10.0
HTTP_CONNECTION_LIFETIME_S = 10.0
HTTP_MAX_CONNECTIONS = 128
# Log files, the event loop's own descriptors, DNS, the trace exporter, worker pipes.
RESERVE_DESCRIPTORS = 64
# Below this pdproc would run out at the first burst: refuse to start.
MIN_DESCRIPTORS = 256


def grpc_options() -> list[tuple[str, int]]:
    """gRPC server options that bound the listener (see the module's docstring)."""
    return [
        ("grpc.server_handshake_timeout_ms", int(GRPC_HANDSHAKE_TIMEOUT_S * 1000)),
        ("grpc.max_allowed_incoming_connections", GRPC_MAX_CONNECTIONS),
        ("grpc.keepalive_time_ms", int(GRPC_KEEPALIVE_TIME_S * 1000)),
        ("grpc.keepalive_timeout_ms", int(GRPC_KEEPALIVE_TIMEOUT_S * 1000)),
    ]


def needed_descriptors(max_prefill_connections: int, metrics_listener: bool) -> int:
    """Descriptors one pdproc process can hold open at once, at every bound."""
    http = HTTP_MAX_CONNECTIONS + 1 if metrics_listener else 0
    return max_prefill_connections + GRPC_MAX_CONNECTIONS + 1 + http + RESERVE_DESCRIPTORS


class TooFewDescriptors(Exception):
    """The descriptor limit is too low to run at all."""


@dataclass(frozen=True, slots=True)
class DescriptorPlan:
    soft: int  # the soft limit to set (the hard one, or as high as allowed)
    warning: str | None  # below what the settings can use
    refusal: str | None  # too low to start


def plan_descriptors(soft: int, hard: int, needed: int) -> DescriptorPlan:
    """Pure: what to do with the limits (soft, hard) given what the settings need."""
    unlimited = resource.RLIM_INFINITY
    target = hard if hard != unlimited else max(soft, needed) if soft != unlimited else soft
    usable = target if target != unlimited else needed
    if usable < MIN_DESCRIPTORS:
        return DescriptorPlan(
            target,
            None,
            f"the open-file limit is {usable} (hard limit {hard}); pdproc needs at least "
            f"{MIN_DESCRIPTORS} and can use {needed} with these settings: raise it "
            "(ulimit -n, systemd LimitNOFILE, the container runtime's nofile)",
        )
    if usable < needed:
        return DescriptorPlan(
            target,
            f"the open-file limit is {usable}, below the {needed} descriptors these settings "
            "can hold open at once (--max-prefill-connections plus the listeners' bounds): "
            "under load, prefill connects may fail with 'Too many open files' (counted "
            "`exhausted`, never against a pod); raise the limit or lower "
            "--max-prefill-connections",
            None,
        )
    return DescriptorPlan(target, None, None)


def apply_descriptor_limit(needed: int) -> DescriptorPlan:
    """Raise the soft RLIMIT_NOFILE to the hard one; the plan says whether to warn or
    refuse (the caller logs and acts)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    plan = plan_descriptors(soft, hard, needed)
    if plan.soft != soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (plan.soft, hard))
        except (ValueError, OSError):
            return plan_descriptors(soft, soft, needed)  # keep what we have, judged as is
    return plan
