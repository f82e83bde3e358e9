"""Draws the documentation's figures from benchmark JSON (no measuring here).

    python benchmarks/all_reduce.py --json benchmarks/results/all_reduce.json
    python benchmarks/plot.py            # writes docs/images/*.png

Each figure is drawn from the JSON a benchmark wrote, so the docs show what was measured.
"""

import argparse
import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def all_reduce_figure(results, path):
    """Bus bandwidth per all-reduce size next to the loopback TCP throughput of the same run."""
    sizes = [1, 16, 64]
    busbw = [results[f"allreduce_{size}MB"]["busbw_MBps"] for size in sizes]
    figure, axis = plt.subplots(figsize=(5, 3.2))
    axis.bar([f"{size} MB" for size in sizes], busbw, color="#4a7ebb", label="all-reduce bus bandwidth")
    axis.axhline(results["loopback_tcp_MBps"], color="#c0504d", linestyle="--", label="loopback TCP (same run)")
    axis.set_ylabel("MB/s")
    axis.set_title("2 workers x 1 CPU replica, gRPC ring collectives")
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", default=os.path.join(ROOT, "benchmarks", "results"))
    parser.add_argument("--out", default=os.path.join(ROOT, "docs", "images"))
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.results, "all_reduce.json")) as f:
        all_reduce_figure(json.load(f), os.path.join(args.out, "all_reduce_busbw.png"))
    print("wrote", os.path.join(args.out, "all_reduce_busbw.png"))


if __name__ == "__main__":
    main()
