"""results.png: TTFT p50 per configuration, one panel per prompt size, bars per concurrency.

matplotlib is a bench-only dependency (bench/requirements.txt); without it the chart is
skipped and the reason returned, so the numbers are never lost to a missing plot library.
`python -m bench.chart results.json [results.png]` redraws from a saved run.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson


def size_label(size: int) -> str:
    if size >= 1024 * 1024 and size % (1024 * 1024) == 0:
        return f"{size // (1024 * 1024)} MiB"
    if size >= 1024 and size % 1024 == 0:
        return f"{size // 1024} KiB"
    return f"{size} B"


def draw(results: dict[str, Any], path: Path) -> str | None:
    """Write the chart; return None, or why it could not be drawn."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # headless: no display on CI or the bench box
        import matplotlib.pyplot as plt
    except ImportError as exc:
        return f"matplotlib not installed ({exc}); pip install -r bench/requirements.txt"

    cells = results["summary"]["cells"]
    configs = [name for name, info in results["configs"].items() if info["status"] == "ok"]
    sizes = sorted({cell["size"] for cell in cells})
    levels = sorted({cell["concurrency"] for cell in cells})
    if not cells or not configs:
        return "no measured cells to draw"
    index = {(c["config"], c["size"], c["concurrency"]): c for c in cells}

    fig, axes = plt.subplots(
        1, len(sizes), figsize=(max(8.0, 5.5 * len(sizes)), 4.8), squeeze=False
    )
    width = 0.8 / len(configs)
    for ax, size in zip(axes[0], sizes, strict=True):
        for k, config in enumerate(configs):
            xs, heights, low, high = [], [], [], []
            for i, level in enumerate(levels):
                cell = index.get((config, size, level))
                if cell is None or cell["ttft_p50_ms"]["median"] is None:
                    continue
                stat = cell["ttft_p50_ms"]
                xs.append(i + (k - (len(configs) - 1) / 2) * width)
                heights.append(stat["median"])
                # Error bars show the spread across rounds, not a confidence interval.
                low.append(stat["median"] - stat["min"])
                high.append(stat["max"] - stat["median"])
            ax.bar(xs, heights, width, yerr=[low, high], capsize=2, label=config)
        ax.set_xticks(range(len(levels)), [f"c={level}" for level in levels])
        ax.set_title(f"prompt {size_label(size)}")
        ax.set_ylabel("TTFT p50 (ms)")
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].legend(fontsize="small")
    meta = results["meta"]
    fig.suptitle(
        "TTFT p50 (median of {rounds} round(s); error bars: min/max over rounds)\n"
        "simulated prefill {p:g} ms, first token {f:g} ms".format(
            rounds=meta["rounds"],
            p=meta["sim"]["prefill_delay_ms"],
            f=meta["sim"]["first_token_delay_ms"],
        ),
        fontsize="medium",
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        print("usage: python -m bench.chart results.json [results.png]", file=sys.stderr)
        return 2
    source = Path(args[0])
    target = Path(args[1]) if len(args) > 1 else source.with_name("results.png")
    problem = draw(orjson.loads(source.read_bytes()), target)
    if problem:
        print(problem, file=sys.stderr)
        return 1
    print(target)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
