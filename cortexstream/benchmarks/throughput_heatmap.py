"""Heat map PNG for `bench throughput`: the median wall-time ratio (mlx-lm / CortexStream) of every matrix cell.

Rows are prompt kinds, columns concurrency x prompt tokens; green above 1.0 (CortexStream faster), red below.
Cells with a 1.25x target carry a "*"; cells not measured are grey. matplotlib is optional (the `bench` extra).
"""

from __future__ import annotations

from typing import Any

from cortexstream.atomic_files import atomic_write


def _grid(payload: dict[str, Any]) -> tuple[list[str], list[tuple[int, int]], dict[tuple[str, int, int], dict]]:
    s = payload["settings"]
    kinds = list(s["kinds"])
    columns = [(c, n) for c in s["concurrency"] for n in s["prompt_tokens"]]
    cells = {(r["kind"], r["concurrency"], r["prompt_tokens"]): r for r in payload["matrix"]}
    return kinds, columns, cells


def write_heatmap(payload: dict[str, Any], path: str) -> bool:
    """Write the PNG atomically (temporary file, then rename); False when matplotlib or the matrix is absent."""
    if not payload["matrix"]:
        return False
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import numpy as np
        from matplotlib.colors import TwoSlopeNorm
    except ImportError:
        return False
    kinds, columns, cells = _grid(payload)
    values = np.full((len(kinds), len(columns)), np.nan)
    for i, kind in enumerate(kinds):
        for j, (c, n) in enumerate(columns):
            cell = cells.get((kind, c, n))
            if cell is not None:
                values[i, j] = cell["ratio_median"]
    measured = values[~np.isnan(values)]
    spread = max(0.5, float(np.max(np.abs(measured - 1.0)))) if measured.size else 0.5
    norm = TwoSlopeNorm(vmin=1.0 - spread, vcenter=1.0, vmax=1.0 + spread)
    cmap = matplotlib.colormaps["RdYlGn"].with_extremes(bad="#d0d0d0")
    fig, ax = plt.subplots(figsize=(max(8.0, 1.6 * len(columns) + 2.5), 1.1 * len(kinds) + 2.2))
    image = ax.imshow(np.ma.masked_invalid(values), cmap=cmap, norm=norm, aspect="auto")
    for i, kind in enumerate(kinds):
        for j, (c, n) in enumerate(columns):
            cell = cells.get((kind, c, n))
            if cell is None:
                ax.text(j, i, "not run", ha="center", va="center", fontsize=8, color="#555555")
                continue
            star = "*" if cell["ratio_target"] > 1.0 else ""
            ax.text(j, i, f"{cell['ratio_median']:.2f}x{star}\nbest {cell['ratio_best']:.2f}x",
                    ha="center", va="center", fontsize=8)
    ax.set_xticks(range(len(columns)), [f"c={c}\n{n} tok" for c, n in columns], fontsize=8)
    ax.set_yticks(range(len(kinds)), kinds)
    s = payload["settings"]
    ax.set_title("Wall time ratio mlx_lm.batch_generate / cortexstream.batch_generate (>1: CortexStream faster)\n"
                 f"median of {s['rounds']} alternating rounds, {s['max_tokens']} new tokens; * = target 1.25x, "
                 "else 1.0x", fontsize=9)
    fig.colorbar(image, ax=ax, label="ratio (median)")
    fig.tight_layout()
    try:
        # matplotlib picks the format from the extension; atomic_write's temporary name keeps ".png".
        atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=110))
    finally:
        plt.close(fig)
    return True
