"""The cluster bed: hosts as Linux network namespaces on one bridge, real dnsmasq, Envoy and
the installed pdproc on a gateway host, simulator pods on their own hosts.

    python -m tests.cluster.bed run [SCENARIO ...]   build, run scenarios, print the table
    python -m tests.cluster.bed up                   build, start the stack, wait for Ctrl-C
    python -m tests.cluster.bed down [--all]         remove the namespaces of dead runs

Hosts (10.213.0.0/24, an address range used only inside these namespaces; the bridge has a
namespace of its own, and nothing is added to the root namespace):

    gw 10.213.0.1       Envoy (:10000, admin 127.0.0.1:9901), pdproc (127.0.0.1:9002,
                        metrics :9100) resolving prefill.pdc.test through dns
    p1-p3 .11-.13       pdproc-sim prefill (:8100, Mooncake bootstrap :8998)
    d1 .21              pdproc-sim decode (:8200)
    dns .53             dnsmasq, the A records of prefill.pdc.test
    client .100         the load (tests/cluster/load.py)
    p1-line ... p3-line spliced into each pod's link: a kernel bridge, or a delay line
                        (tests/cluster/delayline.c, compiled here) holding every frame

Every neighbour entry is permanent, so a host whose link is down drops packets silently, as a
dead node behind a cloud network does (no ARP failure, no ICMP). Everything started is
stopped by PID, every nft table and namespace removed, on return, on an exception, on
SIGINT/SIGTERM and at exit."""

from __future__ import annotations

import argparse
import atexit
import contextlib
import http.client
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.cluster import netns

SUBNET = "10.213.0"
HOSTS = {"gw": 1, "p1": 11, "p2": 12, "p3": 13, "d1": 21, "dns": 53, "client": 100}
PODS = ("p1", "p2", "p3")
DNS_NAME = "prefill.pdc.test"
PREFILL_PORT, BOOTSTRAP_PORT, DECODE_PORT = 8100, 8998, 8200
ENVOY_PORT, METRICS_PORT = 10000, 9100
PROCESSOR = "127.0.0.1:9002"
ADMIN = "127.0.0.1:9901"
CHECKOUT = Path(__file__).resolve().parents[2]
# A pod's delay line (docs/cluster-tests.md): compiled at bed time, runs between these two
# interfaces of the namespace spliced into the pod's link.
DELAYLINE_SOURCE = Path(__file__).with_name("delayline.c")
LINE_PORTS = ("pod", "net")
# The simulated engines' timing: a prefill computes 30 ms, the decode streams 8 tokens 5 ms
# apart, so requests overlap at the scenarios' load and "fewest in flight" has work to see.
SIM_PREFILL = ["--prefill-delay-ms", "30"]
SIM_DECODE = ["--itl-ms", "5", "--first-token-delay-ms", "5"]


def addr(host: str) -> str:
    return f"{SUBNET}.{HOSTS[host]}"


def mac(host: str) -> str:
    return f"02:00:0a:d5:00:{HOSTS[host]:02x}"


def line(pod: str) -> str:
    """The namespace spliced into the pod's link (the host key; `ns()` names it)."""
    return f"{pod}-line"


def veth(ns: str, name: str, peer_ns: str, peer: str, peer_mac: str | None = None) -> None:
    """A veth pair made from `ns`: `name` there, `peer` in `peer_ns`."""
    address = ["address", peer_mac] if peer_mac else []
    netns.ip(ns, "link", "add", name, "type", "veth", "peer", "name", peer, "netns", peer_ns,
             *address)  # fmt: skip


def pod_address(pod: str) -> str:
    return f"{addr(pod)}:{PREFILL_PORT}"


def bin_path(name: str) -> str:
    """A console script of the interpreter running the bed (the installed wheels under
    `make test-cluster`)."""
    return str(Path(sys.executable).with_name(name))


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    def tail(self, lines: int = 20) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log.read_text("utf-8", "replace").splitlines()[-lines:])
        return ""

    def terminate(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)

    def stop(self, timeout_s: float = 5.0) -> None:
        """SIGTERM, then SIGKILL: by PID, the process the bed started."""
        if self.popen.poll() is None:
            self.terminate()
            try:
                self.popen.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        if self.popen.stdout is not None:
            self.popen.stdout.close()


