"""A Switch Transformer text classifier (keras.io/examples/nlp/text_classification_with_switch_transformer), 6-token texts.

Follows "Text classification with Switch Transformer": `TokenAndPositionEmbedding`, a
`Router` that adds the load-balancing loss with `self.add_loss(load_balanced_loss(...))`
(`mean(router_probs, 0) * mean(expert_mask, 0)` over the batch's tokens), a `Switch` layer
dispatching each token to one of the experts by `einsum`, a `TransformerBlock` whose
feed-forward network is the `Switch`, global average pooling and a softmax classifier; Adam,
sparse categorical cross-entropy, accuracy.

One-line change: `keras.Model(inputs=inputs, outputs=outputs)` ->
`keras_dist.DistributedModel(inputs=inputs, outputs=outputs)`. The documented change for a loss
computed from statistics over the batch (docs/global_batch_losses.md): `load_balanced_loss`
takes its two means with `keras_dist.ops.batch_mean` (the global batch's; `ops.mean(..., axis=0)`
on one device). Without it the weights end 0.21 off one device (a new-user probe) and the
first-batch check names the `Router`.
Changed for the comparison: no router noise in training (keras.io: uniform noise in [0.9, 1.1];
each replica would draw its own), Dropout 0.0 (keras.io: 0.25), the tokens reshaped to
`[-1, embed_dim]` (keras.io: `[num_tokens_per_batch, embed_dim]`, the global batch's token count,
which a replica's part of the batch does not have), and an expert capacity of every token of a
batch (keras.io: tokens per batch / experts): the capacity cut counts positions over the batch's
tokens (`cumsum` along them), which a replica's part counts over its own tokens only.
Covers: a loss added inside a layer from batch means, one-hot routing with `top_k`, `einsum`
dispatch and combine, experts as a list of sub-models; 74 texts at batch 16 (last batch 10:
5 and 5 on 2 replicas), 2 epochs, validation on 26.
"""

import keras
import numpy as np
from keras import layers, ops

import keras_dist

CHANGE = "functional"
DROPOUT_RATE = 0.0  # keras.io: 0.25
ROUTER_NOISE = False  # keras.io: noise in training; each replica would draw its own

vocab_size = 50  # Only consider the top 50 words (keras.io: 20000)
num_tokens_per_example = 6  # Only consider the first 6 words of each review (keras.io: 200)
embed_dim = 8  # Embedding size for each token. (keras.io: 32)
num_heads = 2  # Number of attention heads
ff_dim = 8  # Hidden layer size in feedforward network. (keras.io: 32)
num_experts = 3  # Number of experts used in the Switch Transformer. (keras.io: 10)
batch_size = 16  # Batch size. (keras.io: 50)
learning_rate = 0.001  # Learning rate.
num_epochs = 2  # Number of epochs. (keras.io: 3)
num_tokens_per_batch = batch_size * num_tokens_per_example  # Total number of tokens per batch.


def data():
    rs = np.random.RandomState(37)
    x = rs.randint(1, vocab_size, size=(100, num_tokens_per_example))
    y = (x[:, :2].sum(1) > vocab_size).astype("int64")
    return (x[:74], y[:74]), (x[74:], y[74:])


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


def create_feedforward_network(ff_dim, embed_dim, name=None):
    return keras.Sequential([layers.Dense(ff_dim, activation="relu"), layers.Dense(embed_dim)], name=name)


def load_balanced_loss(router_probs, expert_mask):
    # router_probs [tokens_per_batch, num_experts] is the probability assigned for
    # each expert per token. expert_mask [tokens_per_batch, num_experts] contains
    # the expert with the highest router probability in one−hot format.

    num_experts = ops.shape(expert_mask)[-1]
    # Get the fraction of tokens routed to each expert.
    # density is a vector of length num experts that sums to 1.
    # keras_dist: the global batch's means (ops.mean(..., axis=0) on one device)
    density = keras_dist.ops.batch_mean(expert_mask)
    # Get fraction of probability mass assigned to each expert from the router
    # across all tokens. density_proxy is a vector of length num experts that sums to 1.
    density_proxy = keras_dist.ops.batch_mean(router_probs)
    # Want both vectors to have uniform allocation (1/num experts) across all
    # num_expert elements. The two vectors will be pushed towards uniform allocation
    # when the dot product is minimized.
    loss = ops.mean(density_proxy * density) * ops.cast((num_experts**2), "float32")
    return loss


