"""Process wiring: the gRPC server (ext_proc + health), the metrics/health HTTP endpoint,
and graceful shutdown."""

from __future__ import annotations

import asyncio
import gc
import logging
import signal

import aiohttp
import grpc
from aiohttp import web
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import CONTENT_TYPE_LATEST

from pdproc.bootstrap import EngineMaps
from pdproc.breaker import CircuitBreakers
from pdproc.config import Settings
from pdproc.discovery import DnsPool
from pdproc.extproc import ExtProcService, Processor
from pdproc.metrics import Metrics
from pdproc.prefill import PrefillLauncher
from pdproc.targets import HostPort
from pdproc.telemetry import Tracing

log = logging.getLogger(__name__)

EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"


class ProcessorServer:
    """One pdproc instance: start(), then stop() (or serve_forever() for the CLI)."""

    def __init__(
        self,
        settings: Settings,
        metrics: Metrics | None = None,
        tracer_provider: TracerProvider | None = None,
    ) -> None:
        self.settings = settings
        self.metrics = metrics or Metrics()
        self._tracer_provider = tracer_provider
        self.tracing = Tracing(tracer_provider)
        self.port = 0
        self.metrics_port = 0
        self.draining = False
        self._server: grpc.aio.Server | None = None
        self._health = health.aio.HealthServicer()
        self._client: aiohttp.ClientSession | None = None
        self._web: web.AppRunner | None = None
        self.processor: Processor | None = None
        self._dns: DnsPool | None = None

    async def start(self) -> None:
        s = self.settings
        # One pooled client for bootstrap queries and prefills (aiohttp rather than httpx:
        # a third of the CPU per request, measured with py-spy on the benchmark).
        self._client = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(
                limit=s.max_prefill_connections, limit_per_host=0, keepalive_timeout=60
            ),
            # Pod-to-pod traffic: never route it through an HTTP(S)_PROXY from the environment.
            trust_env=False,
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=5.0),
            # The prefill answer is only checked: no need to decompress anything.
            auto_decompress=False,
            skip_auto_headers=("Accept-Encoding", "User-Agent"),
        )
        engines = EngineMaps(
            self._client,
            self.metrics,
            port=s.bootstrap_port,
            timeout_s=s.bootstrap_timeout_s,
            ttl_s=s.engine_cache_ttl_s,
            size=s.engine_cache_size,
            refresh_s=s.engine_refresh_s,
            tracing=self.tracing,
        )
        breakers = CircuitBreakers(
            s.breaker_failures, s.breaker_cooldown_s, on_change=self._breaker_changed
        )
        launcher = PrefillLauncher(
            self._client, self.metrics, timeout_s=s.prefill_timeout_s, tracing=self.tracing
        )
        self._dns = DnsPool(s.prefill_dns, s.dns_refresh_s) if s.prefill_dns else None
        if self._dns is not None:
            await self._dns.start()
        processor = Processor(
            s, engines, launcher, breakers, self.metrics, self.tracing, dns_pool=self._dns
        )
        processor.launcher.set_hook(processor.on_prefill_outcome)
        self.processor = processor

        server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", s.grpc_max_message_bytes),
                ("grpc.max_send_message_length", s.grpc_max_message_bytes),
                # Several worker processes may share the port (--workers).
                ("grpc.so_reuseport", 1),
            ]
        )
        pb_grpc.add_ExternalProcessorServicer_to_server(ExtProcService(processor), server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        self.port = server.add_insecure_port(s.listen)
        if not self.port:
            raise OSError(f"cannot listen on {s.listen}")
        await server.start()
        self._server = server
        for name in ("", EXT_PROC_SERVICE):
            await self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        if s.metrics_listen:
            await self._start_http(s.metrics_listen)
        log.info(
            "pdproc serving",
            extra={"listen": s.listen, "port": self.port, "metrics_port": self.metrics_port},
        )

    def _breaker_changed(self, target: HostPort, is_open: bool) -> None:
        self.metrics.breaker_open.labels(str(target)).set(1 if is_open else 0)
        log.warning(
            "prefill circuit breaker %s",
            "opened" if is_open else "closed",
            extra={"prefill_target": str(target)},
        )

    async def _start_http(self, listen: str) -> None:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics_page)
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._readyz)
        self._web = web.AppRunner(app, access_log=None)
        await self._web.setup()
        host, _, port = listen.rpartition(":")
        # reuse_port: with --workers every process serves the same (aggregated) page.
        site = web.TCPSite(self._web, host.strip("[]") or None, int(port), reuse_port=True)
        await site.start()
        server = site._server
        sockets = getattr(server, "sockets", None) or []
        self.metrics_port = sockets[0].getsockname()[1] if sockets else int(port)

    async def _healthz(self, _: web.Request) -> web.Response:
        return _text(200, "ok\n")

    async def _readyz(self, _: web.Request) -> web.Response:
        return _text(503, "draining\n") if self.draining else _text(200, "ok\n")

    async def _metrics_page(self, _: web.Request) -> web.Response:
        body = self.metrics.exposition()
        return web.Response(body=body, headers={"content-type": CONTENT_TYPE_LATEST})

    async def stop(self, drain_timeout_s: float | None = None, lame_duck_s: float = 0.0) -> int:
        """Drain: report NOT_SERVING, keep serving for `lame_duck_s` so health checks see
        it, refuse new streams, let open ones and in-flight prefills finish. Returns the
        number of prefills abandoned at the deadline (0 is a clean drain)."""
        timeout = self.settings.drain_timeout_s if drain_timeout_s is None else drain_timeout_s
        self.draining = True
        if self.processor is not None:
            self.processor.draining = True
        await self._health.enter_graceful_shutdown()
        if lame_duck_s > 0:
            await asyncio.sleep(lame_duck_s)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        if self._server is not None:
            await self._server.stop(grace=timeout)
        left = 0
        if self.processor is not None:
            left = await self.processor.launcher.drain(max(0.0, deadline - loop.time()))
            if left:
                log.error("shutdown abandoned %d in-flight prefills", left)
        if self._dns is not None:
            await self._dns.stop()
        if self._client is not None:
            await self._client.close()
        if self._web is not None:
            await self._web.cleanup()
        if self._tracer_provider is not None:
            self._tracer_provider.shutdown()  # flush the spans still queued
        log.info("pdproc stopped", extra={"abandoned_prefills": left})
        return left

    async def serve_forever(self) -> int:
        await self.start()
        # Everything allocated so far lives as long as the process: keep it out of the
        # collector's scans, and collect the young generation less often. Measured on the
        # benchmark (1 KiB, concurrency 16): ~6 % less CPU per request, p99 not worse.
        gc.freeze()
        gc.set_threshold(50_000, 20, 100)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        log.info("shutdown requested: draining")
        lame_duck = min(self.settings.shutdown_delay_s, self.settings.drain_timeout_s)
        left = await self.stop(lame_duck_s=lame_duck)
        return 1 if left else 0


def _text(status: int, text: str) -> web.Response:
    return web.Response(status=status, text=text)


def run(settings: Settings, tracer_provider: TracerProvider | None = None) -> int:
    """Run one server until SIGTERM/SIGINT, on uvloop when it is installed."""
    server = ProcessorServer(settings, tracer_provider=tracer_provider)
    try:
        import uvloop
    except ImportError:
        return asyncio.run(server.serve_forever())
    return uvloop.run(server.serve_forever())
