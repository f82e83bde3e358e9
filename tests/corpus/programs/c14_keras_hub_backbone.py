"""A keras_hub-style backbone built from its config with random weights, plus a classifier task.

Written the way keras_hub writes `BertBackbone` and `BertTextClassifier` (keras_hub itself is
not needed): a `Backbone` is a functional `keras.Model` subclass whose `__init__` builds its
layers, then the functional graph, then calls `super().__init__(inputs=..., outputs=...)`,
and whose `get_config` returns the constructor arguments; the backbone here is created with
`TinyBertBackbone.from_config(config)` (random weights, no download), and a classifier task
(itself a functional subclass) puts a Dense head on the pooled output.
One-line change: `classifier = keras_dist.distribute(classifier)` (a keras_hub user cannot change
keras_hub's base class). Dropout 0.0 in the config for the comparison (BERT's: 0.1).
Covers: token/segment/position embeddings, a padding mask into MultiHeadAttention,
LayerNormalization, the `[CLS]` pooled output, dict inputs, from-logits sparse categorical
crossentropy, AdamW (with weight decay), sparse categorical accuracy; 60 sequences at batch
16 (last batch 12), 20 test sequences in one batch.
"""

import keras
import numpy as np
from keras import layers, ops

CHANGE = "distribute"

CONFIG = {  # what a preset's config.json holds
    "vocabulary_size": 100,
    "num_layers": 1,
    "num_heads": 2,
    "hidden_dim": 8,
    "intermediate_dim": 16,
    "dropout": 0.0,  # BERT: 0.1
    "max_sequence_length": 16,
    "num_segments": 2,
}
SEQUENCE_LENGTH = 10


class PositionEmbedding(layers.Layer):
    """A learned embedding per position, sliced to the input's length (keras_hub.layers.PositionEmbedding)."""

    def __init__(self, sequence_length, initializer="glorot_uniform", **kwargs):
        super().__init__(**kwargs)
        self.sequence_length = int(sequence_length)
        self.initializer = keras.initializers.get(initializer)

    def build(self, inputs_shape):
        feature_size = inputs_shape[-1]
        self.position_embeddings = self.add_weight(
            name="embeddings", shape=[self.sequence_length, feature_size], initializer=self.initializer, trainable=True
        )
        self.built = True

    def call(self, inputs):
        shape = ops.shape(inputs)
        feature_length, sequence_length = shape[-1], shape[-2]
        position_embeddings = ops.slice(self.position_embeddings, (0, 0), (sequence_length, feature_length))
        return ops.broadcast_to(position_embeddings, shape)

    def get_config(self):
        config = super().get_config()
        config.update(
            {"sequence_length": self.sequence_length, "initializer": keras.initializers.serialize(self.initializer)}
        )
        return config


class TransformerEncoder(layers.Layer):
    """Post-norm transformer encoder block (keras_hub.layers.TransformerEncoder)."""

    def __init__(self, intermediate_dim, num_heads, dropout=0.0, activation="gelu", layer_norm_epsilon=1e-12, **kwargs):
        super().__init__(**kwargs)
        self.intermediate_dim = intermediate_dim
        self.num_heads = num_heads
        self.dropout = dropout
        self.activation = activation
        self.layer_norm_epsilon = layer_norm_epsilon

    def build(self, inputs_shape):
        hidden_dim = inputs_shape[-1]
        self._self_attention_layer = layers.MultiHeadAttention(
            num_heads=self.num_heads, key_dim=hidden_dim // self.num_heads, dropout=self.dropout
        )
        self._self_attention_layer.build(inputs_shape, inputs_shape)
        self._self_attention_layer_norm = layers.LayerNormalization(epsilon=self.layer_norm_epsilon)
        self._self_attention_layer_norm.build(inputs_shape)
        self._self_attention_dropout = layers.Dropout(rate=self.dropout)
        self._feedforward_intermediate_dense = layers.Dense(self.intermediate_dim, activation=self.activation)
        self._feedforward_intermediate_dense.build(inputs_shape)
        self._feedforward_output_dense = layers.Dense(hidden_dim)
        self._feedforward_output_dense.build(tuple(inputs_shape)[:-1] + (self.intermediate_dim,))
        self._feedforward_layer_norm = layers.LayerNormalization(epsilon=self.layer_norm_epsilon)
        self._feedforward_layer_norm.build(inputs_shape)
        self._feedforward_dropout = layers.Dropout(rate=self.dropout)
        self.built = True

    def call(self, inputs, padding_mask=None, training=None):
        x = inputs
        attention_mask = None
        if padding_mask is not None:
            mask = ops.cast(padding_mask, "bool")
            attention_mask = ops.logical_and(mask[:, None, :], mask[:, :, None])
        residual = x
        x = self._self_attention_layer(query=x, value=x, attention_mask=attention_mask, training=training)
        x = self._self_attention_dropout(x, training=training)
        x = self._self_attention_layer_norm(x + residual)
        residual = x
        x = self._feedforward_intermediate_dense(x)
        x = self._feedforward_output_dense(x)
        x = self._feedforward_dropout(x, training=training)
        return self._feedforward_layer_norm(x + residual)

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "intermediate_dim": self.intermediate_dim,
                "num_heads": self.num_heads,
                "dropout": self.dropout,
                "activation": self.activation,
                "layer_norm_epsilon": self.layer_norm_epsilon,
            }
        )
        return config


class Backbone(keras.Model):
    """keras_hub.models.Backbone, reduced: a functional model whose config is its constructor arguments."""

    def get_config(self):
        return {"name": self.name, "trainable": self.trainable}

    @classmethod
    def from_config(cls, config):
        return cls(**config)


