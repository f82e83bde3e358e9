"""Collaborative filtering (keras.io/examples/structured_data/collaborative_filtering_movielens).

One-line change: `class RecommenderNet(keras.Model)` -> `class RecommenderNet(keras_dist.DistributedModel)`;
built with positional arguments, `RecommenderNet(num_users, num_movies, EMBEDDING_SIZE)`, as keras.io does.
keras.io's `call` takes `ops.tensordot(user_vector, movie_vector, 2)`, which sums over the whole
batch (every prediction depends on the other examples of its batch, on one device too); this
program takes the per-example dot product the example means, `ops.sum(u * m, axis=1, keepdims=True)`.
The model is called on one batch after construction (so both runs can start from the same
weights). Covers: large embedding tables (5000 users, 3000 movies) with L2
`embeddings_regularizer`, sparse gradients whose rows repeat within and across replicas,
Adam, binary crossentropy on sigmoid outputs; 180 ratings at batch 64 (last
batch 52).
"""

import keras
import numpy as np
from keras import layers, ops

CHANGE = "subclass"
EMBEDDING_SIZE = 16  # keras.io: 50
num_users = 5000
num_movies = 3000


def make_recommender_class(Model):
    # keras_dist: class ...(keras.Model) -> class ...(keras_dist.DistributedModel) (`Model` is either)
    class RecommenderNet(Model):
        def __init__(self, num_users, num_movies, embedding_size, **kwargs):
            super().__init__(**kwargs)
            self.num_users = num_users
            self.num_movies = num_movies
            self.embedding_size = embedding_size
            self.user_embedding = layers.Embedding(
                num_users,
                embedding_size,
                embeddings_initializer="he_normal",
                embeddings_regularizer=keras.regularizers.l2(1e-6),
            )
            self.user_bias = layers.Embedding(num_users, 1)
            self.movie_embedding = layers.Embedding(
                num_movies,
                embedding_size,
                embeddings_initializer="he_normal",
                embeddings_regularizer=keras.regularizers.l2(1e-6),
            )
            self.movie_bias = layers.Embedding(num_movies, 1)

        def call(self, inputs):
            user_vector = self.user_embedding(inputs[:, 0])
            user_bias = self.user_bias(inputs[:, 0])
            movie_vector = self.movie_embedding(inputs[:, 1])
            movie_bias = self.movie_bias(inputs[:, 1])
            dot_user_movie = ops.sum(
                user_vector * movie_vector, axis=1, keepdims=True
            )  # keras.io: ops.tensordot(..., 2)
            # Add all the components (including bias)
            x = dot_user_movie + user_bias + movie_bias
            # The sigmoid activation forces the rating to between 0 and 1
            return ops.nn.sigmoid(x)

    return RecommenderNet


def data():
    rs = np.random.RandomState(10)
    n = 240
    users = rs.choice(rs.randint(0, num_users, 40), size=n)  # 40 active users: rows repeat
    movies = rs.choice(rs.randint(0, num_movies, 60), size=n)
    x = np.stack([users, movies], axis=1).astype("int64")
    y = rs.randint(1, 11, size=n).astype("float32") / 10.0  # ratings normalized to [0.1, 1]
    return (x[:180], y[:180]), (x[180:], y[180:])


def build(Model, distribute):
    (x_train, _), _ = data()
    RecommenderNet = make_recommender_class(Model)
    model = RecommenderNet(num_users, num_movies, EMBEDDING_SIZE)
    model(x_train[:2])
    model.compile(loss=keras.losses.BinaryCrossentropy(), optimizer=keras.optimizers.Adam(learning_rate=0.001))
    return model


def train(model, data):
    (x_train, y_train), (x_val, y_val) = data
    history = model.fit(x=x_train, y=y_train, batch_size=64, epochs=1, verbose=0)
    return {
        "history": history.history,
        "evaluate": model.evaluate(x_val, y_val, batch_size=64, verbose=0, return_dict=True),
        "predict": model.predict(x_val, batch_size=64, verbose=0),
    }
