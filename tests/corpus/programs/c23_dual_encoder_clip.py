"""A CLIP-style dual encoder (keras.io/examples/vision/nl_image_search), 8x8 images and 6-token captions.

Follows "Natural language image search with a Dual Encoder": `project_embeddings`, a vision and
a text encoder (frozen base, trainable projection), the `DualEncoder` with its own `call`,
`compute_loss(caption_embeddings, image_embeddings)` (cross-entropy of the caption-image
logits against soft targets from the captions' and images' own similarities, both ways),
`train_step` and `test_step`, one `Mean` loss tracker; AdamW, `ReduceLROnPlateau` and
`EarlyStopping(restore_best_weights=True)` on `val_loss`. As CLIP does, the temperature is
learned: `self.temperature` is `exp(-logit_scale)` of a trainable scalar weight, from keras.io's
0.05.

One-line change: `class DualEncoder(keras.Model)` -> `class DualEncoder(keras_dist.DistributedModel)`.
The documented change for a loss that sees the whole batch (docs/global_batch_losses.md): the
first line of `compute_loss` gathers both embeddings over the replicas
(`keras_dist.ops.all_gather`, the identity on one device), so the logits and the targets are
the global batch's, as on one device.
Changed for the comparison: tiny trainable-off bases instead of Xception and BERT from
TF Hub (an image Conv2D and a caption Embedding, each averaged, with `trainable=False` as
keras.io freezes its bases), Dropout 0.0 (keras.io: 0.1; each replica would draw its own
masks), `keras.optimizers.AdamW` (keras.io: `tfa.optimizers.AdamW`, the same rule), the
encoders not pinned with `tf.device("/gpu:0")` / `"/gpu:1"` (a replica's device must not be
overridden), arrays in a dict instead of TFRecords.
Covers: a dict of inputs (images and int captions), two encoders, a learned temperature
that the gather's gradient reaches from every replica, soft targets, validation losses driving
two callbacks; 51 pairs at batch 16 (last batch 3: 2 and 1 on 2 replicas, where the gather's
gradient weighting counts; a last batch of 1 would leave a replica empty, but a 1 x 1 softmax has
no gradient), 3 epochs, validation on 20 pairs at batch 16 (last batch 4).
"""

import math

import keras
import numpy as np
import tensorflow as tf
from keras import layers

import keras_dist

CHANGE = "subclass"
DROPOUT = 0.0  # keras.io: 0.1
vocabulary_size = 50
caption_length = 6
image_size = 8  # keras.io: 299


def project_embeddings(embeddings, num_projection_layers, projection_dims, dropout_rate):
    projected_embeddings = layers.Dense(units=projection_dims)(embeddings)
    for _ in range(num_projection_layers):
        x = keras.activations.gelu(projected_embeddings)  # keras.io: tf.nn.gelu
        x = layers.Dense(projection_dims)(x)
        x = layers.Dropout(dropout_rate)(x)
        x = layers.Add()([projected_embeddings, x])
        projected_embeddings = layers.LayerNormalization()(x)
    return projected_embeddings


def create_vision_encoder(num_projection_layers, projection_dims, dropout_rate, trainable=False):
    # keras.io: keras.applications.Xception(include_top=False, weights="imagenet", pooling="avg")
    base = keras.Sequential([layers.Conv2D(8, 3, activation="relu"), layers.GlobalAveragePooling2D()], name="xception")
    # Set the trainability of the base encoder.
    for layer in base.layers:
        layer.trainable = trainable
    # Receive the images as inputs.
    inputs = layers.Input(shape=(image_size, image_size, 3), name="image_input")
    # Preprocess the input image.
    xception_input = keras.applications.xception.preprocess_input(inputs)
    # Generate the embeddings for the images using the xception model.
    embeddings = base(xception_input)
    # Project the embeddings produced by the model.
    outputs = project_embeddings(embeddings, num_projection_layers, projection_dims, dropout_rate)
    # Create the vision encoder model.
    return keras.Model(inputs, outputs, name="vision_encoder")


def create_text_encoder(num_projection_layers, projection_dims, dropout_rate, trainable=False):
    # keras.io: hub.KerasLayer(BERT preprocessing) and hub.KerasLayer(small BERT)["pooled_output"]
    bert = keras.Sequential([layers.Embedding(vocabulary_size, 12), layers.GlobalAveragePooling1D()], name="bert")
    # Set the trainability of the base encoder.
    bert.trainable = trainable
    # Receive the text as inputs.
    inputs = layers.Input(shape=(caption_length,), dtype="int32", name="text_input")
    # Generate embeddings for the preprocessed text using the BERT model.
    embeddings = bert(inputs)
    # Project the embeddings produced by the model.
    outputs = project_embeddings(embeddings, num_projection_layers, projection_dims, dropout_rate)
    # Create the text encoder model.
    return keras.Model(inputs, outputs, name="text_encoder")


