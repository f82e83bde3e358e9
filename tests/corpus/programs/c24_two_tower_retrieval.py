"""A two-tower retrieval model with in-batch softmax (TensorFlow Recommenders' basic retrieval), 30 users, 40 movies.

Follows TensorFlow Recommenders' "Recommending movies: retrieval"
(tensorflow.org/recommenders/examples/basic_retrieval): a query tower and a candidate tower
(`StringLookup` then `Embedding`), the `Retrieval` task's in-batch softmax (each user's
watched movie against every other movie of the batch: cross-entropy of the batch's score
matrix with the identity as labels, summed over the batch, `reduction="sum"` as TFRS'
default loss), written as the tutorial's "plain Keras model" with its own `train_step` and
`test_step` (`NoBaseClassMovielensModel`: loss, `regularization_loss = sum(self.losses)`,
`total_loss` returned as they are), Adagrad(0.1); `fit` on a shuffled, batched, cached
dataset, then `evaluate`. keras.io's recommender examples (keras.io/keras_rs) build their
retrieval models the same way.

One-line change: `class MovielensModel(keras.Model)` -> `class MovielensModel(keras_dist.DistributedModel)`.
The documented change for a loss that sees the whole batch (docs/global_batch_losses.md): the
task gathers the query and candidate embeddings over the replicas
(`keras_dist.ops.all_gather`, the identity on one device), so every replica scores the global
batch's users against all its movies and sums the same loss one device sums.
Changed: `tfrs.tasks.Retrieval` is written out in Keras ops (TFRS needs tf-keras 2), without its
`FactorizedTopK` metrics (a top-k over every candidate, which the tutorial too calls slow in
training); the shuffle has a seed (the tutorial's has none).
Covers: string ids through lookup layers, sparse embedding gradients whose rows repeat,
a summed loss (not a mean) in a step of one's own, raw loss tensors returned from the
step; 297 (user, movie) pairs at batch 64 (last batch 41: 21 and 20 on 2 replicas), 2 epochs,
evaluation on 50 pairs at batch 32 (last batch 18).
"""

import keras
import numpy as np
import tensorflow as tf
from keras import ops

import keras_dist

CHANGE = "subclass"
embedding_dimension = 8  # TFRS: 32
unique_user_ids = np.array([f"user_{i}" for i in range(30)])
unique_movie_titles = np.array([f"movie_{i}" for i in range(40)])


class Retrieval(keras.layers.Layer):
    """TFRS' `tfrs.tasks.Retrieval()`: in-batch softmax, every other candidate of the batch a negative."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        # TFRS: tf.keras.losses.CategoricalCrossentropy(from_logits=True, reduction=SUM)
        self._loss = keras.losses.CategoricalCrossentropy(from_logits=True, reduction="sum")

    def call(self, query_embeddings, candidate_embeddings, training=False):
        # keras_dist: the global batch's queries and candidates on every replica (the identity on one device)
        query_embeddings, candidate_embeddings = keras_dist.ops.all_gather((query_embeddings, candidate_embeddings))
        scores = ops.matmul(query_embeddings, ops.transpose(candidate_embeddings))
        num_queries = ops.shape(scores)[0]
        num_candidates = ops.shape(scores)[1]
        labels = ops.eye(num_queries, num_candidates)
        return self._loss(y_true=labels, y_pred=scores)


def make_model_class(Model):
    # keras_dist: class ...(keras.Model) -> class ...(keras_dist.DistributedModel) (`Model` is either)
    class MovielensModel(Model):
        def __init__(self, user_model, movie_model):
            super().__init__()
            self.movie_model: keras.Model = movie_model
            self.user_model: keras.Model = user_model
            self.task: keras.layers.Layer = Retrieval()

        def train_step(self, features):
            # Set up a gradient tape to record gradients.
            with tf.GradientTape() as tape:
                # Loss computation.
                user_embeddings = self.user_model(features["user_id"])
                positive_movie_embeddings = self.movie_model(features["movie_title"])
                loss = self.task(user_embeddings, positive_movie_embeddings, training=True)

                # Handle regularization losses as well.
                regularization_loss = sum(self.losses)

                total_loss = loss + regularization_loss

            gradients = tape.gradient(total_loss, self.trainable_variables)
            self.optimizer.apply_gradients(zip(gradients, self.trainable_variables))

            metrics = {metric.name: metric.result() for metric in self.metrics}
            metrics["loss"] = loss
            metrics["regularization_loss"] = regularization_loss
            metrics["total_loss"] = total_loss

            return metrics

        def test_step(self, features):
            # Loss computation.
            user_embeddings = self.user_model(features["user_id"])
            positive_movie_embeddings = self.movie_model(features["movie_title"])
            loss = self.task(user_embeddings, positive_movie_embeddings)

            # Handle regularization losses as well.
            regularization_loss = sum(self.losses)

            total_loss = loss + regularization_loss

            metrics = {metric.name: metric.result() for metric in self.metrics}
            metrics["loss"] = loss
            metrics["regularization_loss"] = regularization_loss
            metrics["total_loss"] = total_loss

            return metrics

    return MovielensModel


def data():
    rs = np.random.RandomState(24)
    n = 347
    # TFRS: tfds.load("movielens/100k-ratings"), mapped to {"movie_title", "user_id"}
    users = unique_user_ids[rs.randint(0, len(unique_user_ids), n)]
    movies = unique_movie_titles[rs.randint(0, len(unique_movie_titles), n)]
    train = {"movie_title": movies[:297], "user_id": users[:297]}
    test = {"movie_title": movies[297:], "user_id": users[297:]}
    return train, test


def build(Model, distribute):
    MovielensModel = make_model_class(Model)
    user_model = keras.Sequential(
        [
            keras.Input(shape=(), dtype="string"),
            keras.layers.StringLookup(vocabulary=unique_user_ids, mask_token=None),
            # We add an additional embedding to account for unknown tokens.
            keras.layers.Embedding(len(unique_user_ids) + 1, embedding_dimension),
        ]
    )
    movie_model = keras.Sequential(
        [
            keras.Input(shape=(), dtype="string"),
            keras.layers.StringLookup(vocabulary=unique_movie_titles, mask_token=None),
            keras.layers.Embedding(len(unique_movie_titles) + 1, embedding_dimension),
        ]
    )
    model = MovielensModel(user_model, movie_model)
    model.compile(optimizer=keras.optimizers.Adagrad(learning_rate=0.1))
    return model


def train(model, data):
    train_features, test_features = data
    train_dataset = tf.data.Dataset.from_tensor_slices(train_features)
    test_dataset = tf.data.Dataset.from_tensor_slices(test_features)
    cached_train = train_dataset.shuffle(100_000, seed=1).batch(64).cache()  # TFRS: batch(8192)
    cached_test = test_dataset.batch(32).cache()  # TFRS: batch(4096)
    history = model.fit(cached_train, epochs=2, verbose=0)  # TFRS: epochs=3
    return {
        "history": history.history,
        "evaluate": model.evaluate(cached_test, return_dict=True, verbose=0),
        # TFRS then indexes the movie embeddings (tfrs.layers.factorized_top_k.BruteForce) to recommend
        "predict": {
            "movies": model.movie_model.predict(test_dataset.map(lambda x: x["movie_title"]).batch(32), verbose=0)
        },
    }