class Bed:
    """The namespaces, the bridge, dnsmasq; `start()`/`stop()` the stack on it."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.prefix = f"{netns.PREFIX}{os.getpid()}-"
        self.procs: dict[str, Proc] = {}
        self.nft_tables: set[str] = set()
        self.hosts_file = workdir / "prefill.hosts"
        self.in_dns: tuple[str, ...] = ()
        self.delayline = workdir / "delayline"
        self.delayed: list[str] = []
        self._built = False
        self._down = False

    def ns(self, host: str) -> str:
        return self.prefix + host

    # -- the network --------------------------------------------------------------------

    def build(self) -> None:
        # Compiled first: a machine without a C compiler fails before anything is made.
        netns.run(["gcc", "-O2", "-Wall", "-o", str(self.delayline), str(DELAYLINE_SOURCE)])
        self._built = True
        bridge = self.ns("br")
        for name in (bridge, *(self.ns(h) for h in (*HOSTS, *map(line, PODS)))):
            netns.run(["ip", "netns", "add", name])
            netns.ip(name, "link", "set", "lo", "up")
        netns.ip(bridge, "link", "add", "br0", "type", "bridge")
        netns.ip(bridge, "link", "set", "br0", "up")
        for host in HOSTS:
            # Both ends made from the bridge's namespace (a pod's from its line's): no
            # interface ever exists in root.
            if host in PODS:
                self._splice(host)
            else:
                veth(bridge, f"v-{host}", self.ns(host), "eth0", mac(host))
            netns.ip(bridge, "link", "set", f"v-{host}", "master", "br0", "up")
            netns.ip(self.ns(host), "addr", "add", f"{addr(host)}/24", "dev", "eth0")
            netns.ip(self.ns(host), "link", "set", "eth0", "up")
        for host in HOSTS:
            for other in HOSTS:
                if other != host:
                    netns.ip(
                        self.ns(host),
                        "neigh",
                        "replace",
                        addr(other),
                        "lladdr",
                        mac(other),
                        "dev",
                        "eth0",
                        "nud",
                        "permanent",
                    )
        resolv = Path(f"/etc/netns/{self.ns('gw')}")
        resolv.mkdir(parents=True, exist_ok=True)
        # glibc's defaults otherwise (5 s timeout, 2 attempts), as a pod's resolv.conf has.
        (resolv / "resolv.conf").write_text(f"nameserver {addr('dns')}\n")
        self._start_dnsmasq()

    def _splice(self, pod: str) -> None:
        """The pod's link runs through a namespace of its own: the pod's eth0, veth to
        `pod` there, a kernel bridge to `net`, veth to the pod's port on the bridge. The
        kernel bridge passes frames at once; `delay()` puts a delay line in its place."""
        spliced = self.ns(line(pod))
        veth(self.ns("br"), f"v-{pod}", spliced, "net")
        veth(spliced, "pod", self.ns(pod), "eth0", mac(pod))
        netns.ip(spliced, "link", "add", "br0", "type", "bridge")
        for dev in LINE_PORTS:
            netns.ip(spliced, "link", "set", dev, "master", "br0", "up")
        netns.ip(spliced, "link", "set", "br0", "up")

    def delay(self, delay_ms: float, pods: Sequence[str] = PODS) -> None:
        """Every frame on these pods' links held `delay_ms` each way, by a delay line in
        place of the link's kernel bridge, until `stop()`. Returns once the lines forward."""
        for pod in pods:
            for dev in LINE_PORTS:
                # Out of the kernel bridge first, or both would forward every frame.
                netns.ip(self.ns(line(pod)), "link", "set", dev, "nomaster")
            self.delayed.append(pod)
            usec = str(round(delay_ms * 1000))
            proc = self.spawn(
                line(pod), line(pod), [str(self.delayline), *LINE_PORTS, usec], pipe=True
            )
            read_ready(proc)

    def undelay(self) -> None:
        """The delay lines stopped, the links' kernel bridges back."""
        while self.delayed:
            pod = self.delayed.pop()
            self.stop_proc(line(pod))
            for dev in LINE_PORTS:
                netns.ip(self.ns(line(pod)), "link", "set", dev, "master", "br0")

    def round_trip_ms(self, src: str, dst: str, port: int, tries: int = 10) -> float:
        """The shortest of `tries` TCP handshakes from host `src` to `dst:port` (SYN to
        SYN-ACK, or to the RST of a closed port): the path's round trip, least queueing."""
        return netns.in_netns(self.ns(src), handshake_ms, addr(dst), port, tries)

    def _start_dnsmasq(self) -> None:
        self.hosts_file.write_text("")
        self.spawn(
            "dns",
            "dnsmasq",
            [
                "dnsmasq",
                "--keep-in-foreground",
                "--conf-file=/dev/null",
                "--no-resolv",
                "--no-hosts",
                f"--addn-hosts={self.hosts_file}",
                f"--listen-address={addr('dns')}",
                "--bind-interfaces",
                "--local=/pdc.test/",
                "--pid-file=",
                "--user=root",
                "--group=root",
                "--log-facility=-",
                "--local-ttl=1",
                "--no-negcache",
            ],
        )

    def set_dns(self, pods: Sequence[str]) -> None:
        """prefill.pdc.test answers these pods' addresses (dnsmasq re-reads on SIGHUP); returns
        once the gateway's resolver sees them."""
        self.hosts_file.write_text("".join(f"{addr(p)} {DNS_NAME}\n" for p in pods))
        self.procs["dnsmasq"].popen.send_signal(signal.SIGHUP)
        want = {addr(p) for p in pods}
        wait_for(lambda: self.resolved() == want, f"DNS answering {sorted(want)}")
        self.in_dns = tuple(pods)

    def resolved(self) -> set[str]:
        out = netns.run(
            netns.exec_argv(self.ns("gw"), ["getent", "ahostsv4", DNS_NAME]), check=False
        )
        return {line.split()[0] for line in out.splitlines() if line.strip()}

    def nft(self, host: str, table: str, chains: str) -> None:
        """Add nft table `inet <table>` with these chains in the host's namespace."""
        netns.run(
            netns.exec_argv(self.ns(host), ["nft", "-f", "-"]),
            input_text=f"table inet {table} {{\n{chains}\n}}\n",
        )
        self.nft_tables.add(f"{host} {table}")

    def nft_delete(self, host: str, table: str) -> None:
        netns.run(
            netns.exec_argv(self.ns(host), ["nft", "delete", "table", "inet", table]), check=False
        )
        self.nft_tables.discard(f"{host} {table}")

    def link(self, host: str, up: bool) -> None:
        """The host's bridge port up or down: down, its packets vanish silently."""
        netns.ip(self.ns("br"), "link", "set", f"v-{host}", "up" if up else "down")

    # -- processes ----------------------------------------------------------------------

    def spawn(self, host: str, name: str, argv: Sequence[str], pipe: bool = False) -> Proc:
        log = self.workdir / f"{name}.log"
        with log.open("ab") as out:
            popen = subprocess.Popen(
                netns.exec_argv(self.ns(host), argv),
                stdout=subprocess.PIPE if pipe else out,
                stderr=out,
                stdin=subprocess.DEVNULL,
                cwd=self.workdir,
                preexec_fn=netns.die_with_parent,
            )
        proc = Proc(name, popen, log)
        self.procs[name] = proc
        return proc

    def stop_proc(self, name: str) -> None:
        proc = self.procs.pop(name, None)
        if proc is not None:
            proc.stop()

    def stop_procs(self, names: Sequence[str]) -> None:
        """SIGTERM to all first (pdproc's lame duck and Envoy's exit overlap), then each
        waited for, SIGKILL after 5 s."""
        for name in names:
            self.procs[name].terminate()
        for name in names:
            self.stop_proc(name)

    def start(self, dns: Sequence[str] = PODS) -> None:
        """The stack, fresh: pods, decode, DNS answering `dns`, pdproc, Envoy."""
        pods = [
            self._start_sim(
                pod,
                [
                    "prefill",
                    "--port",
                    str(PREFILL_PORT),
                    "--bootstrap-port",
                    str(BOOTSTRAP_PORT),
                    "--engine-id-prefix",
                    pod,
                    *SIM_PREFILL,
                ],
            )
            for pod in PODS
        ]
        decode = self._start_sim("d1", ["decode", "--port", str(DECODE_PORT), *SIM_DECODE])
        for proc in (*pods, decode):
            read_ready(proc)
        self.set_dns(dns)
        self.start_pdproc()
        self._start_envoy()

    def _start_sim(self, host: str, argv: Sequence[str]) -> Proc:
        return self.spawn(
            host,
            host,
            [bin_path("pdproc-sim"), argv[0], "--host", addr(host), *argv[1:]],
            pipe=True,
        )

    def start_pdproc(self) -> None:
        metrics = f"{addr('gw')}:{METRICS_PORT}"
        proc = self.spawn(
            "gw",
            "pdproc",
            [
                bin_path("pdproc"),
                "serve",
                "--listen",
                PROCESSOR,
                "--metrics-listen",
                metrics,
                "--workers",
                "1",
                "--prefill-dns",
                f"{DNS_NAME}:{PREFILL_PORT}",
            ],
        )
        wait_for(lambda: self.get("gw", f"http://{metrics}/readyz")[0] == 200, "pdproc", proc)

    def _start_envoy(self) -> None:
        from pdproc_sim.devstack import envoy_binary, envoy_version_of

        from pdproc.envoy_config import EnvoyOptions, render
        from pdproc.targets import parse_host_port

        binary = envoy_binary()
        version = envoy_version_of(binary)
        options = EnvoyOptions(
            listen=parse_host_port(f"{addr('gw')}:{ENVOY_PORT}"),
            processor=[parse_host_port(PROCESSOR)],
            decode=[parse_host_port(f"{addr('d1')}:{DECODE_PORT}")],
            admin=parse_host_port(ADMIN),
            access_log=True,
            **({"envoy_version": version} if version else {}),
        )
        config = self.workdir / "envoy.yaml"
        config.write_text(render(options), "utf-8")
        proc = self.spawn(
            "gw",
            "envoy",
            [
                binary,
                "-c",
                str(config),
                "--concurrency",
                "1",
                "--log-level",
                "warning",
                "--disable-hot-restart",
                "--use-dynamic-base-id",
            ],
        )
        wait_for(lambda: self._processor_healthy(), "Envoy and its health check of pdproc", proc)

    def _processor_healthy(self) -> bool:
        status, body = self.get("gw", f"http://{ADMIN}/clusters")
        flags = [
            line
            for line in body.decode().splitlines()
            if line.startswith("pdproc::") and "::health_flags::" in line
        ]
        return status == 200 and bool(flags) and all(f.endswith("::healthy") for f in flags)

    def get(self, host: str, url: str, timeout_s: float = 2.0) -> tuple[int, bytes]:
        """GET from inside the host's namespace."""
        return netns.in_netns(self.ns(host), http_get, url, timeout_s)

    def metrics(self) -> str:
        return self.get("client", f"http://{addr('gw')}:{METRICS_PORT}/metrics")[1].decode()

    def stop(self) -> None:
        """The stack down, the network as built: links up, scenario rules gone."""
        self.stop_procs([n for n in self.procs if n != "dnsmasq"])
        self.undelay()
        for entry in list(self.nft_tables):
            self.nft_delete(*entry.split())
        for host in HOSTS:
            self.link(host, up=True)

    def load(self, out: Path, args: Sequence[str]) -> Proc:
        """The load client in the client namespace; its first line gives the clock's zero."""
        argv = [
            sys.executable,
            "-m",
            "tests.cluster.load",
            "--url",
            f"http://{addr('gw')}:{ENVOY_PORT}/v1/completions",
            *(a for pod in PODS for a in ("--poll", pod_address(pod))),
            "--out",
            str(out),
            *args,
        ]
        popen = subprocess.Popen(
            netns.exec_argv(self.ns("client"), argv),
            stdout=subprocess.PIPE,
            stderr=(self.workdir / "load.log").open("ab"),
            stdin=subprocess.DEVNULL,
            cwd=CHECKOUT,
            preexec_fn=netns.die_with_parent,
        )
        proc = Proc("load", popen, self.workdir / "load.log")
        self.procs["load"] = proc
        return proc

    # -- teardown -----------------------------------------------------------------------

    def teardown(self) -> list[str]:
        """Everything down; returns what is still there (nothing, normally)."""
        if self._down:
            return []
        self._down = True
        with contextlib.suppress(Exception):
            self.stop_procs(list(self.procs))
        for name in list(self.procs):
            with contextlib.suppress(Exception):
                self.stop_proc(name)
        for entry in list(self.nft_tables):
            with contextlib.suppress(Exception):
                self.nft_delete(*entry.split())
        if not self._built:
            return []
        for name in netns.ours(os.getpid()):
            netns.delete(name)
        left = netns.ours(os.getpid())
        left += [str(p) for p in Path("/etc/netns").glob(f"{self.prefix}*")]
        return left


