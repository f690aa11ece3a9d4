"""Simulated vLLM Mooncake prefill/decode pair for demos, end-to-end tests and benchmarks.

The decode really waits for the matching prefill (transfer_id, engine_id, rank) by
long-polling the prefill's bootstrap server, and fails like vLLM when it never comes.
"""

from pdproc_sim.cli import main
from pdproc_sim.decode import DecodeConfig, DecodeState
from pdproc_sim.prefill import PrefillConfig, PrefillState
from pdproc_sim.runner import (
    RunningDecode,
    RunningPrefill,
    RunningSim,
    start_decode,
    start_pair,
    start_prefill,
)

__all__ = [
    "DecodeConfig",
    "DecodeState",
    "PrefillConfig",
    "PrefillState",
    "RunningDecode",
    "RunningPrefill",
    "RunningSim",
    "main",
    "start_decode",
    "start_pair",
    "start_prefill",
]
