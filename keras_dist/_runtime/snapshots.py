"""Layer 3: snapshots of Keras state that put it back exactly: variables, optimizers, models, global seeds.

`keras_dist.verify` trains the user's own model twice (on one device, then
under its strategy) and must leave it as it was. Values alone are not enough:
moving a model to another strategy (`variables.rehome`) replaces the
`tf.Variable` behind every `keras.Variable`, and a step function already traced
holds the old ones. So a snapshot keeps the backing variable objects and each
one's per-device values, and an object snapshot keeps an optimizer's or
model's attributes (and the contents of its lists, dicts and sets, which Keras
mutates in place), so that an optimizer built during `verify` is unbuilt again.

Private API: `keras.Variable._value` (the backing `tf.Variable`), Keras'
`Tracker.stored_ids`, Keras' global seed generator in `global_state`.
"""

import numpy as np
import tensorflow as tf
from keras.src.backend.common import global_state as keras_global_state

_GLOBAL_SEED_GENERATOR = "global_seed_generator"


def local_components(tf_variable):
    """Returns the per-device `tf.Variable`s of this worker behind `tf_variable` (itself when not distributed)."""
    if isinstance(tf_variable, tf.distribute.DistributedValues):
        return tuple(tf_variable._distribute_strategy.experimental_local_results(tf_variable))
    return (tf_variable,)


def logical_value(variable):
    """Returns what one device would hold for a Keras variable, as a NumPy array, read on this worker only.

    A mirrored variable gives its first copy (every copy is the same after a
    step); a sync-on-read one the sum (`"sum"` aggregation) or mean of this
    worker's copies. Sends nothing to other workers.
    """
    value = variable._value
    if not isinstance(value, tf.distribute.DistributedValues):
        return np.array(value.numpy())
    components = [np.array(c.numpy()) for c in local_components(value)]
    if getattr(value, "synchronization", None) == tf.VariableSynchronization.ON_READ:
        if value.aggregation == tf.VariableAggregation.SUM:
            return np.sum(components, axis=0).astype(components[0].dtype)
        if value.aggregation == tf.VariableAggregation.MEAN:
            return np.mean(components, axis=0).astype(components[0].dtype)
    return components[0]


class VariableSnapshot:
    """The backing `tf.Variable` of each Keras variable, and every per-device value.

    Args:
        keras_variables: `keras.Variable`s (each once); their backing
            variables and values are kept.
        tf_variables: Plain or distributed `tf.Variable`s whose values are
            kept too (e.g. keras-dist's accumulation sums).

    `restore()` gives every Keras variable its backing variable back (undoing
    a move to another strategy) and assigns every device's copy the value it
    had. Reads and writes this worker's copies only: not a collective.
    """

    def __init__(self, keras_variables, tf_variables=()):
        self._bindings = [(v, v._value) for v in keras_variables if v._value is not None]
        backing = [value for _, value in self._bindings] + list(tf_variables)
        self._values = [
            (component, np.array(component.numpy())) for value in backing for component in local_components(value)
        ]

    @property
    def keras_variable_ids(self):
        """Set of `id`s of the Keras variables this snapshot holds."""
        return {id(v) for v, _ in self._bindings}

    def restore(self):
        for variable, value in self._bindings:
            variable._value = value
        for component, value in self._values:
            component.assign(value)


class ObjectSnapshot:
    """An object's attributes, the contents of those that are lists, dicts or sets, and Keras' tracker ids.

    `restore()` puts back every attribute (removing those added since),
    refills each list, dict and set in place (Keras' tracker holds the same
    list objects) and resets the tracker's record of what it tracks. Shallow:
    other objects it refers to are not restored.
    """

    def __init__(self, obj):
        self._obj = obj
        self._attributes = dict(obj.__dict__)
        self._contents = {
            key: _contents(value) for key, value in self._attributes.items() if isinstance(value, (list, dict, set))
        }
        tracker = self._attributes.get("_tracker")
        stored = getattr(tracker, "stored_ids", None)
        self._tracker_ids = {k: set(v) for k, v in stored.items()} if isinstance(stored, dict) else None

    def restore(self):
        attributes = self._obj.__dict__
        for key in [k for k in attributes if k not in self._attributes]:
            del attributes[key]
        attributes.update(self._attributes)
        for key, contents in self._contents.items():
            _refill(self._attributes[key], contents)  # Sets compare by membership: order is not kept.
        if self._tracker_ids is not None:
            stored = self._attributes["_tracker"].stored_ids
            stored.clear()
            stored.update({k: set(v) for k, v in self._tracker_ids.items()})


def _contents(container):
    if isinstance(container, dict):
        return list(container.items())
    return list(container)


def _refill(container, contents):
    """Puts `contents` back into `container` in place, only where they changed (most did not: no mutation)."""
    current = list(container.items()) if isinstance(container, dict) else list(container)
    if len(current) == len(contents) and all(_same(a, b) for a, b in zip(current, contents)):
        return
    if isinstance(container, dict):
        container.clear()
        container.update(dict(contents))
    elif isinstance(container, list):
        container[:] = contents
    else:
        container.clear()
        container.update(contents)


def _same(a, b):
    if isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b) == 2:  # A dict's (key, value).
        return a[0] == b[0] and a[1] is b[1]
    return a is b


class GlobalSeedSnapshot:
    """Keras' global seed generator (used by random ops given no seed): which one, and its state.

    `restore()` puts back the generator object (none if there was none) and its state's value.
    """

    def __init__(self):
        self._generator = keras_global_state.get_global_attribute(_GLOBAL_SEED_GENERATOR)
        state = getattr(self._generator, "state", None)
        self._state = None if state is None else VariableSnapshot([state])

    def restore(self):
        keras_global_state.set_global_attribute(_GLOBAL_SEED_GENERATOR, self._generator)
        if self._state is not None:
            self._state.restore()
