"""predict_on_batch must return exactly the input's rows, in order, on N replicas."""

import keras
import numpy as np
import pytest

import keras_dist
from keras_dist import _compat

pytestmark = pytest.mark.compat


def _predict_on_batch(strategy, num_rows):
    inputs = keras.Input((3,))
    model = keras_dist.DistributedModel(
        inputs, keras.layers.Dense(1, kernel_initializer="ones")(inputs), strategy=strategy
    )
    x = np.arange(num_rows * 3, dtype="float32").reshape(num_rows, 3)
    return x, model.predict_on_batch(x)


def test_without_fix_rows_are_repeated(mirrored_1x3_cpu):
    with _compat.disabled("predict_on_batch_split"):
        _, predictions = _predict_on_batch(mirrored_1x3_cpu, 5)
    assert predictions.shape[0] == 15


@pytest.mark.parametrize("num_rows", [1, 2, 5])
def test_with_fix_rows_match_input(mirrored_1x3_cpu, num_rows):
    x, predictions = _predict_on_batch(mirrored_1x3_cpu, num_rows)
    np.testing.assert_allclose(predictions, x.sum(1, keepdims=True), rtol=1e-6)
