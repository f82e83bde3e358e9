"""A model of scale: step time T(N) on paper, calibrated on this machine's committed measurements.

    T(N) = compute / n_share + exposed all-reduce + per-step overhead
    all_reduce(S, N) = 2(N-1)/N * S / B + 2(N-1) * alpha        (per collective call)
    exposed = all_reduce - min(f * all_reduce, backward share of compute)

S is the gradient bytes, B the *bus bandwidth* as nccl-tests defines it (algbw * 2(N-1)/N,
https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md): every bandwidth in this
file, measured here or published, is a bus bandwidth, so it goes in the formula above unchanged.
alpha is the latency of one ring step (a ring all-reduce takes 2(N-1) of them). f is the overlap
fraction, the share of the all-reduce hidden behind the backward pass; nothing has measured it
yet, so this machine is calibrated with f = 0 and the predictions show f = 0, 0.5 and 0.9.
n_share is how many times the compute is divided: N for N accelerators, 1 on this machine, where
1x2 replicas and 2x1 workers share the same 2 CPU cores.

Scaling efficiency is T(1) / T(N) at a fixed batch per GPU (weak scaling, per-GPU throughput
ratio), with T(1) = compute (no all-reduce) and, on GPUs, no per-step overhead (an assumption).

Prints the calibration table (predicted vs measured, ratio), the predictions for ResNet-50 and a
BERT-base-sized model, the comparison with Horovod's published scaling and the knobs;
`--json out.json` writes them. Standard library only; reads benchmarks/results/*.json.

    python benchmarks/scale_model.py [--json out.json]
"""

import argparse
import json
import math
import os

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
MiB = 2**20


# ----------------------------------------------------------------------------------------------
# The model


def all_reduce_seconds(nbytes, n, busbw, alpha, calls=1):
    """Ring all-reduce of `nbytes` over `n` ranks in `calls` collectives (buckets): bytes once, latency per call."""
    if n <= 1:
        return 0.0
    return 2 * (n - 1) / n * nbytes / busbw + calls * 2 * (n - 1) * alpha


def step_seconds(compute, n_share, all_reduce, overhead=0.0, f=0.0, backward_share=2 / 3):
    """T(N): compute divided by n_share, the all-reduce less what the backward pass hides, overhead.

    At most the backward pass (backward_share of the compute; backward is about twice the forward's
    work, an assumption) can hide communication, so f is capped there.
    """
    local = compute / n_share
    hidden = min(f * all_reduce, backward_share * local)
    return local + all_reduce - hidden + overhead


def efficiency(compute, all_reduce, f, accumulation=1):
    """T(1) / T(N) per GPU at a fixed per-GPU batch; with k-step accumulation, one all-reduce per k steps."""
    k = accumulation
    return k * compute / step_seconds(k * compute, 1, all_reduce, f=f, backward_share=2 / 3 / k)


# ----------------------------------------------------------------------------------------------
# Calibration on this machine (2 busy CPU cores, loopback)


def load(name):
    with open(os.path.join(RESULTS, name)) as f:
        return json.load(f)


def mlp_bytes():
    """MLP 784-512-512-10, float32 gradients."""
    return 4 * ((784 * 512 + 512) + (512 * 512 + 512) + (512 * 10 + 10))


def cnn_bytes():
    """The suite's CNN: Conv2D 32, 64, 64 (3x3, on 32x32x3), Dense 10 after global pooling; float32."""
    return 4 * ((3 * 3 * 3 * 32 + 32) + (3 * 3 * 32 * 64 + 64) + (3 * 3 * 64 * 64 + 64) + (64 * 10 + 10))


def suite_row(data, workload, topology, system="keras_dist"):
    for r in data["results"]:
        if (r["workload"], r["topology"], r["system"]) == (workload, topology, system):
            return r
    raise KeyError((workload, topology, system))