class Router(layers.Layer):
    def __init__(self, num_experts, expert_capacity):
        self.num_experts = num_experts
        self.route = layers.Dense(units=num_experts)
        self.expert_capacity = expert_capacity
        super().__init__()

    def call(self, inputs, training=False):
        # inputs shape: [tokens_per_batch, embed_dim]
        # router_logits shape: [tokens_per_batch, num_experts]
        router_logits = self.route(inputs)

        if training and ROUTER_NOISE:
            # Add noise for exploration across experts.
            router_logits += keras.random.uniform(shape=ops.shape(router_logits), minval=0.9, maxval=1.1)
        # Probabilities for each token of what expert it should be sent to.
        router_probs = keras.activations.softmax(router_logits, axis=-1)
        # Get the top−1 expert for each token. expert_gate is the top−1 probability
        # from the router for each token. expert_index is what expert each token
        # is going to be routed to.
        expert_gate, expert_index = ops.top_k(router_probs, k=1)
        # expert_mask shape: [tokens_per_batch, num_experts]
        expert_mask = ops.one_hot(expert_index, self.num_experts)
        # Compute load balancing loss.
        aux_loss = load_balanced_loss(router_probs, expert_mask)
        self.add_loss(aux_loss)
        # Experts have a fixed capacity, ensure we do not exceed it. Construct
        # the batch indices, to each expert, with position in expert make sure that
        # not more that expert capacity examples can be routed to each expert.
        position_in_expert = ops.cast(ops.cumsum(expert_mask, axis=0) * expert_mask, "int32")
        # Keep only tokens that fit within expert capacity.
        expert_mask *= ops.cast(ops.less(ops.cast(position_in_expert, "int32"), self.expert_capacity), "float32")
        expert_mask_flat = ops.sum(expert_mask, axis=-1)
        # Mask out the experts that have overflowed the expert capacity.
        expert_gate *= expert_mask_flat
        # Combine expert outputs and scaling with router probability.
        # combine_tensor shape: [tokens_per_batch, num_experts, expert_capacity]
        combined_tensor = ops.expand_dims(
            expert_gate * expert_mask_flat * ops.squeeze(ops.one_hot(expert_index, self.num_experts), 1),
            -1,
        ) * ops.squeeze(ops.one_hot(position_in_expert, self.expert_capacity), 1)
        # Create binary dispatch_tensor [tokens_per_batch, num_experts, expert_capacity]
        # that is 1 if the token gets routed to the corresponding expert.
        dispatch_tensor = ops.cast(combined_tensor, "float32")

        return dispatch_tensor, combined_tensor


