"""Side-by-side benchmark of pdproc against its floor, Envoy alone, the client doing P/D
itself, vllm-router and sglang-router.

`python -m bench.run` starts every configuration (bench/stack.py, on `pdproc_sim.devstack`),
drives it with `python -m bench.loadgen` in a separate process and writes results.json,
summary.md and results.png. See bench/README.md.
"""
