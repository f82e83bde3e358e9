"""keras.io "Image captioning" (vision/image_captioning), scaled down: several captions per image.

One-line change: `class ImageCaptioningModel(keras.Model)` ->
`class ImageCaptioningModel(keras_dist.DistributedModel)`.
Changed for the comparison: the CNN and the transformer encoder/decoder are replaced by small
Dense/Embedding layers (the step is what is tested); the data are synthetic token sequences.
Covers keras.io's `train_step` as written: a Python loop over the captions of each image, one
`tf.GradientTape` and one `apply_gradients` per caption, the masked ratio loss
`tf.reduce_sum(loss * mask) / tf.reduce_sum(mask)` of a `reduction=None` compiled loss, a masked
accuracy written the same way, `batch_loss += loss` over the captions into a `Mean` tracker (a sum
of ratios: before, logged 5.2e-2 off, counted by examples) and `optimizer.iterations` advancing
twice per step (before, set back to one per step at each epoch's end); `test_step`, `evaluate`.
101 images with 2 captions each in a `tf.data` pipeline at batch 16 (last batch 5), 2 epochs.
"""

import keras
import numpy as np
import tensorflow as tf

CHANGE = "subclass"
CAPTIONS, LENGTH, VOCABULARY = 2, 7, 12


def data():
    rs = np.random.RandomState(36)
    images = rs.randn(101, 6).astype("float32")
    captions = np.zeros((101, CAPTIONS, LENGTH), "int32")
    for i in range(101):
        for c in range(CAPTIONS):
            length = rs.randint(2, LENGTH + 1)
            captions[i, c, 0] = 1
            words = (np.abs(images[i, :1]) * 3 + np.arange(length - 1) + c).astype(int) % (VOCABULARY - 2) + 2
            captions[i, c, 1:length] = words
    return images, captions


def make_captioning_class(Model):
    # keras_dist: class ImageCaptioningModel(keras.Model) -> (keras_dist.DistributedModel) (`Model` is either)
    class ImageCaptioningModel(Model):
        def __init__(self, num_captions_per_image=CAPTIONS):
            super().__init__()
            self.encoder = keras.layers.Dense(8, activation="relu")
            self.embedding = keras.layers.Embedding(VOCABULARY, 8)
            self.hidden = keras.layers.Dense(16, activation="tanh")
            self.out = keras.layers.Dense(VOCABULARY, activation="softmax")
            self.loss_tracker = keras.metrics.Mean(name="loss")
            self.acc_tracker = keras.metrics.Mean(name="accuracy")
            self.num_captions_per_image = num_captions_per_image

        def decoder(self, seq_inp, encoder_out, training=False):
            return self.out(self.hidden(self.embedding(seq_inp) + encoder_out[:, None, :]))

        def call(self, inputs):
            img, seq = inputs
            return self.decoder(seq[:, :-1], self.encoder(img))

        def calculate_loss(self, y_true, y_pred, mask):
            loss = self.loss(y_true, y_pred)
            mask = tf.cast(mask, dtype=loss.dtype)
            loss *= mask
            return tf.reduce_sum(loss) / tf.reduce_sum(mask)

        def calculate_accuracy(self, y_true, y_pred, mask):
            accuracy = tf.equal(y_true, tf.argmax(y_pred, axis=2, output_type=y_true.dtype))
            accuracy = tf.math.logical_and(mask, accuracy)
            accuracy = tf.cast(accuracy, dtype=tf.float32)
            mask = tf.cast(mask, dtype=tf.float32)
            return tf.reduce_sum(accuracy) / tf.reduce_sum(mask)

        def _compute_caption_loss_and_acc(self, img_embed, batch_seq, training=True):
            encoder_out = self.encoder(img_embed, training=training)
            batch_seq_inp = batch_seq[:, :-1]
            batch_seq_true = batch_seq[:, 1:]
            mask = tf.math.not_equal(batch_seq_true, 0)
            batch_seq_pred = self.decoder(batch_seq_inp, encoder_out, training=training)
            loss = self.calculate_loss(batch_seq_true, batch_seq_pred, mask)
            acc = self.calculate_accuracy(batch_seq_true, batch_seq_pred, mask)
            return loss, acc

        def train_step(self, batch_data):
            batch_img, batch_seq = batch_data
            batch_loss = 0
            batch_acc = 0
            for i in range(self.num_captions_per_image):
                with tf.GradientTape() as tape:
                    loss, acc = self._compute_caption_loss_and_acc(batch_img, batch_seq[:, i, :], training=True)
                    batch_loss += loss
                    batch_acc += acc
                train_vars = self.trainable_variables
                grads = tape.gradient(loss, train_vars)
                self.optimizer.apply_gradients(zip(grads, train_vars))
            batch_acc /= float(self.num_captions_per_image)
            self.loss_tracker.update_state(batch_loss)
            self.acc_tracker.update_state(batch_acc)
            return {"loss": self.loss_tracker.result(), "acc": self.acc_tracker.result()}

        def test_step(self, batch_data):
            batch_img, batch_seq = batch_data
            batch_loss = 0
            batch_acc = 0
            for i in range(self.num_captions_per_image):
                loss, acc = self._compute_caption_loss_and_acc(batch_img, batch_seq[:, i, :], training=False)
                batch_loss += loss
                batch_acc += acc
            batch_acc /= float(self.num_captions_per_image)
            self.loss_tracker.update_state(batch_loss)
            self.acc_tracker.update_state(batch_acc)
            return {"loss": self.loss_tracker.result(), "acc": self.acc_tracker.result()}

        @property
        def metrics(self):
            return [self.loss_tracker, self.acc_tracker]

    return ImageCaptioningModel


def build(Model, distribute):
    model = make_captioning_class(Model)()
    images, captions = data()
    model((images[:2], captions[:2, 0]))
    model.compile(
        optimizer=keras.optimizers.Adam(0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=False, reduction=None),
    )
    return model


def train(model, data):
    images, captions = data
    dataset = tf.data.Dataset.from_tensor_slices((images, captions)).batch(16)
    history = model.fit(dataset, epochs=2, verbose=0)
    evaluation = model.evaluate(dataset, verbose=0, return_dict=True)
    return {
        "history": history.history,
        "evaluate": evaluation,
        "iterations": int(model.optimizer.iterations.numpy()),
        "predict": model.predict((images[:16], captions[:16, 0]), verbose=0),
    }
