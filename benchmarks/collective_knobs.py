"""TensorFlow's own knobs for the gRPC ring between CPU workers: which ones move 64 MB faster (issue 23 item 2).

A benchmark, not a test: it prints what this run measured and writes JSON (`--json`), asserting
nothing about speed. Each variant runs in its own pair of worker processes on loopback (the
knobs are fixed when TensorFlow's server starts), variants interleaved over `--rounds` rounds,
median reported. Every variant sums 64 MB of float32 in 16 tensors of 4 MB, one collective per
tensor (`CollectiveReduceV2`, what keras-dist's 4 MiB windows launch), one intra-op and one
inter-op thread per worker (the launcher's share of 2 cores):

  default                    TensorFlow 2.x as MultiWorkerMirroredStrategy configures it
  recv_buf_max_chunk=-1      `ConfigProto.experimental.recv_buf_max_chunk`: one protobuf field per
                             RecvBuf response instead of 4 KB chunks
  recv_buf_max_chunk=1MiB    the same, 1 MiB chunks
  num_channels_per_target=4  `RPCOptions.num_channels_per_target`: 4 gRPC channels per peer
  max_subdivs_per_device=1   the ring's subdivisions per collective (`CollectiveReduceV2` attribute)
  unordered (V1 ops)         `CollectiveReduce` (V1), which automatic control dependencies do not
                             chain, so the 16 collectives run concurrently; V2 collectives in one
                             `tf.function` run one after the other (they are stateful)
  grpc: ...                  gRPC channel arguments through `TF_GRPC_DEFAULT_OPTIONS`, which
                             TensorFlow reads when it creates its channels: 16 MB HTTP/2 frames
                             (`grpc.http2.max_frame_size`), a 64 MB flow-control window
                             (`grpc.http2.lookahead_bytes`), 4 MB TCP reads
                             (`grpc.experimental.tcp_*read_chunk_size`), no BDP probing
                             (`grpc.http2.bdp_probe=0`), and the first three together

It also reports the CPU time both workers spent per second of wall time (`os.times`) in the
default variant: near 2.0 means the all-reduce itself keeps both cores of this machine busy.

    python benchmarks/collective_knobs.py [--rounds 3] [--json out.json]

About 4 minutes on 2 CPU cores. The knobs are private TensorFlow configuration (set through
`context.context()._config` before the strategy starts); keras-dist sets none of them.
"""

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys

WORKER = r"""
import json, os, sys, time
variant = sys.argv[1]
import tensorflow as tf
from tensorflow.core.protobuf import config_pb2
from tensorflow.python.eager import context

tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
config = config_pb2.ConfigProto()
if variant == "recv_buf_max_chunk=-1":
    config.experimental.recv_buf_max_chunk = -1
elif variant == "recv_buf_max_chunk=1MiB":
    config.experimental.recv_buf_max_chunk = 2**20
elif variant == "num_channels_per_target=4":
    config.rpc_options.num_channels_per_target = 4
context.context()._config = config
strategy = tf.distribute.MultiWorkerMirroredStrategy()
task = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
values = [tf.ones([2**20]) for _ in range(16)]  # 16 x 4 MB float32


def collectives():
    with tf.device(f"/job:worker/replica:0/task:{task}/device:CPU:0"):
        if variant == "unordered (V1 ops)":
            return [
                tf.raw_ops.CollectiveReduce(input=v, group_size=2, group_key=98, instance_key=5000 + i, merge_op="Add",
                                            final_op="Id", subdiv_offsets=[0], communication_hint="ring")
                for i, v in enumerate(values)
            ]
        subdivs = 1 if variant == "max_subdivs_per_device=1" else -1
        return [
            tf.raw_ops.CollectiveReduceV2(input=v, group_size=2, group_key=99, instance_key=1000 + i, ordering_token=[],
                                          merge_op="Add", final_op="Id", communication_hint="ring",
                                          max_subdivs_per_device=subdivs)
            for i, v in enumerate(values)
        ]


step = tf.function(collectives)
for _ in range(2):
    step()
start, cpu = time.perf_counter(), os.times()
for _ in range(int(sys.argv[2])):
    step()[0].numpy()
wall, after = time.perf_counter() - start, os.times()
print(json.dumps({"seconds": wall / int(sys.argv[2]), "cpu_per_wall": (after.user - cpu.user + after.system - cpu.system) / wall}))
"""

