"""Small shared builders for the compat tests."""

import os

import keras
import numpy as np

import keras_dist
from keras_dist.testing import clean_env


def regression_data(num_examples, seed=0):
    rs = np.random.RandomState(seed + num_examples)
    x = rs.rand(num_examples, 2).astype("float32")
    return x, (rs.rand(num_examples, 1) * 10).astype("float32")


def dense_pair(strategy, *, metrics=(), lr=0.1):
    """Returns (plain keras.Model, DistributedModel) with zero-initialised Dense(1)."""
    models = []
    for cls, kwargs in ((keras.Model, {}), (keras_dist.DistributedModel, {"strategy": strategy})):
        inputs = keras.Input((2,))
        model = cls(inputs, keras.layers.Dense(1, kernel_initializer="zeros")(inputs), **kwargs)
        model.compile(optimizer=keras.optimizers.SGD(lr), loss="mse", metrics=list(metrics))
        models.append(model)
    return models


MW_WORKER = os.path.join(os.path.dirname(__file__), os.pardir, "integration", "mw_worker.py")


def multi_worker_env(disabled_fixes):
    """Returns the environment for `keras-dist launch` runs of `MW_WORKER` with some fixes disabled."""
    return clean_env(TF_CPP_MIN_LOG_LEVEL="3", KERAS_DIST_QUIET="1", KERAS_DIST_DISABLE_FIXES=disabled_fixes)