def http_get(url: str, timeout_s: float) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def handshake_ms(address: str, port: int, tries: int) -> float:
    best = float("inf")
    for _ in range(tries):
        with socket.socket() as sock:
            sock.settimeout(2.0)
            start = time.perf_counter()
            with contextlib.suppress(ConnectionRefusedError):
                sock.connect((address, port))
            best = min(best, time.perf_counter() - start)
    return best * 1000


def wait_for(
    check: Callable[[], bool], what: str, proc: Proc | None = None, timeout_s: float = 30.0
) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.popen.poll() is not None:
            raise RuntimeError(f"{proc.name} exited ({proc.popen.returncode}): {proc.tail()}")
        with contextlib.suppress(OSError, http.client.HTTPException):
            if check():
                return
        time.sleep(0.05)
    raise TimeoutError(f"{what} not ready after {timeout_s} s")


def read_ready(proc: Proc, timeout_s: float = 30.0) -> dict[str, Any]:
    """The first stdout line of a simulator or the load client (JSON)."""
    assert proc.popen.stdout is not None
    ready, _, _ = select.select([proc.popen.stdout], [], [], timeout_s)
    line = proc.popen.stdout.readline() if ready else b""
    if not line:
        raise RuntimeError(f"{proc.name} did not start: {proc.tail()}")
    parsed: dict[str, Any] = json.loads(line)
    return parsed


