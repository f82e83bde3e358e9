"""Draws the documentation's figures from benchmark JSON (no measuring here).

    python benchmarks/all_reduce.py --json benchmarks/results/all_reduce.json
    python benchmarks/all_reduce.py --only curve --json benchmarks/results/all_reduce_curve.json
    python benchmarks/loss_curves.py --json benchmarks/results/loss_curves.json
    python benchmarks/suite.py --systems keras_dist,keras,keras_loop,tf_keras,jax,keras_dist_tf_threads \
        --steps 10 --epochs 3 --json benchmarks/results/suite.json
    python benchmarks/plot.py            # writes docs/images/*.png (--figure all_reduce|busbw_curve|loss_curves|suite_scaling|suite_one_collective: one)

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


def busbw_curve_figure(results, path):
    """Bus bandwidth of one float32 tensor, 1 KB to 256 MB: TensorFlow, keras-dist, loopback TCP, and the earlier run."""
    sizes = sorted(int(size) for size in results["curve"])
    figure, axis = plt.subplots(figsize=(5.6, 3.6))
    for name, label, color in (
        ("tensorflow", "TensorFlow all_reduce (one collective)", "#4a7ebb"),
        ("keras_dist", "keras-dist gradient all-reduce (8 MiB windows)", "#9bbb59"),
    ):
        axis.plot(sizes, [results["curve"][str(s)][name]["busbw_MBps"] for s in sizes], "o-", color=color, label=label)
    tcp = results["loopback_tcp_curve_MBps"]
    axis.plot(sizes, [tcp[str(s)] for s in sizes], "--", color="#c0504d", label="loopback TCP, same sizes")
    earlier = results.get("earlier_run_tensorflow_MBps", {})
    if earlier:
        points = sorted((int(size), bw) for size, bw in earlier.items())
        axis.plot(*zip(*points), "x", color="#4a7ebb", markersize=8, label="TensorFlow, earlier run (all_reduce.json)")
    axis.set_xscale("log", base=2)
    axis.set_yscale("log")
    axis.set_xticks(sizes, [_bytes_label(s) for s in sizes], fontsize=7)
    axis.set_xlabel("bytes per all-reduce (float32)")
    axis.set_ylabel("bus bandwidth, MB/s (2**20)")
    axis.set_title("2 workers x 1 CPU replica, gRPC ring on loopback", fontsize=9)
    axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def _bytes_label(size):
    return f"{size // 2**20} MB" if size >= 2**20 else f"{size // 1024} KB"


def loss_curves_figure(results, path):
    """Keras' running loss after each step on 1 device, 2 CPU replicas and 2 workers; the curves coincide."""
    labels = {
        "one_device": "1 device",
        "cpu_replicas_1x2": "2 CPU replicas (1 worker)",
        "workers_2x1": "2 workers x 1 replica",
    }
    styles = {
        "one_device": ("#4a7ebb", "-", 3.0),
        "cpu_replicas_1x2": ("#c0504d", "--", 1.8),
        "workers_2x1": ("#2f2f2f", ":", 1.8),
    }
    figure, axis = plt.subplots(figsize=(5, 3.2))
    for run, curve in results["runs"].items():
        color, linestyle, width = styles.get(run, ("gray", "-", 1.0))
        axis.plot(
            range(1, len(curve["step_loss"]) + 1),
            curve["step_loss"],
            color=color,
            linestyle=linestyle,
            linewidth=width,
            label=labels.get(run, run),
        )
    axis.set_yscale("log")
    axis.set_xlabel("training step")
    axis.set_ylabel("training loss (running mean of the epoch)")
    axis.set_title(
        f"digits CNN, global batch {results['global_batch_size']}, seed {results['seed']}: "
        f"largest difference {results['max_abs_difference']:.1g}",
        fontsize=8,
    )
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


SYSTEM_COLORS = {
    "keras_dist": "#4a7ebb",
    "keras": "#9bbb59",
    "keras_loop": "#c0504d",
    "tf_keras": "#8064a2",
    "jax": "#f79646",
}


def scaling_figure(suite, path):
    """Step time relative to each system's own 1x1 run, per topology, one panel per workload (from suite.json)."""
    results = suite["results"]
    workloads = list(dict.fromkeys(r["workload"] for r in results))
    topologies = [t for t in dict.fromkeys(r["topology"] for r in results) if t != "1x1"]
    systems = [s for s in SYSTEM_COLORS if any(r["system"] == s for r in results)]
    figure, axes = plt.subplots(1, len(workloads), figsize=(4.2 * len(workloads), 3.4), squeeze=False)
    width = 0.8 / len(systems)
    for axis, workload in zip(axes[0], workloads):
        for i, system in enumerate(systems):
            ratios = []
            for topology in topologies:
                key = (workload, topology, system)
                row = next((r for r in results if (r["workload"], r["topology"], r["system"]) == key), {})
                ratios.append(row.get("vs_own_1x1", 0.0))
            positions = [j + (i - (len(systems) - 1) / 2) * width for j in range(len(topologies))]
            axis.bar(positions, ratios, width, color=SYSTEM_COLORS[system], label=system)
        axis.axhline(1.0, color="black", linewidth=0.8, linestyle=":")
        axis.set_xticks(range(len(topologies)), topologies)
        axis.set_xlabel("workers x replicas per worker", fontsize=8)
        axis.set_ylabel("step time / own 1x1")
        axis.set_title(f"{workload}, global batch {suite['config']['global_batch_size']}", fontsize=10)
    axes[0][0].legend(fontsize=7)
    figure.suptitle("Distribution overhead on one 2-core CPU host (lower is better; missing bar = not run)", fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


FIGURES = {  # name: (results file, drawing function, image file)
    "all_reduce": ("all_reduce.json", all_reduce_figure, "all_reduce_busbw.png"),
    "busbw_curve": ("all_reduce_curve.json", busbw_curve_figure, "all_reduce_curve.png"),
    "loss_curves": ("loss_curves.json", loss_curves_figure, "loss_curves.png"),
    "suite_scaling": ("suite.json", scaling_figure, "suite_scaling.png"),
    "suite_one_collective": ("suite_one_collective.json", scaling_figure, "suite_one_collective.png"),
}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", default=os.path.join(ROOT, "benchmarks", "results"))
    parser.add_argument("--out", default=os.path.join(ROOT, "docs", "images"))
    parser.add_argument("--figure", choices=sorted(FIGURES), action="append", help="draw only this figure (repeatable)")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    for name in args.figure or sorted(FIGURES):
        results_file, draw, image = FIGURES[name]
        with open(os.path.join(args.results, results_file)) as f:
            results = json.load(f)
        draw(results, os.path.join(args.out, image))
        print("wrote", os.path.join(args.out, image))
        if name == "loss_curves":
            print(f"largest difference from one device: {results['max_abs_difference']:.3g}")


if __name__ == "__main__":
    main()
