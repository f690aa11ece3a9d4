"""Several processes as one pdproc (`pdproc serve --workers N`, one per usable CPU by default).

Python runs one request at a time per process, so a pdproc uses more than one CPU by running
several full, independent copies of itself on one port, as separate replicas would be; the
kernel spreads Envoy's HTTP/2 connections over them. Everything that knows about this lives
here; the rest of pdproc sees one seam (`sharing.Sharing`, in pdproc.server) and the CLI two
calls (the port check and `supervisor.run_workers`).

- supervisor.py: the parent. It counts the workers, makes the shared directory, starts each
  worker (spawned, with its share of the totals), restarts one that dies and forwards
  SIGTERM/SIGINT for a graceful drain. It serves no request.
- listeners.py: the ports are shared with SO_REUSEPORT, which any process of the same user
  could join too; so before anything binds, each fixed port must be free.
- budgets.py: the per-worker split of the totals.
- sharing.py: what a worker is given to share (SO_REUSEPORT on its binds, the shared
  directory), and what it builds from it (its metrics, its siblings).
- siblings.py, worker_metrics.py: the two things the workers share through that directory.

Shared between the workers: the listening ports, and one directory (a temporary one the
parent removes at exit) holding the metric files and the stale engine-map marks. Nothing
else: no lock, no message on a request's path. Per process: the event loop and its streams,
the HTTP client and its connections to the pods, the engine-map cache, the breakers, the
pods' load counts and the prefix index, the DNS pool, the probes, the TLS reloader, and its
share of each budget. Each piece of state is true across the workers for its own reason:

- Metrics: every worker writes its own files, and any worker's `/metrics` is the page of
  all of them, reading as one process's would (worker_metrics.py). A dead worker's gauges
  leave the page when the parent marks it dead; its counters stay in the sums.
- Engine-map caches: a map is never used past its age bound (well under a prefill engine's
  restart time), which holds in each process on its own, as in each replica. What one worker
  learns sooner (a failed prefill, a map that changed) it tells the others through a stale
  mark per pod, so a pod that came back faster than the bound costs one failure, not one per
  worker (siblings.py).
- Breakers: not shared. Each worker learns about a dead pod from its own requests: it costs
  each worker one failed request (pool members are probed in the background by each, and
  no client pays), a bounded price that sharing breaker state on every request would cost
  more than. An open breaker nobody asks about is forgotten (pdproc.breaker), so a worker
  that stopped getting traffic does not report a pod down for ever; the page's breaker
  gauge is open while any live worker's is.
- Load counts and the prefix index: per process too, each learning from its own requests.
  A prompt's home (a rendezvous hash of its first bytes over the member set) is the same in
  every worker without sharing, so a new conversation goes to the same pod whichever worker
  routes it (docs/prefix-routing.md).
- Budgets: --max-inflight-bytes, --max-prefill-connections and --max-named-host-connections
  are divided between the workers (budgets.py), so they stay totals for the pdproc.
"""
