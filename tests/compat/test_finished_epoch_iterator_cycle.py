"""A finished fit/evaluate/predict must not leave its input pipeline for Python's cycle collector.

Keras' epoch iterator holds the generator of its own steps, whose frame holds
the iterator: a reference cycle that keeps the call's distributed tf.data
pipeline (and its threads) alive until the collector runs, at a moment no
worker chooses. In the 2x2 run of tests/integration/test_input_sharding.py that
moment fell inside a later `verify_sharding` on one worker and held it 30 s to
7 min while the other waited in a collective (3 of 4 runs; none of 3 with a
collection at the end of each call). Here, in a subprocess with the collector
off, the iterators left alive after each call are counted.
"""

import subprocess
import sys

import pytest

from keras_dist.testing import clean_env

pytestmark = pytest.mark.compat

SCRIPT = r"""
import gc
import keras, numpy as np, tensorflow as tf
import keras_dist

def live():
    return sum(type(o).__name__ == "TFEpochIterator" for o in gc.get_objects())

strategy = tf.distribute.MultiWorkerMirroredStrategy()  # One local worker: no cluster needed.
with strategy.scope():
    inputs = keras.Input((3,))
    model = keras_dist.DistributedModel(inputs, keras.layers.Dense(1)(inputs), strategy=strategy)
model.compile("sgd", "mse")
x, y = np.ones((40, 3), "float32"), np.ones((40, 1), "float32")

def batches():
    for _ in range(5):
        yield x[:8], y[:8]

gc.collect()
gc.disable()  # Only what each call leaves itself counts.
model.fit(batches(), epochs=2, verbose=0)
after_fit = live()
model.evaluate(x, y, batch_size=8, verbose=0)
after_evaluate = live()
model.predict(x, batch_size=8, verbose=0)
print("LIVE", after_fit, after_evaluate, live())
"""


def _live_epoch_iterators(disabled_fixes):
    env = clean_env(TF_CPP_MIN_LOG_LEVEL="3", KERAS_DIST_QUIET="1", KERAS_DIST_DISABLE_FIXES=disabled_fixes)
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=150, check=False
    )
    lines = [line for line in result.stdout.splitlines() if line.startswith("LIVE ")]
    assert result.returncode == 0 and lines, result.stdout[-2000:] + result.stderr[-3000:]
    return [int(v) for v in lines[-1].split()[1:]]


@pytest.mark.timeout(170)
def test_without_fix_each_finished_call_leaves_its_epoch_iterator_alive():
    after_fit, _, _ = _live_epoch_iterators("finished_epoch_iterator_cycle")
    assert after_fit >= 1  # fit on a generator, stopped by its end (Keras 3.15.1: 1 after each of the three calls).


@pytest.mark.timeout(170)
def test_with_fix_no_epoch_iterator_outlives_its_call():
    assert _live_epoch_iterators("") == [0, 0, 0]
