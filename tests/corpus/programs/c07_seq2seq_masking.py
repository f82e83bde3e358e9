"""Sequence-to-sequence LSTM with masking (keras.io/examples/nlp/lstm_seq2seq, on token ids).

keras.io's character-level model one-hot encodes; this is the same encoder-decoder on
integer tokens with `Embedding(mask_zero=True)`, as its token-level variants write it, so
padded positions are masked out of the LSTMs, the loss and the accuracy.
One-line change: `keras.Model([encoder_inputs, decoder_inputs], decoder_outputs)` ->
`keras_dist.DistributedModel([encoder_inputs, decoder_inputs], decoder_outputs)`.
Covers: two inputs, LSTM states passed from encoder to decoder, a masked (token-averaged)
sparse categorical crossentropy, RMSprop, accuracy; sequences of different lengths
zero-padded to 8; 60 pairs at batch 16 (last batch 12).
"""

import keras
import numpy as np
from keras import layers

CHANGE = "functional"
num_encoder_tokens = 30
num_decoder_tokens = 30
latent_dim = 8  # keras.io: 256
max_len = 8


def data():
    rs = np.random.RandomState(7)
    n = 60
    lengths = rs.randint(2, max_len, size=n)
    encoder_input_data = np.zeros((n, max_len), "int32")
    decoder_input_data = np.zeros((n, max_len), "int32")
    decoder_target_data = np.zeros((n, max_len), "int32")
    for i, length in enumerate(lengths):
        source = rs.randint(3, num_encoder_tokens, size=length)
        target = np.concatenate([[1], source[::-1], [2]])  # start, reversed source, end
        encoder_input_data[i, :length] = source
        decoder_input_data[i, : length + 1] = target[:-1]
        decoder_target_data[i, : length + 1] = target[1:]
    return encoder_input_data, decoder_input_data, decoder_target_data


def build(Model, distribute):
    # Define an input sequence and process it.
    encoder_inputs = keras.Input(shape=(None,), dtype="int32")
    x = layers.Embedding(num_encoder_tokens, latent_dim, mask_zero=True)(encoder_inputs)
    encoder = keras.layers.LSTM(latent_dim, return_state=True)
    encoder_outputs, state_h, state_c = encoder(x)
    # We discard `encoder_outputs` and only keep the states.
    encoder_states = [state_h, state_c]

    # Set up the decoder, using `encoder_states` as initial state.
    decoder_inputs = keras.Input(shape=(None,), dtype="int32")
    x = layers.Embedding(num_decoder_tokens, latent_dim, mask_zero=True)(decoder_inputs)
    decoder_lstm = keras.layers.LSTM(latent_dim, return_sequences=True, return_state=True)
    decoder_outputs, _, _ = decoder_lstm(x, initial_state=encoder_states)
    decoder_dense = keras.layers.Dense(num_decoder_tokens, activation="softmax")
    decoder_outputs = decoder_dense(decoder_outputs)

    # Define the model that will turn
    # `encoder_input_data` & `decoder_input_data` into `decoder_target_data`
    # keras_dist: keras.Model(...) -> keras_dist.DistributedModel(...) (`Model` is either)
    model = Model([encoder_inputs, decoder_inputs], decoder_outputs)
    model.compile(optimizer="rmsprop", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def train(model, data):
    encoder_input_data, decoder_input_data, decoder_target_data = data
    history = model.fit(
        [encoder_input_data, decoder_input_data],
        decoder_target_data,
        batch_size=16,
        epochs=1,
        verbose=0,
    )
    x = [encoder_input_data[48:], decoder_input_data[48:]]
    return {
        "history": history.history,
        "evaluate": model.evaluate(x, decoder_target_data[48:], batch_size=16, verbose=0, return_dict=True),
        "predict": model.predict(x, batch_size=16, verbose=0),
    }
