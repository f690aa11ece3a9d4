"""pdproc.multiprocess.listeners: a fixed port another process listens on stops `serve`
before it binds (real sockets on loopback)."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from pdproc.multiprocess.listeners import PortInUse, check_ports_free, port_held
from pdproc.targets import HostPort


@pytest.fixture
def listening() -> Iterator[int]:
    """A port someone else listens on, shared as another pdproc's workers would share it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        held.bind(("127.0.0.1", 0))
        held.listen()
        yield held.getsockname()[1]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def test_a_port_held_with_so_reuseport_is_held(listening: int) -> None:
    assert port_held("127.0.0.1", listening)


def test_a_free_port_is_not_held() -> None:
    assert not port_held("127.0.0.1", free_port())


def test_check_names_the_flag_of_the_held_port(listening: int) -> None:
    free = HostPort("127.0.0.1", free_port())
    with pytest.raises(PortInUse, match=rf"--metrics-listen 127.0.0.1:{listening}: port"):
        check_ports_free(
            [(free, "--listen"), (HostPort("127.0.0.1", listening), "--metrics-listen")]
        )


def test_unset_and_port_zero_listeners_are_not_probed(listening: int) -> None:
    # Port 0 picks a free port at bind time; None is a listener that is off.
    check_ports_free([(None, "--metrics-listen"), (HostPort("127.0.0.1", 0), "--listen")])


def test_a_metrics_port_taken_after_the_probe_is_refused_clearly() -> None:
    """The race the probe leaves: another process binds the metrics port between the probe
    and pdproc's own bind. `run` then says which flag's port is taken and exits 2, having
    released what it had already started (its gRPC port is free again)."""
    from pdproc.config import Settings
    from pdproc.server import run

    grpc_port = free_port()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        settings = Settings(
            listen=HostPort("127.0.0.1", grpc_port),
            metrics_listen=HostPort("127.0.0.1", taken),
        )
        assert run(settings) == 2
    assert not port_held("127.0.0.1", grpc_port)
