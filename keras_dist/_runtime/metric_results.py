"""`metric.result()` inside a step you write: the result of the metric state summed over the replicas.

keras.io's steps return `{m.name: m.result() for m in self.metrics}`, and some
compute more from a result (`ops.exp(self.loss_tracker.result())` for a
perplexity, `acc * 100`). On a replica, `result()` reads that replica's
state only, so a value computed from it is each replica's own (3.9e-3 to
2.9e-2 off one device in a new-user probe). While a user's step runs on a
replica (`user_steps.user_step(..., metrics=...)`), `result()` of each of
those metrics (and the metrics nested in them) computes the result from the
state summed over the replicas: every replica then sees one device's result,
and whatever the step computes from it is one device's value.

One all-reduce per dtype sums every such metric's sum-aggregated state at
the first `result()` after a write to it (`GlobalResults.summed`); later
`result()` calls of the same step reuse the sums until a metric variable is
written again (`GlobalResults.written`, from `layers._weighted_direct_assign`,
through which every Keras variable write goes). State aggregated otherwise
(a running maximum kept with `aggregation="mean"`) stays the replica's.

`result` is wrapped once on the class that defines it (`installed`); outside
such a step, in cross-replica context, or for a metric the step did not name,
the wrapper calls Keras' own.
"""

import threading

import keras
import tensorflow as tf
from keras import tree

from keras_dist._runtime import step_state

_LOCK = threading.Lock()
_ORIGINAL_RESULT = {}  # class that defines `result` -> its own `result`
_INSIDE = threading.local()  # `.active`: a wrapped `result` is running on this thread (nested results read the sums).


class GlobalResults:
    """One replica step's metrics whose `result()` is the global batch's, and their summed state.

    Args:
        metrics: The metrics (`keras.metrics.Metric`) named by the step
            (`model.metrics`); the metrics nested in them count too.
        options: `tf.distribute.experimental.CommunicationOptions` of the all-reduce.
    """

    def __init__(self, metrics, options):
        self.options = options
        metrics = _with_nested(metrics)
        self.metric_ids = {id(m) for m in metrics}
        variables = {}
        for metric in metrics:
            for v in metric.variables:
                value = getattr(v, "_value", None)
                if (
                    isinstance(value, tf.distribute.DistributedValues)
                    and value.aggregation == tf.VariableAggregation.SUM
                ):
                    variables[id(v)] = v
        self.variables = list(variables.values())
        self._sums = None  # (graph, state mapping) of the last `summed()`, until a metric variable is written.
        self._returned = {}  # `id` -> tensor: what a wrapped `result()` returned in this step (global values).

    def note_returned(self, results):
        """Notes the tensors of `results`, what a metric's `result()` returned from the summed state."""
        for value in tree.flatten(results):
            if tf.is_tensor(value):
                self._returned[id(value)] = value

    def is_returned(self, value):
        """Whether `value` is a tensor a metric's `result()` returned in this step (through identities and casts).

        Read from the traced graph, so every replica decides alike (a run-time
        comparison with the results took a replica's raw loss for one where
        that replica held the whole global batch: a new-user probe, stop 52).
        """
        for _ in range(8):
            if not tf.is_tensor(value):
                return False
            if self._returned.get(id(value)) is value:
                return True
            op = getattr(value, "op", None)
            if op is None or op.type not in ("Identity", "Cast") or not op.inputs:
                return False
            value = op.inputs[0]
        return False

    def written(self, variable):
        """Forgets the sums when `variable` (a `keras.Variable` being assigned) is one of the summed state."""
        if self._sums is not None and any(variable is v for v in self.variables):
            self._sums = None

    def summed(self):
        """`[(variable, tensor)]`: each summed state variable's value summed over the replicas (replica context).

        One all-reduce per dtype (a pack is one tensor: `MeanIoU`'s int64
        confusion matrix cannot share the float32 sums' pack); reused while
        no metric variable is written and the step traces the same graph.
        """
        graph = tf.compat.v1.get_default_graph()
        if self._sums is not None and self._sums[0] is graph:
            return self._sums[1]
        context = tf.distribute.get_replica_context()
        by_dtype = {}
        for v in self.variables:
            by_dtype.setdefault(v._value.dtype, []).append(v)
        mapping = []
        for group in by_dtype.values():
            local = [tf.convert_to_tensor(v.value) for v in group]  # This replica's part of the state.
            flat = tf.concat([tf.reshape(t, [-1]) for t in local], 0)
            summed = tf.stop_gradient(context.all_reduce(tf.distribute.ReduceOp.SUM, flat, options=self.options))
            parts = tf.split(summed, [t.shape.num_elements() for t in local])
            mapping += [
                (v, tf.reshape(p, t.shape if t.shape.is_fully_defined() else tf.shape(t)))
                for v, p, t in zip(group, parts, local)
            ]
        self._sums = (graph, mapping)
        return mapping


def installed(metrics):
    """Wraps `result` of the classes defining it for `metrics` and the metrics nested in them (idempotent)."""
    with _LOCK:
        for metric in _with_nested(metrics):
            owner = next((c for c in type(metric).__mro__ if "result" in vars(c)), None)
            if owner is None or owner in _ORIGINAL_RESULT or owner is object:
                continue
            _ORIGINAL_RESULT[owner] = vars(owner)["result"]
            owner.result = _global_result(_ORIGINAL_RESULT[owner])


def _with_nested(metrics):
    """`metrics` and every metric tracked inside one of them (`Metric._metrics`), once each."""
    seen, pending = {}, list(metrics)
    while pending:
        metric = pending.pop()
        if id(metric) not in seen and isinstance(metric, keras.metrics.Metric):
            seen[id(metric)] = metric
            pending.extend(getattr(metric, "_metrics", ()))
    return list(seen.values())


def _global_result(original):
    def result(self, *args, **kwargs):
        results = getattr(step_state.current(), "global_results", None)
        if results is None or not results.variables or id(self) not in results.metric_ids or _inside():
            return original(self, *args, **kwargs)
        mapping = results.summed()
        _INSIDE.active = True
        try:
            with keras.StatelessScope(state_mapping=mapping):
                # Read inside the scope: a result that is a variable (a running maximum) would be read later as
                # this replica's own state.
                returned = tree.map_structure(read_if_variable, original(self, *args, **kwargs))
            results.note_returned(returned)
            return returned
        finally:
            _INSIDE.active = False

    result.__wrapped__ = original
    return result


def _inside():
    """Whether a wrapped `result` runs on this thread already (a result calling another reads the same sums)."""
    return getattr(_INSIDE, "active", False)


def read_if_variable(value):
    """`value` as a tensor where it is a `keras.Variable` (its value in the current scope), else as given."""
    return tf.convert_to_tensor(value.value) if isinstance(value, keras.Variable) else value
