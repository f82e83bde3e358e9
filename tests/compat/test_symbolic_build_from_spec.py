"""A first batch smaller than the replica count (3 examples, 2 replicas, batch 4) must train; plain Keras crashed in its pre-fit symbolic build (`AddN` shape mismatch)."""

import numpy as np
import pytest
from helpers import dense_pair, regression_data

from keras_dist import _compat

pytestmark = pytest.mark.compat


def _fit_three_examples(strategy):
    x, y = regression_data(3)  # one batch of 3 split 2/1 over 2 replicas
    _, model = dense_pair(strategy)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    return model


def test_without_fix_keras_fails_in_its_pre_build(mirrored_1x2_cpu):
    with _compat.disabled("symbolic_build_from_spec"):
        with pytest.raises(Exception, match="(?i)shape|incompatible|dimension"):
            _fit_three_examples(mirrored_1x2_cpu)


def test_with_fix_it_trains(mirrored_1x2_cpu):
    model = _fit_three_examples(mirrored_1x2_cpu)
    assert np.all(np.isfinite(model.get_weights()[0]))