def make_dual_encoder_class(Model):
    # keras_dist: class ...(keras.Model) -> class ...(keras_dist.DistributedModel) (`Model` is either)
    class DualEncoder(Model):
        def __init__(self, text_encoder, image_encoder, temperature=1.0, **kwargs):
            super().__init__(**kwargs)
            self.text_encoder = text_encoder
            self.image_encoder = image_encoder
            # CLIP: a learned temperature, as log(1 / temperature) (keras.io: self.temperature = temperature)
            self.logit_scale = self.add_weight(
                shape=(), initializer=keras.initializers.Constant(math.log(1 / temperature)), name="logit_scale"
            )
            self.loss_tracker = keras.metrics.Mean(name="loss")

        @property
        def temperature(self):
            return keras.ops.exp(-self.logit_scale)

        @property
        def metrics(self):
            return [self.loss_tracker]

        def call(self, features, training=False):
            # keras.io places each encoder on a GPU of its own (tf.device("/gpu:0"), tf.device("/gpu:1")).
            # Get the embeddings for the captions.
            caption_embeddings = self.text_encoder(features["caption"], training=training)
            # Get the embeddings for the images.
            image_embeddings = self.image_encoder(features["image"], training=training)
            return caption_embeddings, image_embeddings

        def compute_loss(self, caption_embeddings, image_embeddings):
            # keras_dist: the global batch's embeddings on every replica (the identity on one device)
            caption_embeddings, image_embeddings = keras_dist.ops.all_gather((caption_embeddings, image_embeddings))
            # logits[i][j] is the dot_similarity(caption_i, image_j).
            logits = tf.matmul(caption_embeddings, image_embeddings, transpose_b=True) / self.temperature
            # images_similarity[i][j] is the dot_similarity(image_i, image_j).
            images_similarity = tf.matmul(image_embeddings, image_embeddings, transpose_b=True)
            # captions_similarity[i][j] is the dot_similarity(caption_i, caption_j).
            captions_similarity = tf.matmul(caption_embeddings, caption_embeddings, transpose_b=True)
            # targets[i][j] = avarage dot_similarity(caption_i, caption_j) and dot_similarity(image_i, image_j).
            targets = keras.activations.softmax((captions_similarity + images_similarity) / (2 * self.temperature))
            # Compute the loss for the captions using crossentropy
            captions_loss = keras.losses.categorical_crossentropy(y_true=targets, y_pred=logits, from_logits=True)
            # Compute the loss for the images using crossentropy
            images_loss = keras.losses.categorical_crossentropy(
                y_true=tf.transpose(targets), y_pred=tf.transpose(logits), from_logits=True
            )
            # Return the mean of the loss over the batch.
            return (captions_loss + images_loss) / 2

        def train_step(self, features):
            with tf.GradientTape() as tape:
                # Forward pass
                caption_embeddings, image_embeddings = self(features, training=True)
                loss = self.compute_loss(caption_embeddings, image_embeddings)
            # Backward pass
            gradients = tape.gradient(loss, self.trainable_variables)
            self.optimizer.apply_gradients(zip(gradients, self.trainable_variables))
            # Monitor loss
            self.loss_tracker.update_state(loss)
            return {"loss": self.loss_tracker.result()}

        def test_step(self, features):
            caption_embeddings, image_embeddings = self(features, training=False)
            loss = self.compute_loss(caption_embeddings, image_embeddings)
            self.loss_tracker.update_state(loss)
            return {"loss": self.loss_tracker.result()}

    return DualEncoder


def data():
    rs = np.random.RandomState(23)
    n = 71
    images = rs.randint(0, 256, (n, image_size, image_size, 3)).astype("float32")
    captions = rs.randint(1, vocabulary_size, (n, caption_length)).astype("int32")
    train = {"caption": captions[:51], "image": images[:51]}
    valid = {"caption": captions[51:], "image": images[51:]}
    return train, valid


def get_dataset(features, batch_size):
    # keras.io: TFRecords parsed into {"caption": ..., "image": ...}, shuffled for training
    return tf.data.Dataset.from_tensor_slices(features).batch(batch_size).prefetch(tf.data.AUTOTUNE)


def build(Model, distribute):
    DualEncoder = make_dual_encoder_class(Model)
    vision_encoder = create_vision_encoder(num_projection_layers=1, projection_dims=16, dropout_rate=DROPOUT)
    text_encoder = create_text_encoder(num_projection_layers=1, projection_dims=16, dropout_rate=DROPOUT)
    dual_encoder = DualEncoder(text_encoder, vision_encoder, temperature=0.05)
    dual_encoder.compile(optimizer=keras.optimizers.AdamW(learning_rate=0.001, weight_decay=0.001))
    return dual_encoder


def train(dual_encoder, data):
    train_features, valid_features = data
    num_epochs = 3  # keras.io: 5
    batch_size = 16  # keras.io: 256
    train_dataset = get_dataset(train_features, batch_size)
    valid_dataset = get_dataset(valid_features, batch_size)
    # Create a learning rate scheduler callback.
    reduce_lr = keras.callbacks.ReduceLROnPlateau(monitor="val_loss", factor=0.2, patience=1)  # keras.io: 3
    # Create an early stopping callback.
    early_stopping = keras.callbacks.EarlyStopping(monitor="val_loss", patience=5, restore_best_weights=True)
    history = dual_encoder.fit(
        train_dataset,
        epochs=num_epochs,
        validation_data=valid_dataset,
        callbacks=[reduce_lr, early_stopping],
        verbose=0,
    )
    return {
        "history": history.history,
        "evaluate": dual_encoder.evaluate(valid_dataset, verbose=0, return_dict=True),
        "predict": {"captions": dual_encoder.text_encoder.predict(valid_features["caption"], verbose=0)},
    }
