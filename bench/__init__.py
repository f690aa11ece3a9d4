"""Side-by-side benchmark of pdproc against Envoy alone, the bare decode and vllm-router.

`python -m bench.run` starts the stack (see `pdproc.devstack`), drives it with
`python -m bench.loadgen` in a separate process and writes results.json, summary.md and
results.png. See bench/README.md.
"""
