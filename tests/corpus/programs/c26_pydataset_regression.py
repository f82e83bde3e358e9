"""Training on a `PyDataset` of array slices (keras.io/guides/training_with_built_in_methods, "Using a PyDataset").

One-line change: `keras.Model(inputs, outputs)` -> `keras_dist.DistributedModel(inputs, outputs)`.
The guide's `ExamplePyDataset` as written (batches are slices of the arrays), for a regression
target: a Dense model, Adam(1e-3), mean squared error and mean absolute error, 3 epochs with a
validation `PyDataset`, then evaluate and predict on one. 200 training examples at batch 32 (last
batch 8; the guide: MNIST at batch 32), 64 validation examples.
Covers: Python batches split over replicas, and the arrays they slice staying as the user made
them (compat fix `python_batches_written_in_place`: without it, under 2 replicas the targets held
loss terms after the first epoch, and epochs 2 and 3 trained on them).
The arrays are placed on a 64-byte boundary, where NumPy puts an array about one time in four
(the allocator decides; a user's arrays are there or not): it makes the comparison the same every run.
"""

import keras
import numpy as np

CHANGE = "functional"


def on_a_64_byte_boundary(values):
    """Returns a copy of the float32 array `values` whose memory starts on a 64-byte boundary (also used by tests/compat)."""
    raw = np.empty(values.size + 16, dtype="float32")
    start = (-(raw.ctypes.data % 64) // 4) % 16
    aligned = raw[start : start + values.size].reshape(values.shape)
    aligned[:] = values
    return aligned


def data():
    rs = np.random.RandomState(26)
    x = rs.randn(264, 16).astype("float32")
    y = (x[:, :4] @ rs.randn(4, 1) + 0.1 * rs.randn(264, 1)).astype("float32")
    x, y = on_a_64_byte_boundary(x), on_a_64_byte_boundary(y)
    return (x[:200], y[:200]), (x[200:], y[200:])


class ExamplePyDataset(keras.utils.PyDataset):
    def __init__(self, x, y, batch_size, **kwargs):
        super().__init__(**kwargs)
        self.x = x
        self.y = y
        self.batch_size = batch_size

    def __len__(self):
        return int(np.ceil(len(self.x) / float(self.batch_size)))

    def __getitem__(self, idx):
        batch_x = self.x[idx * self.batch_size : (idx + 1) * self.batch_size]
        batch_y = self.y[idx * self.batch_size : (idx + 1) * self.batch_size]
        return batch_x, batch_y


def build(Model, distribute):
    inputs = keras.Input(shape=(16,), name="features")
    x = keras.layers.Dense(32, activation="relu", name="dense_1")(inputs)  # the guide: 64
    x = keras.layers.Dense(32, activation="relu", name="dense_2")(x)
    outputs = keras.layers.Dense(1, name="predictions")(x)
    # keras_dist: the one line a user changes (keras.Model -> keras_dist.DistributedModel)
    model = Model(inputs=inputs, outputs=outputs)
    model.compile(
        optimizer=keras.optimizers.Adam(learning_rate=1e-3),
        loss=keras.losses.MeanSquaredError(),
        metrics=[keras.metrics.MeanAbsoluteError()],
    )
    return model


def train(model, data):
    (x_train, y_train), (x_val, y_val) = data
    train_py_dataset = ExamplePyDataset(x_train, y_train, batch_size=32)
    val_py_dataset = ExamplePyDataset(x_val, y_val, batch_size=32)
    history = model.fit(train_py_dataset, validation_data=val_py_dataset, epochs=3, verbose=0)
    return {
        "history": history.history,
        "evaluate": model.evaluate(val_py_dataset, verbose=0, return_dict=True),
        "predict": model.predict(val_py_dataset, verbose=0),
        "targets_after": y_train,
    }
