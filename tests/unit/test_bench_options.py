"""The benchmark's command line: a preset stands for its flags (the command line's own win),
per-concurrency request counts, and what each pdproc configuration passes to `pdproc serve`
(`pdproc-defaults` nothing beyond its pods: what a user of the wheel runs)."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest

from bench.run import PRESETS, KiB, MiB, build_parser, options_from, with_preset
from bench.stack import CONFIGS, _own_args
from pdproc.config import serve_default


def options(*argv: str):  # type: ignore[no-untyped-def]
    args = with_preset(argv)
    return options_from(build_parser().parse_args(args), list(argv))


def test_the_defaults_preset_is_the_comparison_it_names() -> None:
    opts = options("--preset", "defaults")
    assert {"floor", "pdproc-defaults", "pdproc-auto-workers", "direct-pd"} <= set(opts.configs)
    assert opts.sizes == (KiB, MiB)
    assert opts.concurrency == (1, 16, 64)
    assert opts.rounds >= 3
    assert opts.requests_for(16) == 300
    assert (opts.sim.prefill_delay_ms, opts.sim.first_token_delay_ms) == (20.0, 10.0)
    assert (opts.sim.tokens, opts.sim.itl_ms) == (8, 5.0)
    assert opts.command == "python -m bench.run --preset defaults"
    assert set(opts.configs) <= set(CONFIGS)


@pytest.mark.parametrize("form", [("--preset", "defaults"), ("--preset=defaults",)])
def test_flags_given_with_a_preset_win(form: tuple[str, ...]) -> None:
    opts = options(*form, "--rounds", "1", "--sizes", "1k")
    assert (opts.rounds, opts.sizes) == (1, (KiB,))
    assert opts.concurrency == (1, 16, 64)  # the rest is the preset's


def test_an_unknown_preset_is_refused() -> None:
    with pytest.raises(SystemExit, match="unknown preset 'fast'"):
        with_preset(["--preset", "fast"])
    assert "defaults" in PRESETS


def test_requests_per_concurrency() -> None:
    opts = options("--requests", "1:40,16:300", "--concurrency", "1,16,64")
    assert [opts.requests_for(c) for c in (1, 16, 64)] == [40, 300, 6 * 64]
    assert options("--requests", "50").requests_for(64) == 50
    with pytest.raises(SystemExit):
        options("--requests", "16:0")


def test_what_each_pdproc_configuration_asks_of_pdproc_serve() -> None:
    stack = options("--sizes", "1k,1m").stack()
    # Every default: only the process count devstack would otherwise set to 1, spelled out.
    assert _own_args("pdproc-defaults", stack) == ["--workers", str(serve_default("workers"))]
    pdproc = _own_args("pdproc", stack)
    assert pdproc[pdproc.index("--workers") + 1] == "1"
    assert "--max-body-bytes" in pdproc
    assert "--stream-body-bytes" not in pdproc
    auto = _own_args("pdproc-auto-workers", stack)
    # One per CPU it may run on (the old default), spelled out.
    assert auto[auto.index("--workers") + 1] == str(len(os.sched_getaffinity(0)))
    buffered = _own_args("pdproc-buffered", stack)
    assert buffered[buffered.index("--stream-body-bytes") + 1] == "0"
    # Bodies past pdproc's own limit: even pdproc-defaults gets room for them.
    big = replace(stack, max_body_bytes=17 * MiB)
    assert "--max-body-bytes" in _own_args("pdproc-defaults", big)


def test_the_baseline_runs_with_the_flags_of_the_configuration_it_is_measured_against() -> None:
    stack = options("--sizes", "1k,1m").stack()
    assert _own_args("pdproc-baseline", stack) == _own_args("pdproc", stack)
    like_defaults = options("--sizes", "1k,1m", "--baseline-like", "pdproc-defaults").stack()
    assert _own_args("pdproc-baseline", like_defaults) == _own_args("pdproc-defaults", stack)
