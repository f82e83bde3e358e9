"""Per-layer overrides of private Keras layer hooks (BatchNormalization's `_moments`)."""

import keras
import tensorflow as tf

_GUARDED = "_keras_dist_empty_batch_guard"


def guard_empty_batch_moments(layer):
    """Makes a BatchNormalization layer keep its moving statistics on an empty batch.

    A replica whose share of a (last, partial) global batch is empty computes
    the mean and variance of zero examples: NaN, which then reaches the
    moving statistics (mean-aggregated over replicas) and, through the
    gradient, `gamma` and `beta`. On an empty batch the moments are replaced
    by the moving statistics, so that replica's update leaves them as they are.
    Overrides the instance's `_moments` only; idempotent.

    Args:
        layer: A `keras.layers.BatchNormalization`.

    Returns:
        Boolean, whether the layer was changed now (False if already guarded,
        or `synchronized=True`: its moments are the global batch's).
    """
    if getattr(layer, _GUARDED, False) or layer.synchronized:
        # A synchronized layer's moments are those of the global batch, empty only when the global batch is.
        return False
    moments = layer._moments

    def guarded_moments(inputs, mask):
        mean, variance = moments(inputs, mask)
        nonempty = tf.size(inputs) > 0
        mean = tf.where(nonempty, mean, tf.cast(tf.reshape(layer.moving_mean, tf.shape(mean)), mean.dtype))
        variance = tf.where(
            nonempty, variance, tf.cast(tf.reshape(layer.moving_variance, tf.shape(variance)), variance.dtype)
        )
        return mean, variance

    layer._moments = guarded_moments
    setattr(layer, _GUARDED, True)
    return True


def batch_normalization_layers(model):
    """Returns the `keras.layers.BatchNormalization` layers of `model`, nested ones included."""
    layers = model._flatten_layers(include_self=False)
    return [layer for layer in layers if isinstance(layer, keras.layers.BatchNormalization)]
