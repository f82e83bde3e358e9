"""Siamese network with a contrastive loss (keras.io/examples/vision/siamese_contrastive), 12x12 images.

One-line change: `keras.Model(inputs=[input_1, input_2], outputs=output_layer)` ->
`keras_dist.DistributedModel(inputs=[input_1, input_2], outputs=output_layer)`; the shared
tower stays a plain `keras.Model` used as a layer.
BatchNormalization is `synchronized=True` (keras-dist's README: plain BatchNormalization
normalizes with each replica's half of the batch, by design, as TensorFlow does).
Covers: two inputs through one shared tower, a `Lambda` distance, a loss function of one's own
that returns one scalar (`ops.mean` over the batch inside `contrastive_loss`), RMSprop,
accuracy; 90 pairs at batch 16 (last batch 10).
"""

import keras
import numpy as np
from keras import ops

CHANGE = "functional"
margin = 1  # Margin for contrastive loss.


def euclidean_distance(vects):
    x, y = vects
    sum_square = ops.sum(ops.square(x - y), axis=1, keepdims=True)
    return ops.sqrt(ops.maximum(sum_square, keras.backend.epsilon()))


def loss(margin=1):
    def contrastive_loss(y_true, y_pred):
        square_pred = ops.square(y_pred)
        margin_square = ops.square(ops.maximum(margin - (y_pred), 0))
        return ops.mean((1 - y_true) * square_pred + (y_true) * margin_square)

    return contrastive_loss


def data():
    rs = np.random.RandomState(6)
    x1 = rs.rand(120, 12, 12, 1).astype("float32")
    same = rs.rand(120) < 0.5
    x2 = np.where(same[:, None, None, None], x1 + 0.1 * rs.randn(120, 12, 12, 1), rs.rand(120, 12, 12, 1)).astype(
        "float32"
    )
    labels = same.astype("float32")
    return ([x1[:90], x2[:90]], labels[:90]), ([x1[90:], x2[90:]], labels[90:])


def build(Model, distribute):
    input = keras.layers.Input((12, 12, 1))
    x = keras.layers.BatchNormalization(synchronized=True)(input)
    x = keras.layers.Conv2D(4, (5, 5), activation="tanh")(x)
    x = keras.layers.AveragePooling2D(pool_size=(2, 2))(x)
    x = keras.layers.Conv2D(8, (3, 3), activation="tanh")(x)
    x = keras.layers.AveragePooling2D(pool_size=(2, 2))(x)
    x = keras.layers.Flatten()(x)

    x = keras.layers.BatchNormalization(synchronized=True)(x)
    x = keras.layers.Dense(10, activation="tanh")(x)
    embedding_network = keras.Model(input, x)

    input_1 = keras.layers.Input((12, 12, 1))
    input_2 = keras.layers.Input((12, 12, 1))

    # As mentioned above, Siamese Network share weights between
    # tower networks (sister networks). To allow this, we will use
    # same embedding network for both tower networks.
    tower_1 = embedding_network(input_1)
    tower_2 = embedding_network(input_2)

    merge_layer = keras.layers.Lambda(euclidean_distance, output_shape=(1,))([tower_1, tower_2])
    normal_layer = keras.layers.BatchNormalization(synchronized=True)(merge_layer)
    output_layer = keras.layers.Dense(1, activation="sigmoid")(normal_layer)
    # keras_dist: keras.Model(...) -> keras_dist.DistributedModel(...) (`Model` is either)
    siamese = Model(inputs=[input_1, input_2], outputs=output_layer)
    siamese.compile(loss=loss(margin=margin), optimizer="RMSprop", metrics=["accuracy"])
    return siamese


def train(siamese, data):
    ([x_train_1, x_train_2], labels_train), ([x_val_1, x_val_2], labels_val) = data
    history = siamese.fit(
        [x_train_1, x_train_2],
        labels_train,
        batch_size=16,
        epochs=1,
        verbose=0,
    )
    return {
        "history": history.history,
        "evaluate": siamese.evaluate([x_val_1, x_val_2], labels_val, batch_size=30, verbose=0, return_dict=True),
        "predict": siamese.predict([x_val_1, x_val_2], batch_size=30, verbose=0),
    }
