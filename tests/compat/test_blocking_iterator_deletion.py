"""Under several workers, destroying a distributed iterator must not hold the thread that runs the steps.

Destroying a distributed iterator under MultiWorkerMirroredStrategy holds the
thread that drops it for 0.2 s, often about 1.25 s and up to 18 s, while the
other workers wait in their next collective; Keras drops one or two each epoch
of a finite input (benchmarks/epoch_stall.py measures the stall; a test here
asserts no speed). What can be checked without a clock is where each iterator
is destroyed: here 2 workers run fit on arrays with validation data, then
evaluate, and record the thread on which every distributed iterator TensorFlow
made was finalized. Without the fix, all on the step thread (MainThread); with
it, all on keras-dist's deleting threads, and none left alive. The same for a
`DatasetCreator` (`distribute_datasets_from_function`, whose dataset keeps its class).

Under MirroredStrategy (one process) the step thread itself waits: Python's cycle
collector destroys a finished call's iterator on whatever thread it interrupts
(Keras' epoch iterator sits in a reference cycle), and for an input over a Python
generator (`tf.data.Dataset.from_generator`) that held it 60-100 s on TensorFlow
2.21 and 122 s on 2.20 (a gc.collect() 20 s after fit; 0.2 s with the fix). The
in-process tests check the same thing there, for arrays and for `from_generator`.
"""

import gc
import threading
import time
import weakref

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.distribute import input_lib

import keras_dist
from keras_dist import _compat
from keras_dist.testing import clean_env, run_workers

pytestmark = pytest.mark.compat

SCRIPT = r"""
import sys, threading, time, weakref
import keras, numpy as np, tensorflow as tf
from tensorflow.python.distribute import input_lib
import keras_dist

finalized_on, made = [], []

def recording(make_iterator):
    def recording_iter(self):
        iterator = make_iterator(self)
        made.append(1)
        weakref.finalize(iterator, lambda: finalized_on.append(threading.current_thread().name))
        return iterator
    return recording_iter

for cls in (input_lib.DistributedDataset, input_lib.DistributedDatasetsFromFunction):
    cls.__iter__ = recording(cls.__iter__)
inputs = keras.Input((3,))
model = keras_dist.DistributedModel(inputs, keras.layers.Dense(1)(inputs))
model.compile("sgd", "mse")
x, y = np.ones((40, 3), "float32"), np.ones((40, 1), "float32")
if sys.argv[1] == "arrays":
    model.fit(x, y, batch_size=8, epochs=3, validation_data=(x, y), verbose=0)
    model.evaluate(x, y, batch_size=8, verbose=0)
else:
    def dataset_fn(context):
        return tf.data.Dataset.from_tensor_slices((x, y)).shard(
            context.num_input_pipelines, context.input_pipeline_id).batch(context.get_per_replica_batch_size(8))
    creator = keras_dist.data.DatasetCreator(dataset_fn)
    model.fit(creator, epochs=4, verbose=0)
    model.evaluate(creator, verbose=0)
deadline = time.monotonic() + 30
while len(finalized_on) < len(made) and time.monotonic() < deadline:
    time.sleep(0.05)
print("STRATEGY", type(model.distribute_strategy).__name__)
print("ITERATORS", len(made), len(finalized_on), ",".join(sorted(set(finalized_on))))
"""


def _iterators(tmp_path, disabled_fixes, kind):
    """Returns each worker's `(iterators made, iterators finalized, sorted names of the threads that did it)`."""
    script = tmp_path / "iterators.py"
    script.write_text(SCRIPT)
    env = clean_env(TF_CPP_MIN_LOG_LEVEL="3", KERAS_DIST_QUIET="1", KERAS_DIST_DISABLE_FIXES=disabled_fixes)
    result = run_workers(script, [kind], num_workers=2, timeout=150, env=env)
    found = []
    for worker in result.workers:
        lines = [line.split() for line in worker.output.splitlines()]
        assert result.ok and ["STRATEGY", "MultiWorkerMirroredStrategy"] in lines, worker.output[-3000:]
        made, finalized, threads = next(line[1:] for line in lines if line[:1] == ["ITERATORS"])
        found.append((int(made), int(finalized), threads))
    return found