def calibrate(results=None):
    """The model's parameters on this machine, each from one committed measurement.

    Returns (params, rows): rows are every figure the model is compared with, calibrated or predicted.
    """
    r = results or {
        name: load(name + ".json")
        for name in ("suite", "suite_one_collective", "suite_after_collectives", "profile_step", "all_reduce")
    }
    ar, prof, one = r["all_reduce"], r["profile_step"]["results"], r["suite_one_collective"]
    n = 2
    params = {}
    # alpha and B between the 2 workers, solved exactly from two figures: an all-reduce of 8 floats
    # (almost all latency) and keras-dist's own gradient all-reduce of 64 MiB in 16 tensors, default packs.
    grad = ar["gradients_64MB"]["keras_dist compression=None pack=auto"]
    size, small = 64 * MiB, 32
    ring, steps = 2 * (n - 1) / n, 2 * (n - 1)
    inverse_b = (grad["seconds"] - ar["structure_check_8_floats"]) / (ring * (size - small))
    params["busbw_net_Bps"] = 1 / inverse_b
    params["alpha_s"] = (ar["structure_check_8_floats"] - ring * small * inverse_b) / steps
    # B between 2 replicas in one process (ReductionToOneDevice): profile_step's 1x2 all-reduce part, MLP.
    local_ar = (prof["1x2"]["ms_per_step"]["all_reduce"] - prof["1x2"]["ms_per_step"]["forward_backward"]) / 1e3
    params["busbw_local_Bps"] = 2 * (n - 1) / n * mlp_bytes() / local_ar
    # compute + overhead of one replica: each workload's keras-dist 1x1 in the one-collective suite run.
    t1 = {w: suite_row(one, w, "1x1")["median_step_seconds"] for w in ("mlp", "cnn")}
    params["t1x1_s"] = t1
    # Per-step overhead on workers that the network term does not explain: fitted on the MLP's 2x1.
    mlp_net = all_reduce_seconds(mlp_bytes(), n, params["busbw_net_Bps"], params["alpha_s"])
    params["worker_overhead_s"] = suite_row(one, "mlp", "2x1")["median_step_seconds"] - t1["mlp"] - mlp_net
    params["mlp_bytes"], params["cnn_bytes"] = mlp_bytes(), cnn_bytes()

    def net(nbytes, calls=1):
        return all_reduce_seconds(nbytes, n, params["busbw_net_Bps"], params["alpha_s"], calls)

    def local(nbytes):
        return all_reduce_seconds(nbytes, n, params["busbw_local_Bps"], 0.0)

    rows = []

    def add(figure, source, measured, predicted, role, spread=None):
        rows.append(
            {
                "figure": figure,
                "source": source,
                "measured_ms": measured * 1e3,
                "predicted_ms": predicted * 1e3,
                "ratio": predicted / measured,
                "spread": spread,
                "role": role,
            }
        )

    nbytes = {"mlp": mlp_bytes(), "cnn": cnn_bytes()}
    label = {"mlp": "MLP", "cnn": "CNN"}
    for w in ("mlp", "cnn"):
        row = suite_row(one, w, "1x1")
        add(
            f"{label[w]} 1x1 step",
            "suite_one_collective",
            row["median_step_seconds"],
            t1[w],
            "calibrates compute + overhead",
            row["spread"],
        )
        row = suite_row(one, w, "1x2")
        # Same 2 cores: the compute does not divide (n_share = 1).
        pred = step_seconds(t1[w], 1, local(nbytes[w]))
        add(
            f"{label[w]} 1x2 step", "suite_one_collective", row["median_step_seconds"], pred, "predicted", row["spread"]
        )
        row = suite_row(one, w, "2x1")
        pred = step_seconds(t1[w], 1, net(nbytes[w]), params["worker_overhead_s"])
        role = "calibrates worker overhead" if w == "mlp" else "predicted"
        add(f"{label[w]} 2x1 step", "suite_one_collective", row["median_step_seconds"], pred, role, row["spread"])
    # Earlier runs of the suite: 3 collectives per step (suite_after_collectives) and 7 (suite).
    for name, calls in (("suite_after_collectives", 3), ("suite", 7)):
        for w in ("mlp", "cnn"):
            row, own = suite_row(r[name], w, "2x1"), suite_row(r[name], w, "1x1")
            extra = (calls - 1) * 2 * (n - 1) * params["alpha_s"]
            pred = step_seconds(own["median_step_seconds"], 1, net(nbytes[w]), params["worker_overhead_s"] + extra)
            add(
                f"{label[w]} 2x1 step, {calls} collectives (own 1x1)",
                name,
                row["median_step_seconds"],
                pred,
                "predicted",
                row["spread"],
            )
    p2 = prof["2x1"]["ms_per_step"]
    add(
        "MLP 2x1 gradient all-reduce (TF's all_reduce)",
        "profile_step",
        (p2["all_reduce"] - p2["forward_backward"]) / 1e3,
        net(mlp_bytes()),
        "predicted",
    )
    add("MLP 1x2 gradient all-reduce (one process)", "profile_step", local_ar, local(mlp_bytes()), "calibrates local B")
    add("all-reduce of 8 floats", "all_reduce", ar["structure_check_8_floats"], net(small), "calibrates alpha")
    add("64 MiB gradients, keras-dist default packs", "all_reduce", grad["seconds"], net(size), "calibrates network B")
    pack4 = ar["gradients_64MB"]["keras_dist compression=None pack=4MB"]["seconds"]
    add("64 MiB gradients, 4 MiB packs (16 calls)", "all_reduce", pack4, net(size, calls=16), "predicted")
    for mb in (1, 16, 64):
        add(
            f"{mb} MiB, one tensor (TF's one pack)",
            "all_reduce",
            ar[f"allreduce_{mb}MB"]["seconds"],
            net(mb * MiB),
            "predicted",
        )
    bf16 = ar["gradients_64MB"]["keras_dist compression=bf16 pack=8MB"]["seconds"]
    add("64 MiB gradients, bf16 (half the bytes)", "all_reduce", bf16, net(size / 2), "predicted")
    return params, rows


