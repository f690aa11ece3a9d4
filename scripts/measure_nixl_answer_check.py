"""What checking a NIXL prefill's kv_transfer_params costs (pdproc.connectors.nixlv2).

    .venv/bin/python scripts/measure_nixl_answer_check.py

Answers shaped like vLLM 0.32's (two KV cache groups of block ids), for prompts of about 1k,
131k and 1M tokens (16 tokens a block). Prints the best of 15 runs of the whole check
(parsing included) beside orjson.loads of the same answer alone.
"""

from __future__ import annotations

import timeit

import orjson

from pdproc.connectors.nixlv2 import params_from_answer
from pdproc.targets import HostPort


def answer(blocks: int) -> bytes:
    params = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [list(range(blocks // 2)), list(range(blocks // 2))],
        "remote_engine_id": "e" * 36,
        "remote_request_id": "chatcmpl-" + "x" * 40,
        "remote_host": "10.0.0.5",
        "remote_port": 5600,
        "tp_size": 1,
        "dcp_size": 1,
        "pp_size": 1,
        "remote_num_tokens": blocks * 16,
        "remote_blocks_expiry_time": 1.5,
        "transfer_mode": "pull",
    }
    return orjson.dumps({"id": "x", "choices": [], "kv_transfer_params": params})


def main() -> None:
    target = HostPort("10.0.0.5", 8000)
    for blocks in (64, 8192, 65536):
        raw = answer(blocks)
        runs = 20

        def check(raw: bytes = raw) -> None:
            params_from_answer(raw, target, lambda _: False)

        def parse(raw: bytes = raw) -> None:
            orjson.loads(raw)

        whole = min(timeit.repeat(check, number=runs, repeat=15)) / runs
        parsing = min(timeit.repeat(parse, number=runs, repeat=15)) / runs
        print(
            f"{blocks:>6} block ids, answer {len(raw):>7} B: "
            f"check {whole * 1e6:>7.0f} us, orjson.loads alone {parsing * 1e6:>6.0f} us"
        )


if __name__ == "__main__":
    main()
