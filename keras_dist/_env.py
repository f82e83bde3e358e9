"""Base layer: the name of every `KERAS_DIST_*` environment variable keras_dist reads or sets.

Owns: the names (one constant each) and, for each, who sets it and who reads it.
Every module of keras_dist takes the names from here, so a name is spelled out
once. Must not: import anything (TensorFlow and Keras included): the
`keras-dist` launcher reads these names without loading TensorFlow.

What happens on each worker: every worker reads its own environment; nothing
here is exchanged between workers.

Example:
>>> STARTUP_TIMEOUT_ENV
'KERAS_DIST_STARTUP_TIMEOUT'
>>> all(name.startswith(PREFIX) for name in ALL)
True
"""

PREFIX = "KERAS_DIST_"

# Set by `keras-dist launch --cpu-replicas`, or by the user; applied at `import keras_dist`
# (keras_dist._runtime.devices): this many simulated CPU replicas.
CPU_REPLICAS_ENV = "KERAS_DIST_CPU_REPLICAS"
# Set by `keras-dist launch` (the cores shared out) or the user; applied at `import keras_dist`
# (keras_dist._runtime.threads): TensorFlow's intra-op and inter-op pool sizes.
INTRA_OP_THREADS_ENV = "KERAS_DIST_INTRA_OP_THREADS"
INTER_OP_THREADS_ENV = "KERAS_DIST_INTER_OP_THREADS"
# Multi-worker timeouts in seconds (keras_dist.strategy._resolve.timeouts_from_environment);
# `keras-dist launch --startup-timeout/--heartbeat-timeout/--collective-timeout` sets them.
STARTUP_TIMEOUT_ENV = "KERAS_DIST_STARTUP_TIMEOUT"
HEARTBEAT_TIMEOUT_ENV = "KERAS_DIST_HEARTBEAT_TIMEOUT"
COLLECTIVE_TIMEOUT_ENV = "KERAS_DIST_COLLECTIVE_TIMEOUT"
# Seconds (default 60, 0 = off) a worker may wait for another that does not reach the next collective
# before every worker fails naming it (keras_dist.monitor._stall); `keras-dist launch --stall-timeout`.
STALL_TIMEOUT_ENV = "KERAS_DIST_STALL_TIMEOUT"
# `0` skips joining the cluster at `import keras_dist` (keras_dist.strategy._resolve).
JOIN_AT_IMPORT_ENV = "KERAS_DIST_JOIN_AT_IMPORT"
# First port of the cluster built from SLURM's variables (keras_dist.strategy._cluster); default 8888.
SLURM_PORT_BASE_ENV = "KERAS_DIST_SLURM_PORT_BASE"
# Seconds the workers wait for the chief's writes (keras_dist.callbacks._coordination); default 120.
WRITE_TIMEOUT_ENV = "KERAS_DIST_WRITE_TIMEOUT"
# Set by `keras-dist launch`: 0 on the first start, then 1, 2, ... after each restart.
RESTART_COUNT_ENV = "KERAS_DIST_RESTART_COUNT"
# Set by a local `keras-dist launch`: the worker's slot (its task index at the first start; kept when an
# elastic launch drops a slot and renumbers the others).
WORKER_SLOT_ENV = "KERAS_DIST_WORKER_SLOT"
# Comma-separated names of compatibility fixes to switch off (keras_dist._compat.keras_fixes).
DISABLE_FIXES_ENV = "KERAS_DIST_DISABLE_FIXES"
# `all`, or comma-separated names of fixes to keep on outside their verified versions (keras_dist._compat).
FORCE_FIXES_ENV = "KERAS_DIST_FORCE_FIXES"
# Non-empty: the chief does not print the distribution plan (keras_dist.strategy._plan, keras_dist.data).
QUIET_ENV = "KERAS_DIST_QUIET"
# A directory: every `DistributedModel.fit` gets a `keras_dist.callbacks.Timeline(directory)` (each worker
# writes timeline-<task_type>-<task_id>.json; the chief prints the straggler report), keras_dist.callbacks._timeline.
TIMELINE_ENV = "KERAS_DIST_TIMELINE"
# Test harness only (set by tests/conftest.py): a directory for zygote servers (keras_dist._zygote), each of
# which imported TensorFlow once; `keras-dist launch` and `keras_dist.testing.run_workers` fork workers from them.
ZYGOTE_ENV = "KERAS_DIST_ZYGOTE"

ALL = (
    CPU_REPLICAS_ENV,
    INTRA_OP_THREADS_ENV,
    INTER_OP_THREADS_ENV,
    STARTUP_TIMEOUT_ENV,
    HEARTBEAT_TIMEOUT_ENV,
    COLLECTIVE_TIMEOUT_ENV,
    STALL_TIMEOUT_ENV,
    JOIN_AT_IMPORT_ENV,
    SLURM_PORT_BASE_ENV,
    WRITE_TIMEOUT_ENV,
    RESTART_COUNT_ENV,
    WORKER_SLOT_ENV,
    DISABLE_FIXES_ENV,
    FORCE_FIXES_ENV,
    QUIET_ENV,
    TIMELINE_ENV,
    ZYGOTE_ENV,
)