# ----------------------------------------------------------------------------------------------
# Predictions at scale, from published figures

SOURCES = {
    "nccl_tests_busbw": (
        "nccl-tests, doc/PERFORMANCE.md: busbw = algbw * 2(n-1)/n for all-reduce",
        "https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md",
    ),
    "dle_resnet50_tf": (
        "NVIDIA Deep Learning Examples, ResNet-50 v1.5 for TensorFlow: DGX A100 (8x A100 40GB), batch 256 per GPU, "
        "mixed precision + XLA: 2375 img/s on 1 GPU, 17400 on 8 (weak scaling 7.32x); TF32 + XLA: 909 and 7000 (7.70x)",
        "https://github.com/NVIDIA/DeepLearningExamples/blob/master/TensorFlow/Classification/ConvNets/resnet50v1.5/README.md",
    ),
    "dle_bert_tf2": (
        "NVIDIA Deep Learning Examples, BERT for TensorFlow 2: pre-training on DGX A100 (8x A100 80GB), BERT-large, "
        "sequence 128, batch 312 per GPU, mixed precision: 485.59 sequences/s on 1 GPU (no BERT-base training figure is published there)",
        "https://github.com/NVIDIA/DeepLearningExamples/blob/master/TensorFlow2/LanguageModeling/BERT/README.md",
    ),
    "nccl_527": (
        "NVIDIA/nccl issue 527: nccl-tests all_reduce_perf, 1 GiB float, AWS p4dn.24xlarge (8x A100, NVSwitch, "
        "4x100 Gb/s EFA): busbw 230.77 GB/s on 1 node, 57.17 on 2, 31.77 on 3, 29.61 on 4 (NCCL 2.9.9; the reporter calls it slow)",
        "https://github.com/NVIDIA/nccl/issues/527",
    ),
    "nccl_235": (
        "NVIDIA/nccl issue 235 (NCCL maintainer's summary): AWS p3dn (8x V100, 100 Gb/s EFA): 80 Gb/s (10 GB/s) on 2 nodes, "
        "50-60 Gb/s (6-8 GB/s) on 8 to 32 nodes",
        "https://github.com/NVIDIA/nccl/issues/235",
    ),
    "dstack_3961": (
        "dstackai/dstack pull request 3961: nccl-tests all_reduce on 2x AWS p6-b200 (16 GPUs): 8 bytes in 50.58 us",
        "https://github.com/dstackai/dstack/pull/3961",
    ),
    "horovod_bench": (
        "Horovod, docs/benchmarks.rst: how to reproduce the 512-GPU figure (tf_cnn_benchmarks, ResNet-101, batch 64), "
        "with an example output of 16 GPUs: total images/sec 1656.82 (hardware not stated)",
        "https://github.com/horovod/horovod/blob/master/docs/benchmarks.rst",
    ),
    "horovod": (
        "Horovod README: 128 servers with 4 Pascal GPUs each, RoCE-capable 25 Gbit/s network: 90% scaling efficiency "
        "for Inception V3 and ResNet-101, 68% for VGG-16 (Sergeev and Del Balso, arXiv:1802.05799)",
        "https://github.com/horovod/horovod/blob/master/README.rst",
    ),
}

