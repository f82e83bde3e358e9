"""Helpers for testing code that uses keras-dist (shipped, importable by users' tests).

Owns: simulated CPU devices for tests, and numeric comparisons of weights.
Nothing in the library imports this package.
"""

import keras
import numpy as np

from keras_dist._runtime.devices import simulate_cpu_replicas as simulate_cpu_devices

__all__ = ["max_weight_difference", "simulate_cpu_devices"]


def max_weight_difference(model_a: keras.Model, model_b: keras.Model) -> float:
    """Returns the largest absolute difference between two models' weights.

    Args:
        model_a: `keras.Model`.
        model_b: `keras.Model` with the same weight shapes, in the same order.

    Returns:
        Python float, `max |a - b|` over every element of every weight.

    Raises:
        ValueError: The models have different numbers or shapes of weights.
    """
    weights_a, weights_b = model_a.get_weights(), model_b.get_weights()
    shapes_a = [w.shape for w in weights_a]
    shapes_b = [w.shape for w in weights_b]
    if shapes_a != shapes_b:
        raise ValueError(
            f"Both models must have the same weight shapes, in the same order. Received: {shapes_a} and {shapes_b}."
        )
    return max((float(np.max(np.abs(a - b))) for a, b in zip(weights_a, weights_b) if a.size), default=0.0)
