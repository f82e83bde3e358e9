"""Large-scale multi-label text classification (keras.io/examples/nlp/multi_label_classification).

One-line change: `shallow_mlp_model = keras_dist.distribute(shallow_mlp_model)` after `make_model()`.
Text is vectorized in the `tf.data` pipeline with `TextVectorization(ngrams=2,
output_mode="tf_idf")` adapted on the training text, and the labels (lists of terms, ragged)
are multi-hot encoded with `StringLookup(output_mode="multi_hot")`, as keras.io does; then an
end-to-end `keras.Sequential([text_vectorizer, shallow_mlp_model])` predicts from raw strings.
The training shuffle has a seed (keras.io leaves it unseeded) so both runs see one order.
Covers: tf.data input (batched, shuffled, mapped), preprocessing layers adapted outside the
model, a multi-label sigmoid output, binary crossentropy, binary accuracy, Adam, predict on
strings through a plain Sequential holding the trained model; 100 abstracts at batch 32
(last batch 4).
"""

import keras
import numpy as np
import tensorflow as tf
from keras import layers

CHANGE = "distribute"
batch_size = 32  # keras.io: 128
TERMS = ["cs.LG", "cs.CV", "stat.ML", "cs.CL", "eess.IV"]
WORDS = "image network learning deep graph language model vision training data neural loss text attention segmentation".split()


def data():
    rs = np.random.RandomState(11)

    def abstracts(n):
        texts, terms = [], []
        for _ in range(n):
            words = rs.choice(WORDS, size=rs.randint(4, 12))
            texts.append(" ".join(words))
            k = int(rs.randint(1, 3))
            terms.append(sorted({TERMS[(len(w) + i) % len(TERMS)] for i, w in enumerate(words[:k])}))
        return np.array(texts), terms

    return abstracts(100), abstracts(30)


def make_dataset(texts, terms, lookup, is_train=True):
    labels = tf.ragged.constant(terms)
    label_binarized = lookup(labels).numpy()
    dataset = tf.data.Dataset.from_tensor_slices((texts, label_binarized))
    dataset = dataset.shuffle(batch_size * 10, seed=1) if is_train else dataset
    return dataset.batch(batch_size)


def preprocessing(data):
    (train_texts, train_terms), (test_texts, test_terms) = data
    terms = tf.ragged.constant(train_terms)
    lookup = layers.StringLookup(output_mode="multi_hot")
    lookup.adapt(terms)
    train_dataset = make_dataset(train_texts, train_terms, lookup, is_train=True)
    test_dataset = make_dataset(test_texts, test_terms, lookup, is_train=False)
    vocabulary_size = 60
    text_vectorizer = layers.TextVectorization(max_tokens=vocabulary_size, ngrams=2, output_mode="tf_idf")
    text_vectorizer.adapt(train_dataset.map(lambda text, label: text))
    auto = tf.data.AUTOTUNE
    train_dataset = train_dataset.map(
        lambda text, label: (text_vectorizer(text), label), num_parallel_calls=auto
    ).prefetch(auto)
    test_dataset = test_dataset.map(
        lambda text, label: (text_vectorizer(text), label), num_parallel_calls=auto
    ).prefetch(auto)
    return lookup, text_vectorizer, train_dataset, test_dataset


def build(Model, distribute):
    lookup, text_vectorizer, _, _ = preprocessing(data())

    def make_model():
        shallow_mlp_model = keras.Sequential(
            [
                keras.Input(shape=(text_vectorizer.vocabulary_size(),)),
                layers.Dense(32, activation="relu"),  # keras.io: 512
                layers.Dense(16, activation="relu"),  # keras.io: 256
                layers.Dense(lookup.vocabulary_size(), activation="sigmoid"),
            ]  # More on why "sigmoid" has been used here in a moment.
        )
        return shallow_mlp_model

    shallow_mlp_model = make_model()
    shallow_mlp_model = distribute(
        shallow_mlp_model
    )  # keras_dist: the one line a user adds (the identity on one device)
    shallow_mlp_model.compile(loss="binary_crossentropy", optimizer="adam", metrics=["binary_accuracy"])
    return shallow_mlp_model


def train(shallow_mlp_model, data):
    lookup, text_vectorizer, train_dataset, test_dataset = preprocessing(data)
    history = shallow_mlp_model.fit(train_dataset, epochs=1, verbose=0)
    _, binary_acc = shallow_mlp_model.evaluate(test_dataset, verbose=0)
    # Create a model for inference.
    model_for_inference = keras.Sequential([text_vectorizer, shallow_mlp_model])
    (_, _), (test_texts, _) = data
    return {
        "history": history.history,
        "evaluate": {"binary_accuracy": binary_acc},
        "predict": {
            "vectorized": shallow_mlp_model.predict(test_dataset, verbose=0),
            "end_to_end": model_for_inference.predict(tf.constant(test_texts[:8]), verbose=0),
        },
    }
