"""Layer 3: timestamps taken inside the train step at its phase boundaries, for the step timeline.

When the timeline is on (`keras_dist.callbacks.Timeline`), the train step takes
`tf.timestamp()` (the wall clock, seconds since the Unix epoch, microsecond
resolution: the clock `time.time()` reads) on each replica at four boundaries
(`NAMES`): its batch is available (`batch`), its gradients are computed
(`gradients`), the summed gradients are back from the all-reduce
(`all_reduced`), the optimizer has updated the variables (`applied`). Each value
goes into one float64 variable of `len(NAMES)` entries per local replica, on
this worker's host CPU; the Python side reads them after each call of the train
function (`StepMarksBuffer.read`). With the timeline off nothing here is built:
the traced step holds no timestamp op.

Why each timestamp sits in a call of a small nested `tf.function`: inside a
`tf.function` TensorFlow chains every stateful op that takes no resource (a bare
`Timestamp` is one) in program order, and MirroredStrategy traces its replicas
one after the other. A bare timestamp of replica 1 would wait for the later
timestamps of replica 0 (wrong times), and could close a cycle with a collective
that waits for replica 1 (a hang). A call that captures the replica's own
variable is ordered only with the other uses of that variable: its earlier
timestamps.

On GPUs a timestamp runs on the host once the kernels it follows were launched;
they may finish later on the device (the phases are the host's view of the step).
"""

import math

import numpy as np
import tensorflow as tf
from tensorflow.python.ops import resource_variable_ops

NAMES = ("batch", "gradients", "all_reduced", "applied")


class StepMarksBuffer:
    """The timestamps of the last train step, one float64 vector of `len(NAMES)` per local replica.

    Create it outside any `tf.function`, before the train function is traced
    (the step captures its variables). The variables belong to no strategy
    and to no model (they are not saved); entries not reached are NaN at
    first, and keep the previous step's value afterwards (`read`'s caller
    drops values older than the step).

    Args:
        strategy: The `tf.distribute.Strategy` the model trains under (its
            local replicas get one vector each).
    """

    def __init__(self, strategy):
        devices = list(strategy.extended.worker_devices)
        host = tf.DeviceSpec.from_string(devices[0]).replace(device_type="CPU", device_index=0).to_string()
        with tf.init_scope(), tf.device(host):
            # ResourceVariable itself, not tf.Variable: no strategy's variable creator (a `fit` called
            # inside `strategy.scope()` would make a mirrored one, which a replica cannot write alone).
            self.variables = [
                resource_variable_ops.ResourceVariable(
                    np.full(len(NAMES), math.nan), dtype=tf.float64, trainable=False, name="keras_dist_step_marks"
                )
                for _ in devices
            ]
        self._stamp = tf.function(_stamp, autograph=False)

    def recorder(self):
        """Returns a `StepMarks` for the replica being traced, or `None` outside a replica with a static id."""
        context = tf.distribute.get_replica_context()
        if context is None:
            return None
        replica_id = tf.get_static_value(context.replica_id_in_sync_group)
        if replica_id is None:
            return None
        return StepMarks(self, self.variables[int(replica_id) % len(self.variables)])

    def read(self):
        """Returns the last values: a float64 array `(num_local_replicas, len(NAMES))`, seconds since the epoch."""
        return np.stack([variable.numpy() for variable in self.variables])


def _stamp(variable, position):
    variable.scatter_nd_update([[position]], tf.reshape(tf.timestamp(), [1]))


class StepMarks:
    """One replica's timestamps in the step being traced; each name is stamped once (the first call wins)."""

    def __init__(self, buffer, variable):
        self._buffer, self._variable = buffer, variable
        self.stamped = set()

    def stamp(self, name, after):
        """Takes the timestamp `name` (one of `NAMES`) once every tensor of `after` is computed.

        Args:
            name: String, one of `NAMES`.
            after: A structure of tensors, `tf.IndexedSlices`, variables
                (read: the timestamp follows their latest update) or `None`s.
        """
        if name in self.stamped:
            return
        self.stamped.add(name)
        with tf.control_dependencies(_tensors(after)):
            self._buffer._stamp(self._variable, NAMES.index(name))


def _tensors(structure):
    tensors = []
    for value in tf.nest.flatten(structure):
        if value is None:
            continue
        if isinstance(value, tf.IndexedSlices):
            value = value.values
        elif not isinstance(value, tf.Tensor):
            value = tf.convert_to_tensor(value)  # A variable: its value now (this replica's copy).
        tensors.append(value)
    return tensors
