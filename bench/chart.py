"""results.png: per prompt size, TTFT p50 per configuration (bars per concurrency) and the
proxy CPU per request, stacked by process (Envoy, processor, router).

matplotlib is a bench-only dependency (bench/requirements.txt); without it the chart is
skipped and the reason returned, so the numbers are never lost to a missing plot library.
`python -m bench.chart results.json [results.png]` redraws from a saved run.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson


def size_label(size: int) -> str:
    if size >= 1024 * 1024 and size % (1024 * 1024) == 0:
        return f"{size // (1024 * 1024)} MiB"
    if size >= 1024 and size % 1024 == 0:
        return f"{size // 1024} KiB"
    return f"{size} B"


# Proxy CPU per request, stacked by role (the simulators and the client are left out: the
# same work for every configuration of a kind).
CPU_LAYERS = (
    ("cpu_envoy_ms", "Envoy"),
    ("cpu_processor_ms", "processor"),
    ("cpu_router_ms", "router"),
)


@dataclass(frozen=True)
class _Grid:
    """Where each configuration's bars go: one group per concurrency, one bar per config."""

    configs: list[str]
    levels: list[int]
    index: dict[tuple[str, int, int], dict[str, Any]]  # (config, size, concurrency) -> cell
    colours: list[Any]

    @property
    def width(self) -> float:
        return 0.84 / len(self.configs)

    def x(self, level_no: int, config_no: int) -> float:
        return level_no + (config_no - (len(self.configs) - 1) / 2) * self.width


def _no_layers() -> dict[str, list[float]]:
    return {key: [] for key, _ in CPU_LAYERS}


@dataclass
class _Bars:
    """One configuration's bars at one prompt size."""

    xs: list[float] = field(default_factory=list)
    heights: list[float] = field(default_factory=list)
    low: list[float] = field(default_factory=list)
    high: list[float] = field(default_factory=list)
    layers: dict[str, list[float]] = field(default_factory=_no_layers)

    def add(self, x: float, cell: dict[str, Any]) -> None:
        stat = cell["ttft_p50_ms"]
        self.xs.append(x)
        self.heights.append(stat["median"])
        # Error bars show the spread across rounds, not a confidence interval.
        self.low.append(stat["median"] - stat["min"])
        self.high.append(stat["max"] - stat["median"])
        for key, _ in CPU_LAYERS:
            self.layers[key].append(cell.get(key, {}).get("median") or 0.0)


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
    # tab10, then three more that differ from all of it: one colour per configuration.
    colours = [plt.get_cmap("tab10")(i) for i in range(10)] + ["#000000", "#9edae5", "#ffbb78"]
    grid = _Grid(configs, levels, index, colours)

    fig, axes = plt.subplots(
        2, len(sizes), figsize=(max(9.0, 7.0 * len(sizes)), 9.0), squeeze=False
    )
    for column, size in enumerate(sizes):
        _draw_size(axes[0][column], axes[1][column], size, grid)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(6, len(configs)), fontsize="small")
    meta = results["meta"]
    fig.suptitle(
        "median of {rounds} interleaved round(s); error bars: min/max over rounds; "
        "simulated prefill {p:g} ms, first token {f:g} ms".format(
            rounds=meta["rounds"],
            p=meta["sim"]["prefill_delay_ms"],
            f=meta["sim"]["first_token_delay_ms"],
        ),
        fontsize="medium",
    )
    fig.tight_layout(rect=(0.0, 0.06, 1.0, 1.0))  # room for the legend below
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return None


def _draw_size(ttft_ax: Any, cpu_ax: Any, size: int, grid: _Grid) -> None:
    """One prompt size's column: TTFT bars above, stacked proxy CPU below."""
    tallest = 0.0
    for k, config in enumerate(grid.configs):
        colour = grid.colours[k % len(grid.colours)]
        bars = _bars_of(grid, config, k, size)
        ttft_ax.bar(
            bars.xs,
            bars.heights,
            grid.width,
            yerr=[bars.low, bars.high],
            capsize=2,
            label=config,
            color=colour,
        )
        bottom = _draw_cpu_layers(cpu_ax, bars, grid.width, colour)
        tallest = max([tallest, *bottom])
    for ax in (ttft_ax, cpu_ax):
        ax.set_xticks(range(len(grid.levels)), [f"c={level}" for level in grid.levels])
        ax.grid(axis="y", alpha=0.3)
    ttft_ax.set_title(f"TTFT p50, prompt {size_label(size)}")
    ttft_ax.set_ylabel("ms")
    cpu_ax.set_title(
        f"proxy CPU per request, prompt {size_label(size)}\n"
        "(plain: Envoy, //: processor, ..: router)"
    )
    cpu_ax.set_ylabel("CPU ms per request")
    cpu_ax.set_ylim(0, tallest * 1.08 or 1.0)  # stacked bars: autoscale misses the tops


def _bars_of(grid: _Grid, config: str, config_no: int, size: int) -> _Bars:
    """The configuration's measured cells at `size` (a cell without a TTFT is left out)."""
    bars = _Bars()
    for i, level in enumerate(grid.levels):
        cell = grid.index.get((config, size, level))
        if cell is not None and cell["ttft_p50_ms"]["median"] is not None:
            bars.add(grid.x(i, config_no), cell)
    return bars


def _draw_cpu_layers(cpu_ax: Any, bars: _Bars, width: float, colour: Any) -> list[float]:
    """Stack the CPU layers; the tops of the stacks."""
    bottom = [0.0] * len(bars.xs)
    for j, (key, _) in enumerate(CPU_LAYERS):
        # One colour per configuration; the layers (Envoy, processor, router) by hatch.
        cpu_ax.bar(
            bars.xs,
            bars.layers[key],
            width,
            bottom=bottom,
            color=colour,
            hatch=("", "//", "..")[j],
            edgecolor="white",
            linewidth=0.3,
        )
        bottom = [b + v for b, v in zip(bottom, bars.layers[key], strict=True)]
    return bottom


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