# Per-GPU step times (seconds) and gradient bytes.
RESNET50_PARAMS = 25.6e6
BERT_BASE_PARAMS = 110e6
BERT_LARGE_PARAMS = 340e6
RESNET50_STEP = 256 / 2375.0  # dle_resnet50_tf, mixed precision + XLA, batch 256 on one A100
BERT_BASE_BATCH = 64  # assumption: sequences of 128 per GPU per step
# Assumption: BERT-base runs BERT-large's sequences/s times 340/110 (compute ~ 6 x params x tokens).
BERT_BASE_STEP = BERT_BASE_BATCH / (485.59 * BERT_LARGE_PARAMS / BERT_BASE_PARAMS)
ALPHA = 50.58e-6 / (2 * (16 - 1))  # dstack_3961: one 8-byte all-reduce on 16 GPUs = 2(N-1) ring steps
BUCKET = 25 * MiB  # assumption: DDP's 25 MB buckets, one collective each

FABRICS = [
    # (name, GPUs, bus bandwidth in bytes/s, source, how)
    ("8 GPUs, one node (NVSwitch)", 8, 230.77e9, "nccl_527", "published, 8x A100"),
    ("64 GPUs, 100 Gb/s per node", 64, 7e9, "nccl_235", "published 6-8 GB/s at 64-256 GPUs; midpoint"),
    ("64 GPUs, 400 Gb/s per node", 64, 29.61e9, "nccl_527", "published at 32 GPUs; assumed at 64"),
    ("512 GPUs, 100 Gb/s per node", 512, 7e9, "nccl_235", "published at 64-256 GPUs; assumed at 512"),
    ("512 GPUs, 400 Gb/s per node", 512, 29.61e9, "nccl_527", "published at 32 GPUs; assumed at 512"),
]

MODELS = [
    # (name, gradient bytes, step seconds)
    ("ResNet-50, fp32 gradients", 4 * RESNET50_PARAMS, RESNET50_STEP),
    ("ResNet-50, fp16 gradients", 2 * RESNET50_PARAMS, RESNET50_STEP),
    ("BERT-base, fp32 gradients", 4 * BERT_BASE_PARAMS, BERT_BASE_STEP),
    ("BERT-base, fp16 gradients", 2 * BERT_BASE_PARAMS, BERT_BASE_STEP),
]
OVERLAPS = (0.0, 0.5, 0.9)


def predictions():
    rows = []
    for model, nbytes, compute in MODELS:
        for fabric, n, busbw, _, _ in FABRICS:
            calls = math.ceil(nbytes / BUCKET)
            ar = all_reduce_seconds(nbytes, n, busbw, ALPHA, calls)
            rows.append(
                {
                    "model": model,
                    "fabric": fabric,
                    "gpus": n,
                    "gradient_MB": nbytes / 1e6,
                    "compute_ms": compute * 1e3,
                    "all_reduce_ms": ar * 1e3,
                    "efficiency": {str(f): efficiency(compute, ar, f) for f in OVERLAPS},
                }
            )
    return rows


def published_check():
    """The model against the one published multi-GPU figure in the same source: ResNet-50 on 8 A100s."""
    out = []
    for label, per_gpu, eight, weak in (
        ("mixed precision + XLA", 2375.0, 17400.0, 7.32),
        ("TF32 + XLA", 909.0, 7000.0, 7.70),
    ):
        compute = 256 / per_gpu
        ar = all_reduce_seconds(4 * RESNET50_PARAMS, 8, 230.77e9, ALPHA, math.ceil(4 * RESNET50_PARAMS / BUCKET))
        out.append(
            {
                "config": f"ResNet-50 v1.5, 8x A100, {label}",
                "published": eight / (8 * per_gpu),
                "published_weak_scaling": weak,
                "model_f0": efficiency(compute, ar, 0.0),
            }
        )
    return out


