"""Linux network namespaces: create them under one run's own name prefix, run commands and
probes inside them, and find what a run left behind.

Every name is `pdc-<pid>-<host>`, `<pid>` being the process that built the bed: parallel runs
never share a namespace, and a sweep removes only the namespaces of runs that are gone."""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import shutil
import subprocess
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

PREFIX = "pdc-"
_CLONE_NEWNET = 0x40000000
_PR_SET_PDEATHSIG = 1
_NAME = re.compile(rf"^{PREFIX}(\d+)-")
_libc = ctypes.CDLL(None, use_errno=True)


def run(argv: Sequence[str], check: bool = True, input_text: str | None = None) -> str:
    """A command's stdout; a failing command raises with its stderr when `check`."""
    done = subprocess.run(
        list(argv), capture_output=True, text=True, timeout=30, check=False, input=input_text
    )
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


def ip(ns: str, *args: str, check: bool = True) -> str:
    return run(["ip", "-n", ns, *args], check=check)


def exec_argv(ns: str, argv: Sequence[str]) -> list[str]:
    """argv that runs `argv` inside `ns`. `ip netns exec` replaces itself with the command
    (no fork), so the child's PID is the command's, and it bind-mounts /etc/netns/<ns>/ files
    (resolv.conf) over /etc for it."""
    return ["ip", "netns", "exec", ns, *argv]


def die_with_parent() -> None:
    """preexec_fn: the child gets SIGKILL when the process that started it dies, even by
    SIGKILL, so no simulator or Envoy outlives a killed test run."""
    _libc.prctl(_PR_SET_PDEATHSIG, 9, 0, 0, 0)


def in_netns(ns: str, fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` in a new thread that joined `ns`: a network namespace is per thread, and
    every socket the thread opens belongs to `ns` (the test process itself stays in the
    root namespace)."""
    result: list[T] = []
    failure: list[BaseException] = []

    def body() -> None:
        fd = os.open(f"/run/netns/{ns}", os.O_RDONLY)
        try:
            if _libc.setns(fd, _CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), f"setns {ns}")
        finally:
            os.close(fd)
        try:
            result.append(fn(*args))
        except BaseException as exc:
            failure.append(exc)

    thread = threading.Thread(target=body, name=f"netns-{ns}", daemon=True)
    thread.start()
    thread.join()
    if failure:
        raise failure[0]
    return result[0]


def ours(owner: int) -> list[str]:
    """The namespaces that the run with this PID created (and has not yet removed)."""
    return [name for name in names() if name.startswith(f"{PREFIX}{owner}-")]


def names() -> list[str]:
    out = run(["ip", "netns", "list"])
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def orphans(everything: bool = False) -> list[str]:
    """Namespaces of runs whose process is gone (all of the bed's, with `everything`)."""
    found = []
    for name in names():
        match = _NAME.match(name)
        if match and (everything or not Path(f"/proc/{match.group(1)}").exists()):
            found.append(name)
    return found


def delete(name: str) -> None:
    """Remove a namespace: first its processes (by PID, from `ip netns pids`), then its nft
    ruleset, then the namespace and its /etc/netns folder."""
    for pid in run(["ip", "netns", "pids", name], check=False).split():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), 9)
    run(exec_argv(name, ["nft", "flush", "ruleset"]), check=False)
    run(["ip", "netns", "del", name], check=False)
    shutil.rmtree(f"/etc/netns/{name}", ignore_errors=True)
