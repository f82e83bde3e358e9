"""A metric function returning one number per batch is computed on the global batch (issue 18 item 4, r11).

Reference: plain Keras on one device, same weights and batches; rtol 1e-5.
"""

import keras
import numpy as np
import pytest
from keras import ops

import keras_dist


def batch_max_abs_error(y_true, y_pred):
    return ops.max(ops.abs(y_true - y_pred))


def batch_size_seen(y_true, y_pred):
    return ops.cast(ops.shape(y_true)[0], "float32")


def _build(cls, **kwargs):
    inputs = keras.Input((4,))
    model = cls(inputs, keras.layers.Dense(1, activation="sigmoid")(inputs), **kwargs)
    model.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss="binary_crossentropy",
        metrics=[
            batch_max_abs_error,
            batch_size_seen,
            keras.metrics.AUC(name="auc"),
            keras.metrics.R2Score(name="r2"),
            keras.metrics.F1Score(threshold=0.5, name="f1"),
            "mae",
        ],
    )
    return model


@pytest.mark.parametrize("num_examples", [40, 37, 33], ids=["even", "uneven", "empty_replica"])
def test_batch_level_metric_functions_match_one_device(mirrored_1x3_cpu, num_examples):
    rs = np.random.RandomState(0)
    x = rs.rand(num_examples, 4).astype("float32")
    y = (x[:, :1] + 0.3 * rs.rand(num_examples, 1) > 0.6).astype("float32")
    reference = _build(keras.Model)
    model = _build(keras_dist.DistributedModel, strategy=mirrored_1x3_cpu)
    model.set_weights(reference.get_weights())
    results = []
    for m in (reference, model):
        history = m.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0).history
        results.append((history, m.evaluate(x, y, batch_size=8, verbose=0, return_dict=True)))
    (history_ref, eval_ref), (history, evaluated) = results
    for key, values in history_ref.items():
        np.testing.assert_allclose(history[key], values, rtol=1e-5, atol=1e-6, err_msg=key)
    for key, value in eval_ref.items():
        assert np.ravel(evaluated[key])[0] == pytest.approx(np.ravel(value)[0], rel=1e-5, abs=1e-6), key