HOROVOD_EXAMPLE_IMG_S = 1656.82  # horovod_bench: example output, 16 GPUs, ResNet-101, batch 64 per GPU
# The published multi-node figures reach this share of their line rate: 7 of 12.5 GB/s, 29.61 of 50.
LINE_RATE_SHARE = (7e9 / 12.5e9 + 29.61e9 / 50e9) / 2


def horovod():
    """Horovod's 512 GPUs (128 x 4 Pascal, 25 Gb/s per server), ResNet-101 with fp32 gradients.

    ResNet-101: 44.7 M parameters (keras.applications.ResNet101). The step time is an assumption:
    the example output on Horovod's benchmarks page (16 GPUs, batch 64: 1656.82 img/s, hardware not
    stated) taken as the Pascal GPUs' own. The bus bandwidth is the line rate, 25 Gb/s = 3.125 GB/s
    per server (an upper bound), or the share of it the published 100 and 400 Gb/s figures reach.
    Also the shortest step that still scales at 90% under the model.
    """
    nbytes = 4 * 44.7e6
    n = 512
    compute = 64 / (HOROVOD_EXAMPLE_IMG_S / 16)
    out = []
    for label, busbw in (
        ("line rate, 3.125 GB/s", 3.125e9),
        (f"{LINE_RATE_SHARE * 100:.0f}% of line rate, {LINE_RATE_SHARE * 3.125:.2f} GB/s", LINE_RATE_SHARE * 3.125e9),
    ):
        ar = all_reduce_seconds(nbytes, n, busbw, ALPHA, math.ceil(nbytes / BUCKET))
        need = {}
        for f in OVERLAPS:
            # Smallest compute c with efficiency(c, ar, f) >= 0.9; efficiency grows with c.
            lo, hi = 1e-4, 100.0
            for _ in range(200):
                mid = (lo + hi) / 2
                lo, hi = (mid, hi) if efficiency(mid, ar, f) < 0.9 else (lo, mid)
            need[str(f)] = hi
        out.append(
            {
                "busbw": label,
                "all_reduce_ms": ar * 1e3,
                "compute_ms": compute * 1e3,
                "efficiency": {str(f): efficiency(compute, ar, f) for f in OVERLAPS},
                "min_step_ms_for_90pct": {k: v * 1e3 for k, v in need.items()},
            }
        )
    return out


def knobs():
    """What each knob buys, for BERT-base (fp32 gradients) and ResNet-50 at a few scales."""
    rows = []
    cases = [
        ("ResNet-50", 4 * RESNET50_PARAMS, RESNET50_STEP, FABRICS[0]),
        ("ResNet-50", 4 * RESNET50_PARAMS, RESNET50_STEP, FABRICS[3]),
        ("BERT-base", 4 * BERT_BASE_PARAMS, BERT_BASE_STEP, FABRICS[2]),
        ("BERT-base", 4 * BERT_BASE_PARAMS, BERT_BASE_STEP, FABRICS[3]),
    ]
    for model, nbytes, compute, (fabric, n, busbw, _, _) in cases:

        def eff(nb=nbytes, bucket=BUCKET, f=0.0, k=1, n=n, busbw=busbw, compute=compute):
            ar = all_reduce_seconds(nb, n, busbw, ALPHA, math.ceil(nb / bucket))
            return efficiency(compute, ar, f, accumulation=k)

        rows.append(
            {
                "case": f"{model}, {fabric}",
                "baseline (25 MB buckets, f=0)": eff(),
                "1 MB buckets": eff(bucket=1 * MiB),
                "fp16 compression": eff(nb=nbytes / 2),
                "accumulation k=4": eff(k=4),
                "f=0.9": eff(f=0.9),
                "fp16 + k=4 + f=0.9": eff(nb=nbytes / 2, f=0.9, k=4),
            }
        )
    return rows


# ----------------------------------------------------------------------------------------------
# Tables


def _fmt(x, digits=1):
    return f"{x:.{digits}f}"


