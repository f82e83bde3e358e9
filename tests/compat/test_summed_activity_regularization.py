"""An activity regularizer must count as one device counts it, on a Keras that sums it over the batch and on one that divides.

Keras before 3.14 adds `activity_regularizer(output)` as it is (a sum over the batch's examples);
3.14 divides it by the batch size (keras-team/keras#22021). keras-dist's per-replica loss counted it
by each replica's share of the examples, right only for the divided form: with Keras 3.13.2 on 2
replicas the weights differed from one device by 1.5e-2.
"""

import keras
import numpy as np
import pytest
from helpers import regression_data

import keras_dist
from keras_dist import _compat
from keras_dist._compat import versions
from keras_dist.testing import max_weight_difference

pytestmark = pytest.mark.compat

SUMS = not versions.release_at_least("keras", "3.14")


def _build(cls, **kwargs):
    inputs = keras.Input((2,))
    hidden = keras.layers.Dense(
        3, kernel_initializer=keras.initializers.Constant(0.5), activity_regularizer=keras.regularizers.L2(0.05)
    )(inputs)
    model = cls(inputs, keras.layers.Dense(1, kernel_initializer="ones")(hidden), **kwargs)
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    return model


def _train(strategy):
    x, y = regression_data(8)  # Batch 8: 4 examples on each of 2 replicas, so only the regularizer can differ.
    reference, model = _build(keras.Model), _build(keras_dist.DistributedModel, strategy=strategy)
    logs = [m.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0).history["loss"] for m in (reference, model)]
    return max_weight_difference(reference, model), logs


@pytest.mark.skipif(not SUMS, reason="Keras >= 3.14 divides the activity regularization by the batch size: no bug")
def test_without_fix_weights_differ_on_a_keras_that_sums(mirrored_1x2_cpu):
    with _compat.disabled("summed_activity_regularization"):
        difference, _ = _train(mirrored_1x2_cpu)
    assert difference > 1e-3


def test_with_fix_weights_and_logged_loss_match(mirrored_1x2_cpu):
    difference, (reference_loss, loss) = _train(mirrored_1x2_cpu)
    assert difference == pytest.approx(0, abs=1e-5)
    np.testing.assert_allclose(loss, reference_loss, rtol=1e-5)


def test_the_remedy_follows_the_form_of_the_installed_keras(monkeypatch):
    """On (fake) 3.13 the losses count as sums; on 3.14, forced or not, Keras' divided form is left alone."""
    from packaging.version import Version

    monkeypatch.setenv("KERAS_DIST_FORCE_FIXES", "summed_activity_regularization")
    monkeypatch.setitem(versions.INSTALLED, "keras", Version("3.13.2"))
    assert _compat.sums_activity_regularization()
    with _compat.disabled("summed_activity_regularization"):
        assert not _compat.sums_activity_regularization()
    monkeypatch.setitem(versions.INSTALLED, "keras", Version("3.14.0"))
    assert not _compat.sums_activity_regularization()
