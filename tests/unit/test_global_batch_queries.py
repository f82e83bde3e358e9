"""Each replica's own queries against the gathered candidates (`keras_dist.ops.global_batch_offset`): when it is exact.

docs/global_batch_losses.md: a loss that is a mean over this replica's queries against the
gathered candidates trains to one device's weights (keras-dist weights each replica's gradient
by its example share, so the replicas' means make the global mean); a loss that sums over the
queries does only when the queries are gathered too (every replica then computes the global
sum). An in-batch softmax two-tower model in a step of one's own, on 3 replicas with uneven
parts (11 examples at batch 5: 2/2/1, 2/2/1, then 1/0/0), against plain Keras on one device.
With the gather's gradient weighting off (`_runtime/gather._gradient_weight` returning 1) both
matching cases fail.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import ops

import keras_dist
from keras_dist.testing import assert_matches_single_device

IDS = np.stack([np.random.RandomState(0).randint(0, 20, 11), np.random.RandomState(1).randint(0, 30, 11)], axis=1)


def _two_tower(reduction, gather_queries):
    def build(cls, **kwargs):
        class TwoTower(cls):
            def __init__(self, **kw):
                super().__init__(**kw)
                self.users = keras.layers.Embedding(20, 4)
                self.movies = keras.layers.Embedding(30, 4)
                self.loss_tracker = keras.metrics.Mean(name="loss")

            def call(self, ids):
                return self.users(ids[:, 0]) * self.movies(ids[:, 1])

            def train_step(self, ids):
                with tf.GradientTape() as tape:
                    queries, candidates = self.users(ids[:, 0]), self.movies(ids[:, 1])
                    offset = keras_dist.ops.global_batch_offset(queries)
                    if gather_queries:
                        queries, candidates = keras_dist.ops.all_gather((queries, candidates))
                        offset = 0
                    else:
                        candidates = keras_dist.ops.all_gather(candidates)
                    logits = ops.matmul(queries, ops.transpose(candidates))
                    labels = offset + ops.arange(ops.shape(queries)[0])
                    losses = keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True)
                    loss = ops.sum(losses) if reduction == "sum" else ops.mean(losses)
                gradients = tape.gradient(loss, self.trainable_variables)
                self.optimizer.apply_gradients(zip(gradients, self.trainable_variables))
                self.loss_tracker.update_state(loss)
                return {"loss": self.loss_tracker.result()}

        model = TwoTower(**kwargs)
        model.compile(optimizer=keras.optimizers.SGD(0.1))
        model(IDS[:2])
        return model

    return build


def _fit(model):
    return model.fit(IDS, batch_size=5, epochs=1, shuffle=False, verbose=0)


@pytest.mark.parametrize(
    "reduction, gather_queries", [("mean", False), ("sum", True)], ids=["mean-own-queries", "sum-gathered-queries"]
)
def test_in_batch_softmax_matches_one_device(mirrored_1x3_cpu, reduction, gather_queries):
    assert_matches_single_device(
        _two_tower(reduction, gather_queries),
        strategy=mirrored_1x3_cpu,
        train=_fit,
        atol=1e-6,
        rtol=0.0,
        logs_atol=1e-6,
        logs_rtol=1e-5,
    )


def test_a_sum_over_each_replicas_own_queries_matches(mirrored_1x3_cpu):
    """Was a documented difference: the replicas' sums over their own queries, weighted by their example shares,
    are not the global sum. Each replica's sum over its own rows now counts once (`loss_terms.summed_examples`)."""
    assert_matches_single_device(
        _two_tower("sum", False), strategy=mirrored_1x3_cpu, train=_fit, atol=1e-6, rtol=0.0, logs_atol=1e-6
    )
