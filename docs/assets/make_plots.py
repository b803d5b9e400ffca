"""Draw the performance report's plots from the recorded benchmark results (no model is run).

    .venv/bin/python docs/assets/make_plots.py     # writes docs/assets/speed.png and docs/assets/serve_load.png

Inputs: benchmarks/results/speed.json (python benchmarks/speed.py ...), serve_load.json and
serve_load_transformers_batched.json (python benchmarks/serve_load.py ...); see
docs/reports/performance.md for the commands that produce them. The quality plot is drawn by
`python benchmarks/quality.py report` (benchmarks/results/quality/quality.png) and copied to
docs/assets/quality.png.
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
OUT = Path(__file__).resolve().parent
LABEL = {"llamacpp": "llama.cpp", "transformers": "transformers\nfp32"}


def speed() -> None:
    data = json.loads((RESULTS / "speed.json").read_text())
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.8))
    labels, ens, floor, tps = [], [], [], []
    for result in data["results"]:
        for row in result["rows"]:
            labels.append(f"{LABEL[result['backend']]}\nT={row['tokens']}")
            ens.append(row["ensemble_s"] / row["tokens"] * 1000)
            floor.append(row["floor_s"] / row["tokens"] * 1000)
            tps.append(row["tokens_per_s"])
    x = range(len(labels))
    left.bar([i - 0.2 for i in x], ens, 0.4, label="SpecEM (2 members)", color="#3f51b5")
    left.bar([i + 0.2 for i in x], floor, 0.4, label="floor: each member alone, summed", color="#9e9e9e")
    left.set_xticks(list(x), labels)
    left.set_ylabel("ms per committed token")
    left.set_title("Time per token against the floor (lower is better)")
    left.legend(frameon=False, loc="upper left")
    left.set_ylim(0, max(ens) * 1.35)
    right.bar(list(x), tps, 0.5, color="#3f51b5")
    for i, v in zip(x, tps, strict=True):
        right.text(i, v, f"{v:.1f}", ha="center", va="bottom")
    right.set_xticks(list(x), labels)
    right.set_ylabel("committed tokens / s")
    right.set_ylim(0, max(tps) * 1.15)
    right.set_title("Throughput of one request (higher is better)")
    fig.suptitle("SmolLM2-135M + Qwen2.5-Coder-0.5B (the paper preset's pair), greedy, 2 vCPUs", fontsize=10)
    fig.tight_layout()
    fig.savefig(OUT / "speed.png", dpi=110)


def serve_load() -> None:
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    for name, label in (
        ("serve_load.json", "llama.cpp (AVX512)"),
        ("serve_load_transformers_batched.json", "transformers fp32, batched"),
    ):
        levels = json.loads((RESULTS / name).read_text())["levels"]
        ax.plot([lv["clients"] for lv in levels], [lv["tokens_per_s"] for lv in levels], marker="o", label=label)
    ax.set_xlabel("concurrent streaming clients")
    ax.set_ylabel("committed tokens / s (all clients)")
    ax.set_title("specem serve under load, SmolLM2-135M + Qwen2.5-Coder-0.5B, 2 vCPUs", fontsize=10)
    ax.set_ylim(bottom=0)
    ax.legend(frameon=False)
    fig.tight_layout()
    fig.savefig(OUT / "serve_load.png", dpi=110)


if __name__ == "__main__":
    speed()
    serve_load()
