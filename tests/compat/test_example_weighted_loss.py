"""An unevenly split global batch must give the global mean's gradient (plain Keras weighted the replicas' means equally: 7 examples at batch 4 ended with bias -5.886 against -7.433 on one device)."""

import pytest
from helpers import dense_pair, regression_data

from keras_dist import _compat
from keras_dist.testing import max_weight_difference

pytestmark = pytest.mark.compat


def _train(strategy):
    x, y = regression_data(7)  # batch 4: the last batch of 3 splits 2/1 on 2 replicas
    reference, model = dense_pair(strategy)
    for m in (reference, model):
        m.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    return max_weight_difference(reference, model)


def test_without_fix_weights_differ(mirrored_1x2_cpu):
    with _compat.disabled("example_weighted_loss"):
        assert _train(mirrored_1x2_cpu) > 1e-2


def test_with_fix_weights_match(mirrored_1x2_cpu):
    assert _train(mirrored_1x2_cpu) == pytest.approx(0, abs=1e-5)
