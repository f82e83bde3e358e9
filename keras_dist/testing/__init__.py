"""Helpers for testing code that uses keras-dist (shipped, importable by users' tests).

Owns: simulated CPU devices for tests (`simulate_cpu_devices`), numeric
comparisons against one device (`assert_matches_single_device`,
`max_weight_difference`), and worker processes for multi-worker tests
(`clean_env`, `run_workers`, `run_launcher`).
Nothing in the library imports this package.
"""

from keras_dist._runtime.devices import simulate_cpu_replicas as simulate_cpu_devices
from keras_dist.testing._compare import SingleDeviceComparison, assert_matches_single_device, max_weight_difference
from keras_dist.testing._workers import (
    LauncherResult,
    WorkerResult,
    WorkersResult,
    clean_env,
    run_launcher,
    run_workers,
)

__all__ = [
    "LauncherResult",
    "SingleDeviceComparison",
    "WorkerResult",
    "WorkersResult",
    "assert_matches_single_device",
    "clean_env",
    "max_weight_difference",
    "run_launcher",
    "run_workers",
    "simulate_cpu_devices",
]
