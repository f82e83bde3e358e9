"""Under several replicas, fit and evaluate must not write into the arrays a Python input slices its batches from.

The keras.io guide's `PyDataset` returns slices of the user's arrays. TensorFlow
takes a slice whose memory starts on a 64-byte boundary without a copy, and
once the strategy splits the batch over replicas the step's ops may write into
it: the targets held loss terms after one epoch, and the next epoch trained on
them. NumPy puts an array on such a boundary about one time in four, so the
arrays here are placed on one, every time.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from corpus.programs import c26_pydataset_regression

import keras_dist
from keras_dist import _compat
from keras_dist._compat import versions

pytestmark = pytest.mark.compat

NUM_EXAMPLES, BATCH_SIZE = 256, 32


def _on_a_64_byte_boundary(values):
    """Returns a copy of the float32 array `values` whose memory starts on a 64-byte boundary."""
    aligned = c26_pydataset_regression.on_a_64_byte_boundary(values)
    assert aligned.ctypes.data % 64 == 0
    return aligned


class ExamplePyDataset(keras.utils.PyDataset):  # As https://keras.io/guides/training_with_built_in_methods/
    def __init__(self, x, y, batch_size, **kwargs):
        super().__init__(**kwargs)
        self.x, self.y, self.batch_size = x, y, batch_size

    def __len__(self):
        return int(np.ceil(len(self.x) / float(self.batch_size)))

    def __getitem__(self, idx):
        batch = slice(idx * self.batch_size, (idx + 1) * self.batch_size)
        return self.x[batch], self.y[batch]


def _data():
    rs = np.random.RandomState(0)
    x = _on_a_64_byte_boundary(rs.randn(NUM_EXAMPLES, 8).astype("float32"))
    y = _on_a_64_byte_boundary((x[:, :2] @ np.array([[1.0], [-1.0]], "float32")).astype("float32"))
    return x, y


def _changed_by(strategy, run):
    """Returns how many values of `x` and of `y` `run(model, x, y)` changed."""
    x, y = _data()
    before = x.copy(), y.copy()
    inputs = keras.Input((8,))
    outputs = keras.layers.Dense(1)(keras.layers.Dense(16, activation="relu")(inputs))
    model = keras_dist.DistributedModel(inputs, outputs, strategy=strategy)
    model.compile(optimizer="adam", loss="mse", metrics=["mae"])
    run(model, x, y)
    return int((x != before[0]).sum()), int((y != before[1]).sum())


def _fit(model, x, y):
    model.fit(ExamplePyDataset(x, y, BATCH_SIZE), epochs=1, verbose=0)


def _evaluate(model, x, y):
    model.evaluate(ExamplePyDataset(x, y, BATCH_SIZE), verbose=0)


def _fit_from_generator(model, x, y):
    def batches():
        for start in range(0, NUM_EXAMPLES, BATCH_SIZE):
            yield x[start : start + BATCH_SIZE], y[start : start + BATCH_SIZE]

    spec = (tf.TensorSpec((None, 8), tf.float32), tf.TensorSpec((None, 1), tf.float32))
    dataset = tf.data.Dataset.from_generator(batches, output_signature=spec)
    model.fit(dataset.apply(tf.data.experimental.assert_cardinality(NUM_EXAMPLES // BATCH_SIZE)), epochs=1, verbose=0)


RUNS = {"fit PyDataset": _fit, "evaluate PyDataset": _evaluate, "fit from_generator": _fit_from_generator}


def test_without_fix_the_targets_are_overwritten(mirrored_1x2_cpu):
    if not _compat.FIXES["python_batches_written_in_place"].applies_to_installed():
        pytest.skip("The installed TensorFlow is outside the fix's verified range: the bug is reproduced only there.")
    if versions.in_range("tensorflow", "<2.19"):
        pytest.skip("TensorFlow 2.18.1 leaves the arrays unchanged without the fix (the registry's notes).")
    with _compat.disabled("python_batches_written_in_place"):
        x_changed, y_changed = _changed_by(mirrored_1x2_cpu, _fit)
    assert x_changed == 0 and y_changed > 0  # TensorFlow 2.20 and 2.21: 128 of 256, one replica's share of every batch.


@pytest.mark.parametrize("run", sorted(RUNS))
def test_with_fix_the_arrays_are_unchanged(mirrored_1x2_cpu, run):
    assert _changed_by(mirrored_1x2_cpu, RUNS[run]) == (0, 0)