@contextlib.contextmanager
def built(workdir: Path | None = None) -> Iterator[Bed]:
    """A built bed, torn down however the block ends (SIGTERM included: it becomes a
    KeyboardInterrupt here, so the same unwinding runs); raises if anything is left."""
    with contextlib.ExitStack() as cleanup:
        if workdir is None:
            workdir = Path(cleanup.enter_context(tempfile.TemporaryDirectory(prefix="pdc-")))
        bed = Bed(workdir)
        atexit.register(bed.teardown)
        previous = signal.signal(signal.SIGTERM, _interrupt)
        try:
            for name in netns.orphans():
                netns.delete(name)
            bed.build()
            yield bed
        finally:
            left = bed.teardown()
            signal.signal(signal.SIGTERM, previous)
            atexit.unregister(bed.teardown)
            if left:
                raise RuntimeError(f"the bed left behind: {left}")


def _interrupt(signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="the cluster bed (docs/cluster-tests.md)")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run scenarios (all by default), print the table")
    run.add_argument("scenarios", nargs="*")
    run.add_argument(
        "--client-timeout",
        type=float,
        default=None,
        help="seconds a client waits for an answer (default: each scenario's)",
    )
    run.add_argument("--keep", action="store_true", help="keep the logs (the folder is printed)")
    sub.add_parser("up", help="build the bed and start the stack; Ctrl-C tears it down")
    down = sub.add_parser("down", help="remove the namespaces of runs that are gone")
    down.add_argument("--all", action="store_true", help="of every run, also live ones")
    args = parser.parse_args(argv)
    if args.command == "down":
        for name in netns.orphans(everything=args.all):
            netns.delete(name)
            print("removed", name)
        return 0
    if args.command == "up":
        return _up()
    from tests.cluster import scenarios

    chosen = scenarios.select(args.scenarios)
    workdir = Path(tempfile.mkdtemp(prefix="pdc-bed-")) if args.keep else None
    if workdir is not None:
        print(f"logs and load results in {workdir}", flush=True)
    done: dict[str, Any] = {}
    with built(workdir) as bed:
        rows = [scenarios.run(bed, s, args.client_timeout, done).row for s in chosen]
    print(scenarios.report_table(rows))
    return 0


def _up() -> int:
    with built() as bed:
        bed.start()
        print(
            f"bed {bed.prefix}* up, logs in {bed.workdir}; Envoy at "
            f"http://{addr('gw')}:{ENVOY_PORT} (ip netns exec {bed.ns('client')} ...); "
            "Ctrl-C tears it down",
            flush=True,
        )
        with contextlib.suppress(KeyboardInterrupt):
            while True:
                time.sleep(3600)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt as exc:
        sys.exit(f"interrupted ({exc or 'Ctrl-C'}): the bed is torn down")
