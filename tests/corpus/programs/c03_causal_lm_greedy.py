"""Text generation with a miniature GPT (keras.io/examples/generative/text_generation_with_miniature_gpt).

One-line change: `keras.Model(inputs=inputs, outputs=[outputs, x])` ->
`keras_dist.DistributedModel(inputs=inputs, outputs=[outputs, x])`.
Generation is greedy (argmax) instead of keras.io's top-k sampling, so that both runs decode
the same tokens; it calls `model.predict` once per new token on one prompt, as keras.io's
`TextGenerator` callback does. Dropout rate 0.0 for the comparison (keras.io: 0.1).
Covers: causal self-attention (`use_causal_mask=True`), token + position embedding,
two outputs with `loss=[loss_fn, None]`, from-logits loss, Adam, `predict` on a batch of 1;
64 sequences at batch 24 (last batch 16).
"""

import keras
import numpy as np
from keras import layers, ops

CHANGE = "functional"
vocab_size = 50  # keras.io: 20000
maxlen = 10  # keras.io: 80
embed_dim = 16  # keras.io: 256
num_heads = 2
feed_forward_dim = 16  # keras.io: 256
DROPOUT_RATE = 0.0  # keras.io: 0.1


class TransformerBlock(layers.Layer):
    def __init__(self, embed_dim, num_heads, ff_dim, rate=0.1):
        super().__init__()
        self.att = layers.MultiHeadAttention(num_heads, embed_dim)
        self.ffn = keras.Sequential([layers.Dense(ff_dim, activation="relu"), layers.Dense(embed_dim)])
        self.layernorm1 = layers.LayerNormalization(epsilon=1e-6)
        self.layernorm2 = layers.LayerNormalization(epsilon=1e-6)
        self.dropout1 = layers.Dropout(rate)
        self.dropout2 = layers.Dropout(rate)

    def call(self, inputs):
        attention_output = self.att(inputs, inputs, use_causal_mask=True)
        attention_output = self.dropout1(attention_output)
        out1 = self.layernorm1(inputs + attention_output)
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
        positions = ops.arange(0, maxlen, 1)
        positions = self.pos_emb(positions)
        x = self.token_emb(x)
        return x + positions


def data():
    rs = np.random.RandomState(3)
    # A toy language: each token is the previous one plus a small step, modulo the vocabulary.
    start = rs.randint(1, vocab_size, size=(64, 1))
    steps = rs.randint(1, 4, size=(64, maxlen))
    tokens = (start + np.cumsum(steps, axis=1)) % vocab_size
    return tokens[:, :-1], tokens[:, 1:]


def build(Model, distribute):
    inputs = layers.Input(shape=(maxlen - 1,), dtype="int32")
    embedding_layer = TokenAndPositionEmbedding(maxlen - 1, vocab_size, embed_dim)
    x = embedding_layer(inputs)
    transformer_block = TransformerBlock(embed_dim, num_heads, feed_forward_dim, rate=DROPOUT_RATE)
    x = transformer_block(x)
    outputs = layers.Dense(vocab_size)(x)
    # keras_dist: keras.Model(...) -> keras_dist.DistributedModel(...) (`Model` is either)
    model = Model(inputs=inputs, outputs=[outputs, x])
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(
        "adam", loss=[loss_fn, None]
    )  # No loss and optimization based on word embeddings from transformer block
    return model


def generate(model, start_tokens, max_tokens):
    """Greedy decoding, one `predict` per token (keras.io's TextGenerator, argmax instead of top-k)."""
    start_tokens = list(start_tokens)
    num_tokens_generated = 0
    tokens_generated = []
    while num_tokens_generated <= max_tokens:
        pad_len = (maxlen - 1) - len(start_tokens)
        sample_index = len(start_tokens) - 1
        if pad_len < 0:
            x = start_tokens[: maxlen - 1]
            sample_index = maxlen - 2
        elif pad_len > 0:
            x = start_tokens + [0] * pad_len
        else:
            x = start_tokens
        x = np.array([x])
        y, _ = model.predict(x, verbose=0)
        sample_token = int(np.argmax(y[0][sample_index]))
        tokens_generated.append(sample_token)
        start_tokens.append(sample_token)
        num_tokens_generated = len(tokens_generated)
    return np.array(tokens_generated), y


def train(model, data):
    x, y = data
    history = model.fit(x, y, batch_size=24, epochs=1, verbose=0)
    generated, last_logits = generate(model, start_tokens=[5, 7, 8], max_tokens=1)
    return {
        "history": history.history,
        "predict": {"generated_tokens": generated, "last_logits": last_logits},
    }
