"""`CommunicationOptions`: the knobs of the gradient all-reduce, as Horovod and DDP users expect them."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, TypeAlias

import tensorflow as tf

IMPLEMENTATIONS = ("auto", "ring", "nccl")
COMPRESSIONS = (None, "fp16", "bf16")
SPARSE_GRADIENTS = ("rows", "dense")
_TF_IMPLEMENTATIONS = {
    "auto": tf.distribute.experimental.CommunicationImplementation.AUTO,
    "ring": tf.distribute.experimental.CommunicationImplementation.RING,
    "nccl": tf.distribute.experimental.CommunicationImplementation.NCCL,
}
_DTYPES: dict[str | None, Any] = {"fp16": tf.float16, "bf16": tf.bfloat16}
AUTO_BYTES_PER_PACK_BETWEEN_CPU_WORKERS = 8 * 2**20  # bytes; see `CommunicationOptions.bytes_per_pack`.
_TF_OPTIONS_TYPE = type(tf.distribute.experimental.CommunicationOptions())  # a factory, not the class
# What `communication=` accepts everywhere (`CommunicationOptions.from_value`); a string, because
# TensorFlow's `CommunicationOptions` is a factory function at run time.
CommunicationValue: TypeAlias = (
    "CommunicationOptions | tf.distribute.experimental.CommunicationOptions | dict[str, Any] | None"
)


@dataclasses.dataclass(frozen=True)
class CommunicationOptions:
    """How `DistributedModel` all-reduces gradients across replicas.

    The first three fields are TensorFlow's own
    (`tf.distribute.experimental.CommunicationOptions`); `compression` is
    keras-dist's.

    Args:
        implementation: String, the collective implementation under
            `MultiWorkerMirroredStrategy`: `"auto"` (TensorFlow chooses:
            NCCL on GPUs, ring otherwise), `"ring"` (gRPC ring, CPUs and
            between hosts) or `"nccl"` (GPUs only). `MirroredStrategy` on one
            worker uses its own cross-device ops (NCCL on GPUs) and ignores it.
            Defaults to `"auto"`.
        bytes_per_pack: Integer, in bytes, or `"auto"`: the size of the
            windows (DDP's buckets) the dense gradients are summed in. The
            gradients are read as one stream, the last layer's first, and
            cut into windows of exactly this many bytes, each summed by one
            collective in that order; a gradient larger than a window spans
            several, and the side values (example counts, checks, metric
            sums) ride in the last window (`keras_dist/collectives/_windows.py`).
            Windows change which values travel together, never a sum. `0`:
            TensorFlow's default, everything in one collective. `"auto"` is
            `AUTO_BYTES_PER_PACK_BETWEEN_CPU_WORKERS` (8 MiB) under
            `MultiWorkerMirroredStrategy` on CPUs (gRPC ring), where 8 MiB
            messages are summed faster than larger ones between 2 local
            workers (`benchmarks/all_reduce.py`: 64 MB of float32 as 16
            tensors, 1.4x-1.7x faster than one collective in three runs; as
            one tensor, 1.8x), and `0` elsewhere (NCCL, one machine), where
            nothing was measured. Small windows cost one collective's latency
            each (about 1.5 ms between CPU workers). Defaults to `"auto"`.
        timeout_seconds: Float, in seconds, or `None`: a collective that
            does not complete in time fails with `DeadlineExceededError`
            instead of waiting forever (multi-worker only). Defaults to `None`.
        compression: `None`, `"fp16"` or `"bf16"`: floating-point gradients
            are cast to this dtype for the all-reduce and back to their own
            dtype after it, halving the bytes sent for float32 gradients. The
            sum is computed in the compressed dtype (what is sent is what is
            summed, as in Horovod's fp16 compression): fp16 keeps 11
            significant bits and overflows beyond 65504, bf16 keeps float32's
            range with 8 significant bits. Defaults to `None`.
        sparse_gradients: `"rows"` or `"dense"`: how `tf.IndexedSlices`
            gradients (an `Embedding`'s) travel and accumulate. `"rows"`:
            all-gathered as rows (one device's rows, see docs/communication.md)
            and, under gradient accumulation, summed as rows merged by index;
            bytes and memory grow with the rows a step touches, not with the
            table. `"dense"`: converted to dense tensors of the table's shape
            first (repeated rows summed, as `tf.convert_to_tensor` does), then
            all-reduced, compressed and accumulated as dense gradients; the
            update is then that of the dense gradient, which for Adam-like
            optimizers differs from one device's row-by-row update where ids
            repeat (without accumulation). Defaults to `"rows"`.

    Raises:
        ValueError: A field is outside the values above.

    Example:
    >>> import keras_dist
    >>> options = keras_dist.CommunicationOptions(implementation="ring", compression="fp16")
    >>> options.describe()
    'RING, pack auto, no timeout, fp16 compression'

    References:
        TF API `tf.distribute.experimental.CommunicationOptions`; Horovod
        `hvd.Compression.fp16`; Sergeev and Del Balso, "Horovod: fast and easy
        distributed deep learning in TensorFlow", 2018.
    """

    implementation: str = "auto"
    bytes_per_pack: int | Literal["auto"] = "auto"
    timeout_seconds: float | None = None
    compression: str | None = None
    sparse_gradients: str = "rows"

    def __post_init__(self) -> None:
        if self.implementation not in IMPLEMENTATIONS:
            raise ValueError(
                f"`implementation` must be one of {IMPLEMENTATIONS}. Received: implementation={self.implementation!r}."
            )
        if self.bytes_per_pack != "auto" and (
            not isinstance(self.bytes_per_pack, int) or isinstance(self.bytes_per_pack, bool) or self.bytes_per_pack < 0
        ):
            raise ValueError(
                "`bytes_per_pack` must be an integer number of bytes >= 0 (0: one pack, TensorFlow's default) "
                "or 'auto' (8 MiB between CPU workers, else 0). "
                f"Received: bytes_per_pack={self.bytes_per_pack!r}."
            )
        if self.timeout_seconds is not None and not (
            isinstance(self.timeout_seconds, (int, float)) and self.timeout_seconds > 0
        ):
            raise ValueError(
                "`timeout_seconds` must be a number of seconds > 0, or None for no timeout. "
                f"Received: timeout_seconds={self.timeout_seconds!r}."
            )
        if self.compression not in COMPRESSIONS:
            raise ValueError(
                f"`compression` must be one of {COMPRESSIONS}. Received: compression={self.compression!r}."
            )
        if self.sparse_gradients not in SPARSE_GRADIENTS:
            raise ValueError(
                f"`sparse_gradients` must be one of {SPARSE_GRADIENTS}. "
                f"Received: sparse_gradients={self.sparse_gradients!r}. Fix: 'rows' (the default) keeps an "
                "Embedding's gradient as rows; 'dense' densifies it."
            )

    @classmethod
    def from_value(cls, value: CommunicationValue) -> CommunicationOptions:
        """Returns `CommunicationOptions` from `None`, itself, a TF `CommunicationOptions` or a dict.

        Raises:
            TypeError: `value` is none of these.
        """
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, dict):
            return cls(**value)
        if isinstance(value, _TF_OPTIONS_TYPE):
            names = {v: k for k, v in _TF_IMPLEMENTATIONS.items()}
            return cls(
                implementation=names[value.implementation],
                bytes_per_pack=int(value.bytes_per_pack),
                timeout_seconds=value.timeout_seconds,
            )
        raise TypeError(
            "`communication` must be a keras_dist.CommunicationOptions, a "
            "tf.distribute.experimental.CommunicationOptions, a dict of their fields, or None. "
            f"Received: {type(value).__name__}."
        )

    def resolved(self, strategy: tf.distribute.Strategy) -> CommunicationOptions:
        """Returns these options with `bytes_per_pack="auto"` replaced by its value under `strategy`.

        Args:
            strategy: The `tf.distribute.Strategy` the all-reduce runs under.

        Returns:
            A `CommunicationOptions` whose `bytes_per_pack` is an integer:
            `AUTO_BYTES_PER_PACK_BETWEEN_CPU_WORKERS` under
            `MultiWorkerMirroredStrategy` when this worker's replicas are CPUs
            and `implementation` is not `"nccl"`, else `0`.
        """
        if self.bytes_per_pack != "auto":
            return self
        from keras_dist._runtime import variables

        between_cpu_workers = (
            variables.is_multi_worker(strategy)
            and self.implementation != "nccl"
            and all(tf.DeviceSpec.from_string(d).device_type == "CPU" for d in strategy.extended.worker_devices)
        )
        return dataclasses.replace(
            self, bytes_per_pack=AUTO_BYTES_PER_PACK_BETWEEN_CPU_WORKERS if between_cpu_workers else 0
        )

    def to_tensorflow(self) -> tf.distribute.experimental.CommunicationOptions:
        """Returns the `tf.distribute.experimental.CommunicationOptions` of the first three fields (`"auto"` packing: 0)."""
        return tf.distribute.experimental.CommunicationOptions(
            bytes_per_pack=0 if self.bytes_per_pack == "auto" else self.bytes_per_pack,
            timeout_seconds=self.timeout_seconds,
            implementation=_TF_IMPLEMENTATIONS[self.implementation],
        )

    @property
    def compressed_dtype(self) -> tf.DType | None:
        """The `tf.DType` gradients travel in, or `None` without compression."""
        return _DTYPES.get(self.compression)

    def describe(self, strategy: tf.distribute.Strategy | None = None) -> str:
        """Returns one line for the plan, e.g. `'RING, pack 4194304 bytes, timeout 30 s, no compression'`.

        Args:
            strategy: Optional `tf.distribute.Strategy`: when given, `bytes_per_pack="auto"`
                also shows what it resolves to there (`'pack auto (8388608 bytes)'` between
                CPU workers, `'pack auto (one pack)'` elsewhere; see `resolved`).
        """
        pack = _describe_pack(self.bytes_per_pack)
        if self.bytes_per_pack == "auto" and strategy is not None:
            pack = f"{pack} ({_describe_pack(self.resolved(strategy).bytes_per_pack).removeprefix('pack ')})"
        timeout = "no timeout" if self.timeout_seconds is None else f"timeout {self.timeout_seconds:g} s"
        compression = "no compression" if self.compression is None else f"{self.compression} compression"
        sparse = ", sparse gradients dense" if self.sparse_gradients == "dense" else ""
        return f"{self.implementation.upper()}, {pack}, {timeout}, {compression}{sparse}"


def _describe_pack(bytes_per_pack: int | str) -> str:
    """`'pack auto'`, `'one pack'` (0) or `'pack N bytes'`."""
    return {"auto": "pack auto", 0: "one pack"}.get(bytes_per_pack, f"pack {bytes_per_pack} bytes")
