"""OCR with a CTC loss added by a layer (keras.io/examples/vision/captcha_ocr).

The example's `CTCLayer`, which adds one CTC loss per example, shape `(batch, 1)`, with
`self.add_loss(...)` and returns the predictions; the model is compiled with an optimizer only,
takes a dict `{"image", "label"}` from a `tf.data` pipeline, and runs Conv2D, MaxPooling2D,
Reshape, Dense and a Bidirectional LSTM; the prediction model is cut from `model.input[0]`.
One-line change: `keras.Model(inputs=[input_img, labels], outputs=output)` ->
`keras_dist.DistributedModel(inputs=[input_img, labels], outputs=output)`.
Changed for the comparison: `keras.ops.ctc_loss` in place of the example's `ctc_batch_cost` (the
same per-example loss), Dropout 0. Covers: an `add_loss` of a per-example vector, which Keras sums
over the batch: keras-dist counted each replica's sum by its share of the examples, half the
loss on 2 even replicas (logged loss 73.97 against 147.67; found by a new-user probe); 55
images of 16x8 at batch 16 (last batch 7), validation 15.
"""

import keras
import numpy as np
import tensorflow as tf
from keras import layers, ops

CHANGE = "functional"
W, H, L, NCH = 16, 8, 4, 6  # image width and height, label length, characters


class CTCLayer(layers.Layer):
    def call(self, y_true, y_pred):
        batch_len = ops.shape(y_true)[0]
        input_length = ops.full((batch_len,), ops.shape(y_pred)[1], dtype="int32")
        label_length = ops.full((batch_len,), ops.shape(y_true)[1], dtype="int32")
        loss = ops.ctc_loss(
            ops.cast(y_true, "int32"), ops.log(y_pred + 1e-7), label_length, input_length, mask_index=NCH
        )
        # Compute the training-time loss value and add it to the layer using `self.add_loss()`.
        self.add_loss(ops.expand_dims(loss, 1))
        # At test time, just return the computed predictions.
        return y_pred

    def compute_output_spec(self, y_true, y_pred):
        return keras.KerasTensor(y_pred.shape, y_pred.dtype)


def data():
    rs = np.random.RandomState(28)
    x = rs.rand(70, W, H, 1).astype("float32")
    y = rs.randint(0, NCH, (70, L)).astype("float32")
    return x, y


def build(Model, distribute):
    input_img = layers.Input(shape=(W, H, 1), name="image", dtype="float32")
    labels = layers.Input(name="label", shape=(None,), dtype="float32")
    x = layers.Conv2D(8, (3, 3), activation="relu", kernel_initializer="he_normal", padding="same", name="Conv1")(
        input_img
    )
    x = layers.MaxPooling2D((2, 2), name="pool1")(x)
    x = layers.Reshape(target_shape=((W // 2), (H // 2) * 8), name="reshape")(x)
    x = layers.Dense(16, activation="relu", name="dense1")(x)
    x = layers.Dropout(0.0)(x)
    x = layers.Bidirectional(layers.LSTM(8, return_sequences=True, dropout=0.0))(x)
    x = layers.Dense(NCH + 1, activation="softmax", name="dense2")(x)
    output = CTCLayer(name="ctc_loss")(labels, x)
    # keras_dist: keras.Model(...) -> keras_dist.DistributedModel(...) (`Model` is either)
    model = Model(inputs=[input_img, labels], outputs=output, name="ocr_model_v1")
    model.compile(optimizer=keras.optimizers.Adam())
    return model


def train(model, data):
    x, y = data
    train_ds = tf.data.Dataset.from_tensor_slices({"image": x[:55], "label": y[:55]}).batch(16)
    val_ds = tf.data.Dataset.from_tensor_slices({"image": x[55:], "label": y[55:]}).batch(16)
    history = model.fit(train_ds, validation_data=val_ds, epochs=3, verbose=0)
    prediction_model = keras.models.Model(model.input[0], model.get_layer(name="dense2").output)
    return {
        "history": history.history,
        "evaluate": model.evaluate(val_ds, verbose=0, return_dict=True),
        "predict": prediction_model.predict(x[55:], verbose=0),
    }
