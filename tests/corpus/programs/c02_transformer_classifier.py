"""Text classification with a Transformer (keras.io/examples/nlp/text_classification_with_transformer).

One-line change: `keras.Model(inputs=inputs, outputs=outputs)` ->
`keras_dist.DistributedModel(inputs=inputs, outputs=outputs)`.
For the comparison every Dropout rate is 0.0 (keras.io: 0.1): each replica draws its own masks.
Covers: MultiHeadAttention, LayerNormalization, a position embedding looked up with
`ops.arange` (the same rows on every replica), GlobalAveragePooling1D, Adam,
sparse categorical crossentropy on softmax outputs, accuracy; 70 training
sequences at batch 32 (last batch 6).
"""

import keras
import numpy as np
from keras import layers, ops

CHANGE = "functional"
vocab_size = 200  # keras.io: 20000
maxlen = 12  # keras.io: 200
DROPOUT_RATE = 0.0  # keras.io: 0.1


class TransformerBlock(layers.Layer):
    def __init__(self, embed_dim, num_heads, ff_dim, rate=0.1):
        super().__init__()
        self.att = layers.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim)
        self.ffn = keras.Sequential([layers.Dense(ff_dim, activation="relu"), layers.Dense(embed_dim)])
        self.layernorm1 = layers.LayerNormalization(epsilon=1e-6)
        self.layernorm2 = layers.LayerNormalization(epsilon=1e-6)
        self.dropout1 = layers.Dropout(rate)
        self.dropout2 = layers.Dropout(rate)

    def call(self, inputs):
        attn_output = self.att(inputs, inputs)
        attn_output = self.dropout1(attn_output)
        out1 = self.layernorm1(inputs + attn_output)
        ffn_output = self.ffn(out1)
        ffn_output = self.dropout2(ffn_output)
        return self.layernorm2(out1 + ffn_output)


class TokenAndPositionEmbedding(layers.Layer):
    def __init__(self, maxlen, vocab_size, embed_dim):
        super().__init__()
        self.token_emb = layers.Embedding(input_dim=vocab_size, output_dim=embed_dim)
        self.pos_emb = layers.Embedding(input_dim=maxlen, output_dim=embed_dim)

    def call(self, x):
        maxlen = ops.shape(x)[-1]
        positions = ops.arange(start=0, stop=maxlen, step=1)
        positions = self.pos_emb(positions)
        x = self.token_emb(x)
        return x + positions


def data():
    rs = np.random.RandomState(2)
    x = rs.randint(1, vocab_size, size=(100, maxlen))
    y = (x[:, :3].sum(1) % 2).astype("int64")
    return (x[:70], y[:70]), (x[70:], y[70:])


def build(Model, distribute):
    embed_dim = 16  # Embedding size for each token (keras.io: 32)
    num_heads = 2  # Number of attention heads
    ff_dim = 16  # Hidden layer size in feed forward network inside transformer (keras.io: 32)

    inputs = layers.Input(shape=(maxlen,))
    embedding_layer = TokenAndPositionEmbedding(maxlen, vocab_size, embed_dim)
    x = embedding_layer(inputs)
    transformer_block = TransformerBlock(embed_dim, num_heads, ff_dim, rate=DROPOUT_RATE)
    x = transformer_block(x)
    x = layers.GlobalAveragePooling1D()(x)
    x = layers.Dropout(DROPOUT_RATE)(x)
    x = layers.Dense(20, activation="relu")(x)
    x = layers.Dropout(DROPOUT_RATE)(x)
    outputs = layers.Dense(2, activation="softmax")(x)

    # keras_dist: keras.Model(...) -> keras_dist.DistributedModel(...) (`Model` is either)
    model = Model(inputs=inputs, outputs=outputs)
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def train(model, data):
    (x_train, y_train), (x_val, y_val) = data
    history = model.fit(x_train, y_train, batch_size=32, epochs=1, verbose=0)
    return {
        "history": history.history,
        "evaluate": model.evaluate(x_val, y_val, verbose=0, return_dict=True),
        "predict": model.predict(x_val, verbose=0),
    }