def calibration_table(rows):
    lines = [
        "| figure | run | measured ms | spread | model ms | model / measured | role |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        digits = 2 if r["measured_ms"] < 10 else 1
        spread = f"{r['spread'] * 100:.0f}%" if r["spread"] is not None else ""
        lines.append(
            f"| {r['figure']} | {r['source']} | {_fmt(r['measured_ms'], digits)} | {spread} | "
            f"{_fmt(r['predicted_ms'], digits)} | {r['ratio']:.2f} | {r['role']} |"
        )
    return "\n".join(lines)


def parameters_table(params):
    return "\n".join(
        [
            "| parameter | value | from |",
            "|---|---|---|",
            f"| alpha (one ring step, loopback gRPC) | {params['alpha_s'] * 1e3:.3f} ms | an 8-float all-reduce, all_reduce.json |",
            f"| B between 2 workers (bus bandwidth) | {params['busbw_net_Bps'] / 1e6:.0f} MB/s | 64 MiB keras-dist gradient all-reduce, default packs, all_reduce.json |",
            f"| B between 2 replicas in one process | {params['busbw_local_Bps'] / 1e6:.0f} MB/s | MLP 1x2 all-reduce part, profile_step.json |",
            f"| MLP compute + overhead, 1x1 | {params['t1x1_s']['mlp'] * 1e3:.2f} ms | suite_one_collective.json |",
            f"| CNN compute + overhead, 1x1 | {params['t1x1_s']['cnn'] * 1e3:.1f} ms | suite_one_collective.json |",
            f"| per-step overhead on workers, not network | {params['worker_overhead_s'] * 1e3:.2f} ms | MLP 2x1 minus the model's other terms |",
            f"| gradient bytes, MLP / CNN | {params['mlp_bytes']:,} / {params['cnn_bytes']:,} | float32, counted from the layers |",
        ]
    )


def predictions_table(rows):
    lines = [
        "| model | fabric | gradient MB | compute ms | all-reduce ms | efficiency f=0 | f=0.5 | f=0.9 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        e = r["efficiency"]
        lines.append(
            f"| {r['model']} | {r['fabric']} | {r['gradient_MB']:.1f} | {r['compute_ms']:.1f} | {r['all_reduce_ms']:.1f} | "
            + " | ".join(f"{e[str(f)] * 100:.0f}%" for f in OVERLAPS)
            + " |"
        )
    return "\n".join(lines)


def published_table(rows):
    lines = ["| configuration | published efficiency | model, f=0 |", "|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['config']} | {r['published'] * 100:.1f}% ({r['published_weak_scaling']:.2f}x) | {r['model_f0'] * 100:.1f}% |"
        )
    return "\n".join(lines)


def horovod_table(rows):
    lines = [
        "| bus bandwidth assumed | all-reduce ms | step ms (assumed) | efficiency f=0 | f=0.5 | f=0.9 "
        "| shortest step for 90%, f=0 | f=0.5 | f=0.9 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        e, m = r["efficiency"], r["min_step_ms_for_90pct"]
        lines.append(
            f"| {r['busbw']} | {r['all_reduce_ms']:.0f} | {r['compute_ms']:.0f} | "
            + " | ".join(f"{e[str(f)] * 100:.0f}%" for f in OVERLAPS)
            + " | "
            + " | ".join(f"{m[str(f)]:.0f} ms" for f in OVERLAPS)
            + " |"
        )
    return "\n".join(lines)


def knobs_table(rows):
    keys = [k for k in rows[0] if k != "case"]
    lines = ["| case | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
    for r in rows:
        lines.append(f"| {r['case']} | " + " | ".join(f"{r[k] * 100:.0f}%" for k in keys) + " |")
    return "\n".join(lines)


def sources_list():
    return "\n".join(f"- {text}: <{url}>" for text, url in SOURCES.values())


def everything():
    params, rows = calibrate()
    return {
        "parameters": params,
        "calibration": rows,
        "predictions": predictions(),
        "published_check": published_check(),
        "horovod": horovod(),
        "knobs": knobs(),
        "sources": {k: {"what": t, "url": u} for k, (t, u) in SOURCES.items()},
    }


def tables(data=None):
    d = data or everything()
    return {
        "parameters": parameters_table(d["parameters"]),
        "calibration": calibration_table(d["calibration"]),
        "predictions": predictions_table(d["predictions"]),
        "published_check": published_table(d["published_check"]),
        "horovod": horovod_table(d["horovod"]),
        "knobs": knobs_table(d["knobs"]),
        "sources": sources_list(),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="write the tables' numbers to this file")
    args = parser.parse_args()
    data = everything()
    for name, text in tables(data).items():
        print(f"\n## {name}\n\n{text}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(data, f, indent=2)


if __name__ == "__main__":
    main()