_READS = (
    "grpc.experimental.tcp_read_chunk_size=4194304,grpc.experimental.tcp_min_read_chunk_size=1048576,"
    "grpc.experimental.tcp_max_read_chunk_size=16777216"
)
# Variants run as "default" with these gRPC channel arguments (TF_GRPC_DEFAULT_OPTIONS, "name=value,...").
GRPC_VARIANTS = {
    "grpc: 16 MB frames": "grpc.http2.max_frame_size=16777215",
    "grpc: 64 MB window": "grpc.http2.lookahead_bytes=67108864",
    "grpc: 4 MB reads": _READS,
    "grpc: no BDP probe": "grpc.http2.bdp_probe=0",
    "grpc: frames+window+reads": f"grpc.http2.max_frame_size=16777215,grpc.http2.lookahead_bytes=67108864,{_READS}",
}
VARIANTS = [
    "default",
    "recv_buf_max_chunk=-1",
    "recv_buf_max_chunk=1MiB",
    "num_channels_per_target=4",
    "max_subdivs_per_device=1",
    "unordered (V1 ops)",
    *GRPC_VARIANTS,
]


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_two_workers(script, args, timeout, extra_env=None):
    """Runs `python -c script *args` as 2 fresh local workers of one cluster; returns both stdouts.

    Each worker gets its own `TF_CONFIG` (a 2-worker cluster on free loopback ports) and
    `TF_CPP_MIN_LOG_LEVEL=3`; both are killed when they end, fail or time out.

    Raises:
        RuntimeError: a worker exited with a non-zero status (its stderr's tail in the message).
        subprocess.TimeoutExpired: past `timeout` seconds.
    """
    cluster = {"worker": [f"127.0.0.1:{_free_port()}" for _ in range(2)]}
    procs = []
    for index in range(2):
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", **(extra_env or {}))
        env["TF_CONFIG"] = json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}})
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", script, *args],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    try:
        outputs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, (_, err) in zip(procs, outputs):
        if p.returncode != 0:
            raise RuntimeError(f"{args!r}: a worker exited with {p.returncode}: {err[-2000:]}")
    return [out for out, _ in outputs]


def run_variant(variant, calls, timeout=300):
    """Runs one variant on 2 fresh local workers; returns `(seconds per 64 MB all-reduce, CPU s per wall s, both workers)`.

    Raises:
        RuntimeError: a worker failed (its stderr's tail in the message).
        subprocess.TimeoutExpired: past `timeout` seconds (both workers are killed first).
    """
    grpc = GRPC_VARIANTS.get(variant)
    extra_env = {"TF_GRPC_DEFAULT_OPTIONS": grpc} if grpc else None
    outputs = run_two_workers(WORKER, ["default" if grpc else variant, str(calls)], timeout, extra_env)
    results = [json.loads(out.strip().splitlines()[-1]) for out in outputs]
    return results[0]["seconds"], sum(r["cpu_per_wall"] for r in results)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--rounds", type=int, default=3, help="interleaved rounds (a fresh worker pair per variant and round)"
    )
    parser.add_argument("--calls", type=int, default=8, help="timed 64 MB all-reduces per run")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    load_start = os.getloadavg()
    times = {v: [] for v in VARIANTS}
    cpu = {v: [] for v in VARIANTS}
    for _ in range(args.rounds):
        for variant in VARIANTS:
            seconds, cpu_per_wall = run_variant(variant, args.calls)
            times[variant].append(seconds)
            cpu[variant].append(cpu_per_wall)
    size = 64 * 2**20
    default = statistics.median(times["default"])
    results = {"load_average_start": load_start, "load_average_end": os.getloadavg(), "variants": {}}
    print("64 MB float32 as 16 collectives of 4 MB, 2 workers x 1 CPU replica on loopback")
    print(f"{'variant':<30}{'seconds':>9}{'MB/s':>8}{'vs default':>12}{'CPU s / wall s (2 workers)':>28}")
    for variant in VARIANTS:
        seconds = statistics.median(times[variant])
        results["variants"][variant] = {
            "seconds": seconds,
            "all_rounds": times[variant],
            "busbw_MBps": size / seconds / 2**20,
            "cpu_per_wall_both_workers": statistics.median(cpu[variant]),
        }
        print(
            f"{variant:<30}{seconds:>9.4f}{size / seconds / 2**20:>8.0f}{default / seconds:>11.2f}x"
            f"{statistics.median(cpu[variant]):>28.2f}"
        )
    print(f"load average (1, 5, 15 min): {load_start} at the start, {results['load_average_end']} at the end")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
