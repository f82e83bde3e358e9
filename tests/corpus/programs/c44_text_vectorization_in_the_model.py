"""Text classification from scratch (keras.io/examples/nlp/text_classification_from_scratch), vectorizing in the model.

keras.io's second option: "make the vectorization part of the model" (`text_input =
keras.Input(shape=(1,), dtype="string")`, `x = vectorize_layer(text_input)`), with its
Embedding -> Conv1D -> Conv1D -> GlobalMaxPooling1D -> Dense head on raw strings. keras.io
pads to `output_sequence_length=500`; written as TensorFlow's "Text classification with an
RNN" writes `TextVectorization(max_tokens=VOCAB_SIZE)`, without it, each batch is padded to
its own longest review, and the unmasked convolutions see that padding. On N replicas each
replica padded its part to its own longest: weights 1.6e-2 off on 2 replicas in a new-user
probe (stop 55), now padded to the global batch's longest (`keras_dist._runtime.ragged_padding`).
One-line change: `keras.Model(inputs, predictions)` -> `keras_dist.DistributedModel(...)`.
Dropout is 0.0 (keras.io: 0.5): each replica draws its own masks.
Covers: string inputs, `TextVectorization` adapted outside the model and called inside it,
`tf.data` batches of (string, label), Conv1D with strides, binary crossentropy, Adam,
accuracy; evaluate and predict on strings. 100 reviews at batch 32 (last batch 4: 2/2 on 2
replicas), long reviews in the first quarter of each batch.
"""

import keras
import numpy as np
import tensorflow as tf
from keras import layers

CHANGE = "functional"
max_features = 60  # keras.io: 20000
embedding_dim = 16  # keras.io: 128
batch_size = 32
WORDS = "the movie was great terrible boring fun awful plot acting good bad loved hated it very long short".split()


def data():
    rs = np.random.RandomState(44)
    lengths = np.where(np.arange(100) % 32 < 8, rs.randint(12, 20, 100), rs.randint(3, 7, 100))
    reviews = np.array([" ".join(rs.choice(WORDS, n)) for n in lengths])
    labels = np.array([[float("great" in r or "loved" in r)] for r in reviews], "float32")
    return reviews, labels


def build(Model, distribute):
    reviews, _ = data()
    vectorize_layer = layers.TextVectorization(max_tokens=max_features, output_mode="int")
    vectorize_layer.adapt(reviews)
    text_input = keras.Input(shape=(1,), dtype="string", name="text")
    x = vectorize_layer(text_input)
    x = layers.Embedding(max_features, embedding_dim)(x)
    x = layers.Dropout(0.0)(x)  # keras.io: 0.5
    x = layers.Conv1D(16, 3, padding="valid", activation="relu", strides=1)(x)  # keras.io: 128, 7, strides 3
    x = layers.Conv1D(16, 3, padding="valid", activation="relu", strides=1)(x)
    x = layers.GlobalMaxPooling1D()(x)
    x = layers.Dense(16, activation="relu")(x)
    x = layers.Dropout(0.0)(x)
    predictions = layers.Dense(1, activation="sigmoid", name="predictions")(x)
    model = Model(text_input, predictions)  # keras_dist: keras.Model -> keras_dist.DistributedModel
    model.compile(loss="binary_crossentropy", optimizer="adam", metrics=["accuracy"])
    return model


def train(model, data):
    reviews, labels = data
    train_ds = tf.data.Dataset.from_tensor_slices((reviews[:, None], labels)).batch(batch_size)
    text_ds = tf.data.Dataset.from_tensor_slices(reviews[:, None]).batch(batch_size)
    history = model.fit(train_ds, epochs=3, verbose=0)
    return {
        "history": history.history,
        "evaluate": model.evaluate(train_ds, verbose=0, return_dict=True),
        "predict": model.predict(text_ds, verbose=0),
    }