class TinyBertBackbone(Backbone):
    def __init__(
        self,
        vocabulary_size,
        num_layers,
        num_heads,
        hidden_dim,
        intermediate_dim,
        dropout=0.1,
        max_sequence_length=512,
        num_segments=2,
        **kwargs,
    ):
        # === Layers ===
        self.token_embedding = layers.Embedding(vocabulary_size, hidden_dim, name="token_embedding")
        self.position_embedding = PositionEmbedding(max_sequence_length, name="position_embedding")
        self.segment_embedding = layers.Embedding(num_segments, hidden_dim, name="segment_embedding")
        self.embeddings_add = layers.Add(name="embeddings_add")
        self.embeddings_layer_norm = layers.LayerNormalization(epsilon=1e-12, name="embeddings_layer_norm")
        self.embeddings_dropout = layers.Dropout(dropout, name="embeddings_dropout")
        self.transformer_layers = [
            TransformerEncoder(intermediate_dim, num_heads, dropout=dropout, name=f"transformer_layer_{i}")
            for i in range(num_layers)
        ]
        self.pooled_dense = layers.Dense(hidden_dim, activation="tanh", name="pooled_dense")

        # === Functional Model ===
        token_id_input = keras.Input(shape=(None,), dtype="int32", name="token_ids")
        segment_id_input = keras.Input(shape=(None,), dtype="int32", name="segment_ids")
        padding_mask_input = keras.Input(shape=(None,), dtype="int32", name="padding_mask")
        tokens = self.token_embedding(token_id_input)
        positions = self.position_embedding(tokens)
        segments = self.segment_embedding(segment_id_input)
        x = self.embeddings_add((tokens, positions, segments))
        x = self.embeddings_layer_norm(x)
        x = self.embeddings_dropout(x)
        for transformer_layer in self.transformer_layers:
            x = transformer_layer(x, padding_mask=padding_mask_input)
        cls_token_index = 0
        sequence_output = x
        pooled_output = self.pooled_dense(x[:, cls_token_index, :])
        super().__init__(
            inputs={"token_ids": token_id_input, "segment_ids": segment_id_input, "padding_mask": padding_mask_input},
            outputs={"sequence_output": sequence_output, "pooled_output": pooled_output},
            **kwargs,
        )

        # === Config ===
        self.vocabulary_size = vocabulary_size
        self.num_layers = num_layers
        self.num_heads = num_heads
        self.hidden_dim = hidden_dim
        self.intermediate_dim = intermediate_dim
        self.dropout = dropout
        self.max_sequence_length = max_sequence_length
        self.num_segments = num_segments

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "vocabulary_size": self.vocabulary_size,
                "num_layers": self.num_layers,
                "num_heads": self.num_heads,
                "hidden_dim": self.hidden_dim,
                "intermediate_dim": self.intermediate_dim,
                "dropout": self.dropout,
                "max_sequence_length": self.max_sequence_length,
                "num_segments": self.num_segments,
            }
        )
        return config


class TinyBertTextClassifier(keras.Model):
    """keras_hub.models.BertTextClassifier, reduced: a Dense head on the backbone's pooled output."""

    def __init__(self, backbone, num_classes, dropout=0.1, **kwargs):
        # === Layers ===
        self.backbone = backbone
        self.output_dropout = layers.Dropout(dropout, name="classifier_dropout")
        self.output_dense = layers.Dense(num_classes, name="logits")

        # === Functional Model ===
        inputs = backbone.input
        pooled = backbone(inputs)["pooled_output"]
        pooled = self.output_dropout(pooled)
        outputs = self.output_dense(pooled)
        super().__init__(inputs=inputs, outputs=outputs, **kwargs)

        # === Config ===
        self.num_classes = num_classes
        self.dropout = dropout

    def get_config(self):
        return {
            "backbone": keras.layers.serialize(self.backbone),
            "num_classes": self.num_classes,
            "dropout": self.dropout,
        }


def data():
    rs = np.random.RandomState(14)
    n = 80
    lengths = rs.randint(4, SEQUENCE_LENGTH + 1, size=n)
    token_ids = np.zeros((n, SEQUENCE_LENGTH), "int32")
    padding_mask = np.zeros((n, SEQUENCE_LENGTH), "int32")
    segment_ids = np.zeros((n, SEQUENCE_LENGTH), "int32")
    for i, length in enumerate(lengths):
        token_ids[i, :length] = np.concatenate([[1], rs.randint(3, CONFIG["vocabulary_size"], size=length - 1)])
        padding_mask[i, :length] = 1
        segment_ids[i, length // 2 : length] = 1
    labels = (token_ids[:, 1] % 3).astype("int64")
    x = {"token_ids": token_ids, "segment_ids": segment_ids, "padding_mask": padding_mask}
    split = lambda d, s: {k: v[s] for k, v in d.items()}  # noqa: E731
    return (split(x, slice(0, 60)), labels[:60]), (split(x, slice(60, None)), labels[60:])


def build(Model, distribute):
    backbone = TinyBertBackbone.from_config(CONFIG)
    classifier = TinyBertTextClassifier(backbone, num_classes=3, dropout=CONFIG["dropout"])
    classifier = distribute(classifier)  # keras_dist: the one line a user adds (the identity on one device)
    classifier.compile(
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        optimizer=keras.optimizers.AdamW(learning_rate=1e-3, weight_decay=0.01),
        metrics=[keras.metrics.SparseCategoricalAccuracy()],
    )
    return classifier


def train(classifier, data):
    (x_train, y_train), (x_test, y_test) = data
    history = classifier.fit(x_train, y_train, batch_size=16, epochs=1, verbose=0)
    return {
        "history": history.history,
        "evaluate": classifier.evaluate(x_test, y_test, batch_size=20, verbose=0, return_dict=True),
        "predict": classifier.predict(x_test, batch_size=20, verbose=0),
    }
