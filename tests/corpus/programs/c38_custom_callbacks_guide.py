"""keras.io's "Writing your own callbacks" guide: a learning-rate scheduler and early stopping of one's own.

The guide's `CustomLearningRateScheduler` (reads `optimizer.learning_rate`, sets
`optimizer.learning_rate = scheduled_lr`) and `EarlyStoppingAtMinLoss` (`get_weights` /
`set_weights`, `stop_training`), plus a logging callback as users write one:
`logs["lr"] = float(self.model.optimizer.learning_rate)`, `int(self.model.optimizer.iterations)`
(under a strategy these raised TypeError ... 'MirroredVariable' until the `variable_scalar_conversion`
compat fix; a new-user probe). One-line change: `model = keras_dist.distribute(model)` after compile.
Covers: RMSprop whose learning rate a callback sets each epoch, float()/int() of optimizer variables,
100 examples at batch 16 (last batch 4).
"""

import keras
import numpy as np
from keras import layers

CHANGE = "distribute"

LR_SCHEDULE = [(1, 0.05), (2, 0.01), (3, 0.005)]


def lr_schedule(epoch, lr):
    """Helper function to retrieve the scheduled learning rate based on epoch (the guide's)."""
    if epoch < LR_SCHEDULE[0][0] or epoch > LR_SCHEDULE[-1][0]:
        return lr
    for i in range(len(LR_SCHEDULE)):
        if epoch == LR_SCHEDULE[i][0]:
            return LR_SCHEDULE[i][1]
    return lr


class CustomLearningRateScheduler(keras.callbacks.Callback):
    """Learning rate scheduler which sets the learning rate according to schedule (the guide's)."""

    def __init__(self, schedule):
        super().__init__()
        self.schedule = schedule

    def on_epoch_begin(self, epoch, logs=None):
        if not hasattr(self.model.optimizer, "learning_rate"):
            raise ValueError('Optimizer must have a "learning_rate" attribute.')
        lr = self.model.optimizer.learning_rate
        scheduled_lr = self.schedule(epoch, lr)
        self.model.optimizer.learning_rate = scheduled_lr


class EarlyStoppingAtMinLoss(keras.callbacks.Callback):
    """Stop training when the loss is at its min, i.e. the loss stops decreasing (the guide's)."""

    def __init__(self, patience=0):
        super().__init__()
        self.patience = patience
        self.best_weights = None

    def on_train_begin(self, logs=None):
        self.wait = 0
        self.stopped_epoch = 0
        self.best = np.inf

    def on_epoch_end(self, epoch, logs=None):
        current = logs.get("loss")
        if np.less(current, self.best):
            self.best = current
            self.wait = 0
            self.best_weights = self.model.get_weights()
        else:
            self.wait += 1
            if self.wait >= self.patience:
                self.stopped_epoch = epoch
                self.model.stop_training = True
                self.model.set_weights(self.best_weights)


class LogOptimizer(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        logs["lr"] = float(self.model.optimizer.learning_rate)
        logs["iterations"] = int(self.model.optimizer.iterations)


def data():
    rs = np.random.RandomState(38)
    x = rs.randn(140, 8).astype("float32")
    y = (x[:, :1] * 2.0 - np.tanh(x[:, 1:2]) + 0.1 * rs.randn(140, 1)).astype("float32")
    return (x[:100], y[:100]), (x[100:], y[100:])


def build(Model, distribute):
    inputs = keras.Input((8,))
    x = layers.Dense(16, activation="relu")(inputs)
    model = Model(inputs, layers.Dense(1)(x))
    model.compile(
        optimizer=keras.optimizers.RMSprop(learning_rate=0.1),
        loss="mean_squared_error",
        metrics=["mean_absolute_error"],
    )
    return distribute(model)  # keras_dist: model = keras_dist.distribute(model)


def train(model, data):
    (x, y), (x_val, y_val) = data
    callbacks = [CustomLearningRateScheduler(lr_schedule), EarlyStoppingAtMinLoss(patience=1), LogOptimizer()]
    history = model.fit(x, y, batch_size=16, epochs=4, shuffle=False, verbose=0, callbacks=callbacks)
    return {
        "history": history.history,
        "evaluate": model.evaluate(x_val, y_val, batch_size=16, verbose=0, return_dict=True),
        "predict": model.predict(x_val, verbose=0),
    }