class Switch(layers.Layer):
    def __init__(self, num_experts, embed_dim, ff_dim, num_tokens_per_batch, capacity_factor=1):
        self.num_experts = num_experts
        self.embed_dim = embed_dim
        self.experts = [create_feedforward_network(ff_dim, embed_dim) for _ in range(num_experts)]

        self.expert_capacity = num_tokens_per_batch // self.num_experts * capacity_factor
        self.router = Router(self.num_experts, self.expert_capacity)
        super().__init__()

    def call(self, inputs):
        batch_size = ops.shape(inputs)[0]
        num_tokens_per_example = ops.shape(inputs)[1]

        # inputs shape: [num_tokens_per_batch, embed_dim]
        inputs = ops.reshape(inputs, [-1, self.embed_dim])  # keras.io: [num_tokens_per_batch, self.embed_dim]
        # dispatch_tensor shape: [expert_capacity, num_experts, tokens_per_batch]
        # combine_tensor shape: [tokens_per_batch, num_experts, expert_capacity]
        dispatch_tensor, combine_tensor = self.router(inputs)
        # expert_inputs shape: [num_experts, expert_capacity, embed_dim]
        expert_inputs = ops.einsum("ab,acd->cdb", inputs, dispatch_tensor)
        expert_inputs = ops.reshape(expert_inputs, [self.num_experts, self.expert_capacity, self.embed_dim])
        # Dispatch to experts
        expert_input_list = ops.unstack(expert_inputs, axis=0)
        expert_output_list = [self.experts[idx](expert_input) for idx, expert_input in enumerate(expert_input_list)]
        # expert_outputs shape: [expert_capacity, num_experts, embed_dim]
        expert_outputs = ops.stack(expert_output_list, axis=1)
        # expert_outputs_combined shape: [tokens_per_batch, embed_dim]
        expert_outputs_combined = ops.einsum("abc,xba->xc", expert_outputs, combine_tensor)
        # output shape: [batch_size, num_tokens_per_example, embed_dim]
        outputs = ops.reshape(expert_outputs_combined, [batch_size, num_tokens_per_example, self.embed_dim])
        return outputs


class TransformerBlock(layers.Layer):
    def __init__(self, embed_dim, num_heads, ffn, dropout_rate=0.1):
        super().__init__()
        self.att = layers.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim)
        # The ffn can be either a standard feedforward network or a switch
        # layer with a Mixture of Experts.
        self.ffn = ffn
        self.layernorm1 = layers.LayerNormalization(epsilon=1e-6)
        self.layernorm2 = layers.LayerNormalization(epsilon=1e-6)
        self.dropout1 = layers.Dropout(dropout_rate)
        self.dropout2 = layers.Dropout(dropout_rate)

    def call(self, inputs, training=False):
        attn_output = self.att(inputs, inputs)
        attn_output = self.dropout1(attn_output, training=training)
        out1 = self.layernorm1(inputs + attn_output)
        ffn_output = self.ffn(out1)
        ffn_output = self.dropout2(ffn_output, training=training)
        return self.layernorm2(out1 + ffn_output)


def build(Model, distribute):
    # keras.io: capacity_factor=1 (tokens per batch / experts); here every token fits (docstring)
    switch = Switch(num_experts, embed_dim, ff_dim, num_tokens_per_batch, capacity_factor=num_experts)
    transformer_block = TransformerBlock(embed_dim // num_heads, num_heads, switch, DROPOUT_RATE)

    inputs = layers.Input(shape=(num_tokens_per_example,))
    embedding_layer = TokenAndPositionEmbedding(num_tokens_per_example, vocab_size, embed_dim)
    x = embedding_layer(inputs)
    x = transformer_block(x)
    x = layers.GlobalAveragePooling1D()(x)
    x = layers.Dropout(DROPOUT_RATE)(x)
    x = layers.Dense(ff_dim, activation="relu")(x)
    x = layers.Dropout(DROPOUT_RATE)(x)
    outputs = layers.Dense(2, activation="softmax")(x)

    # keras_dist: keras.Model(...) -> keras_dist.DistributedModel(...) (`Model` is either)
    classifier = Model(inputs=inputs, outputs=outputs)
    classifier.compile(
        optimizer=keras.optimizers.Adam(learning_rate),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )
    return classifier


def train(model, data):
    (x_train, y_train), (x_val, y_val) = data
    history = model.fit(
        x_train, y_train, batch_size=batch_size, epochs=num_epochs, validation_data=(x_val, y_val), verbose=0
    )
    return {
        "history": history.history,
        "evaluate": model.evaluate(x_val, y_val, batch_size=batch_size, verbose=0, return_dict=True),
        "predict": model.predict(x_val, batch_size=batch_size, verbose=0),
    }
