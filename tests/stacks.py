"""What every suite does with a running stack (`pdproc_sim.devstack`: the simulated pair,
`pdproc serve`, Envoy): reset the simulator between tests, read what each simulated pod
received, and wait until it has answered."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

from tests.waiting import eventually

if TYPE_CHECKING:
    from pdproc_sim.devstack import Stack

ROLES = ("prefill", "decode")
# How long a stack may take to answer what a test sent (a bound, not a measurement).
SERVED_S = 20.0


def reset(stack: Stack) -> Stack:
    """The simulated pods with no fault switched on and no request recorded."""
    for role in ROLES:
        stack.sim_post(role, "/sim/faults", {"clear": True})
        stack.sim_post(role, "/sim/reset")
    return stack


def records(stack: Stack, role: str, path: str | None = None) -> list[dict[str, Any]]:
    """What the simulated `role` pod received (optionally on one path only)."""
    query = f"?path={path}" if path else ""
    found: list[dict[str, Any]] = stack.sim_get(role, "/sim/requests" + query)["requests"]
    return found


def served(
    stack: Stack, role: str, count: int = 1, timeout_s: float = SERVED_S
) -> list[dict[str, Any]]:
    """The simulator's records once `count` requests have been answered (bounded wait)."""

    def answered() -> list[dict[str, Any]] | None:
        found = [r for r in records(stack, role) if r["status"] is not None]
        return found if len(found) >= count else None

    result: list[dict[str, Any]] = eventually(
        answered, timeout_s, every_s=0.02, what=f"{role} answering {count} request(s)"
    )
    return result


class Canary:
    """A loopback HTTP server that records every request: the address client-chosen fields
    point a decode pod at. Nothing may ever reach it."""

    def __init__(self) -> None:
        self.hits: list[str] = []
        hits = self.hits

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                hits.append(f"{self.command} {self.path}")
                self.send_response(404)
                self.send_header("content-length", "0")
                self.end_headers()

            do_POST = do_PUT = do_GET

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = int(self.server.server_address[1])
        self.url = f"http://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