# Iterators made, Keras 3.15.1: arrays 14 (two per epoch of fit and of validation, ...), DatasetCreator 5.
KINDS = [("arrays", 7), ("dataset_creator", 4)]


@pytest.mark.multi_worker
@pytest.mark.timeout(170)
@pytest.mark.parametrize("kind, at_least", KINDS)
def test_without_fix_iterators_are_destroyed_on_the_step_thread(tmp_path, kind, at_least):
    for made, finalized, threads in _iterators(tmp_path, "blocking_iterator_deletion", kind):
        assert made >= at_least and finalized == made
        assert threads == "MainThread"


@pytest.mark.multi_worker
@pytest.mark.timeout(170)
@pytest.mark.parametrize("kind, at_least", KINDS)
def test_with_fix_every_iterator_is_destroyed_on_the_deleting_threads(tmp_path, kind, at_least):
    for made, finalized, threads in _iterators(tmp_path, "", kind):
        assert made >= at_least and finalized == made  # None left alive.
        assert all(name.startswith("keras-dist-iterator-release_") for name in threads.split(",")), threads


# --------------------------------------------------------------- one process, MirroredStrategy
X = np.arange(120, dtype="float32").reshape(40, 3) / 120
Y = X.sum(1, keepdims=True)


def _generator():
    for start in range(0, 40, 8):
        yield X[start : start + 8], Y[start : start + 8]


def _input(kind):
    if kind == "from_generator":
        spec = (tf.TensorSpec((None, 3), tf.float32), tf.TensorSpec((None, 1), tf.float32))
        return tf.data.Dataset.from_generator(_generator, output_signature=spec)
    return tf.data.Dataset.from_tensor_slices((X, Y)).batch(8)


def _threads_destroying_iterators(strategy, kind, monkeypatch):
    """Runs fit (with validation data) and evaluate; returns (iterators made, names of the threads that destroyed them)."""
    made, finalized_on = [], []

    def recording(make_iterator):
        def recording_iter(self):
            iterator = make_iterator(self)
            made.append(1)
            weakref.finalize(iterator, lambda: finalized_on.append(threading.current_thread().name))
            return iterator

        return recording_iter

    for cls in (input_lib.DistributedDataset, input_lib.DistributedDatasetsFromFunction):
        monkeypatch.setattr(cls, "__iter__", recording(cls.__iter__))
    inputs = keras.Input((3,))
    model = keras_dist.DistributedModel(inputs, keras.layers.Dense(1)(inputs), strategy=strategy)
    model.compile("sgd", "mse")
    model.fit(_input(kind), epochs=3, validation_data=_input(kind), verbose=0)
    model.evaluate(_input(kind), verbose=0)
    del model
    gc.collect()  # The finished calls' epoch iterators sit in reference cycles.
    deadline = time.monotonic() + 60
    while len(finalized_on) < len(made) and time.monotonic() < deadline:
        time.sleep(0.05)
    return len(made), sorted(set(finalized_on)), len(finalized_on)


@pytest.mark.parametrize("kind", ["arrays", "from_generator"])
def test_without_fix_iterators_are_destroyed_on_the_step_thread_in_one_process(mirrored_1x2_cpu, kind, monkeypatch):
    with _compat.disabled("blocking_iterator_deletion"):
        made, threads, finalized = _threads_destroying_iterators(mirrored_1x2_cpu, kind, monkeypatch)
    assert made >= 7 and finalized == made
    assert threads == ["MainThread"]


@pytest.mark.parametrize("kind", ["arrays", "from_generator"])
def test_with_fix_iterators_are_destroyed_on_the_deleting_threads_in_one_process(mirrored_1x2_cpu, kind, monkeypatch):
    made, threads, finalized = _threads_destroying_iterators(mirrored_1x2_cpu, kind, monkeypatch)
    assert made >= 7 and finalized == made  # None left alive.
    assert all(name.startswith("keras-dist-iterator-release_") for name in threads), threads
