"""Multi-input, multi-output functional model (keras.io/guides/functional_api, "ticket ranking").

One-line change: `keras.Model(inputs=[title_input, body_input, tags_input], outputs=...)` ->
`keras_dist.DistributedModel(inputs=[title_input, body_input, tags_input], outputs=...)`.
Covers: three named inputs fed as a dict, two named outputs as a dict, a loss per output with
`loss_weights`, from-logits binary and categorical crossentropy, per-output metrics and the
`priority_loss`/`department_loss` logs, RMSprop, LSTM; 70 tickets at batch 32 (last batch 6), evaluated at batch 35.
"""

import keras
import numpy as np
from keras import layers

CHANGE = "functional"
num_tags = 12  # Number of unique issue tags
num_words = 100  # Size of vocabulary obtained when preprocessing text data (guide: 10000)
num_departments = 4  # Number of departments for predictions


def data():
    rs = np.random.RandomState(9)
    n = 70
    title_data = rs.randint(num_words, size=(n, 6))
    body_data = rs.randint(num_words, size=(n, 10))
    tags_data = rs.randint(2, size=(n, num_tags)).astype("float32")
    priority_targets = rs.random(size=(n, 1)).astype("float32")
    dept_targets = keras.utils.to_categorical(rs.randint(num_departments, size=n), num_departments)
    return {"title": title_data, "body": body_data, "tags": tags_data}, {
        "priority": priority_targets,
        "department": dept_targets,
    }


def build(Model, distribute):
    title_input = keras.Input(shape=(None,), name="title")  # Variable-length sequence of ints
    body_input = keras.Input(shape=(None,), name="body")  # Variable-length sequence of ints
    tags_input = keras.Input(shape=(num_tags,), name="tags")  # Binary vectors of size `num_tags`

    # Embed each word in the title into a 64-dimensional vector
    title_features = layers.Embedding(num_words, 16)(title_input)
    # Embed each word in the text into a 64-dimensional vector
    body_features = layers.Embedding(num_words, 16)(body_input)

    # Reduce sequence of embedded words in the title into a single 128-dimensional vector
    title_features = layers.LSTM(8)(title_features)
    # Reduce sequence of embedded words in the body into a single 32-dimensional vector
    body_features = layers.LSTM(4)(body_features)

    # Merge all available features into a single large vector via concatenation
    x = layers.concatenate([title_features, body_features, tags_input])

    # Stick a logistic regression for priority prediction on top of the features
    priority_pred = layers.Dense(1, name="priority")(x)
    # Stick a department classifier on top of the features
    department_pred = layers.Dense(num_departments, name="department")(x)

    # Instantiate an end-to-end model predicting both priority and department
    # keras_dist: keras.Model(...) -> keras_dist.DistributedModel(...) (`Model` is either)
    model = Model(
        inputs=[title_input, body_input, tags_input],
        outputs={"priority": priority_pred, "department": department_pred},
    )
    model.compile(
        optimizer=keras.optimizers.RMSprop(1e-3),
        loss={
            "priority": keras.losses.BinaryCrossentropy(from_logits=True),
            "department": keras.losses.CategoricalCrossentropy(from_logits=True),
        },
        loss_weights={"priority": 1.0, "department": 0.2},
        metrics={"priority": ["mae"], "department": ["categorical_accuracy"]},
    )
    return model


def train(model, data):
    x, y = data
    history = model.fit(x, y, epochs=1, batch_size=32, verbose=0)
    return {
        "history": history.history,
        "evaluate": model.evaluate(x, y, batch_size=35, verbose=0, return_dict=True),
        "predict": model.predict(x, batch_size=35, verbose=0),
    }
