"""BLEU against training minutes for every system and precision in WORK/results.jsonl (matplotlib).

    python plot.py RESULTS.jsonl OUT.png        (in a venv with matplotlib: install.sh makes PEERS_HOME/plot)

Each run is a dot; the line joins the means at each budget of minutes. :func:`draw` is what compare.py calls: it
runs this file with PEERS_HOME/plot's python, so megaformer's own venv needs no matplotlib.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

STYLE = {"megaformer": "tab:blue", "fairseq": "tab:orange", "opennmt": "tab:green"}


def draw(results: Path, png: Path, peers: Path) -> None:
    python = peers / "plot" / "bin" / "python"
    if not python.is_file():
        print(f"plot.py: no {python} (run benchmarks/peers/install.sh): no plot drawn", flush=True)
        return
    subprocess.run([str(python), __file__, str(results), str(png)], check=True)


def main(results: Path, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [json.loads(line) for line in results.read_text(encoding="utf-8").splitlines() if line.strip()]
    series: dict[tuple[str, str], dict[float, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in runs:
        series[(r["system"], r["precision"])][float(r["minutes"])].append(r["bleu_cased"])
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for (system, precision), points in sorted(series.items()):
        color = STYLE.get(system, "tab:gray")
        style, marker = ("-", "o") if precision == "fp32" else ("--", "s")
        xs = sorted(points)
        means = [sum(points[x]) / len(points[x]) for x in xs]
        ax.plot(xs, means, style, color=color, marker=marker, label=f"{system} {precision}")
        for x in xs:
            ax.scatter([x] * len(points[x]), points[x], color=color, s=12, alpha=0.5)
    machine = runs[-1]["machine"] if runs else {}
    flags = " ".join(f for f in machine.get("flags", []) if f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16"))
    ax.set_xscale("log")
    ax.minorticks_off()
    ticks = sorted({5.0, 15.0, 60.0} | {float(r["minutes"]) for r in runs})  # the budgets, and any run's
    ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
    ax.set_xlim(ticks[0] / 1.3, ticks[-1] * 1.3)
    ax.set_xlabel("training minutes")
    ax.set_ylabel("test_2016_flickr BLEU (sacreBLEU, cased)")
    ax.set_title(
        f"Multi30k en-de, megaformer's recipe for all\n{machine.get('cores', '?')} cores: {flags}", fontsize=10
    )
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    print(f"plot.py: {png} ({len(runs)} runs)")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
