"""`strategy="tpu"` where TensorFlow finds no TPU: keras-dist's message, not TensorFlow's bare one.

No TPU and no tensorflow-tpu here: TensorFlow's failures are replayed by stand-ins for its resolver.
"""

import pytest
import tensorflow as tf

from keras_dist.strategy import _resolve


@pytest.fixture
def no_tpu(monkeypatch):
    for var in ("TPU_NAME", "COLAB_TPU_ADDR"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(_resolve, "_RESOLVED", {})  # Nothing cached from another test.


def test_tpu_without_a_tpu_says_what_was_expected_found_and_how_to_fix(no_tpu, monkeypatch):
    def resolver(tpu):
        assert tpu == ""  # No address found: TensorFlow is asked to find one.
        raise ValueError("Please provide a TPU Name to connect to.")  # TensorFlow 2.20's words (tpu/client/client.py)

    monkeypatch.setattr(tf.distribute.cluster_resolver, "TPUClusterResolver", resolver)
    with pytest.raises(RuntimeError) as info:
        _resolve.resolve_strategy("tpu")
    message = str(info.value)
    assert message.startswith('strategy="tpu" needs a TPU that TensorFlow can reach. Expected: a Colab TPU runtime')
    for text in (
        "Received: TensorFlow could not connect to a TPU: TPU_NAME and COLAB_TPU_ADDR are unset",
        "(devices: CPU:0",
        "; installed: tensorflow 2.",
        "no libtpu)",
        "TensorFlow said: ValueError: Please provide a TPU Name to connect to.",
        "Fix: on Colab choose Runtime > Change runtime type > TPU",
        'use strategy="auto".',
    ):
        assert text in message
    assert info.value.__cause__ is None and info.value.__suppress_context__
    assert "tpu" not in _resolve._RESOLVED


def test_tpu_named_but_unreachable_names_the_address_and_tensorflows_error(no_tpu, monkeypatch):
    monkeypatch.setenv("TPU_NAME", "grpc://10.0.0.2:8470")
    monkeypatch.setattr(tf.distribute.cluster_resolver, "TPUClusterResolver", lambda tpu: tpu)
    monkeypatch.setattr(tf.config, "experimental_connect_to_cluster", lambda resolver: None)

    def initialize(resolver):
        raise tf.errors.UnavailableError(None, None, "failed to connect to all addresses\nmore detail")

    monkeypatch.setattr(tf.tpu.experimental, "initialize_tpu_system", initialize)
    with pytest.raises(RuntimeError, match="connect to the TPU at 'grpc://10.0.0.2:8470'") as info:
        _resolve.resolve_strategy("tpu")
    assert "TensorFlow said: UnavailableError: failed to connect to all addresses Fix:" in str(info.value)


def test_auto_without_a_tpu_does_not_try_one(no_tpu, monkeypatch):
    def resolver(tpu):
        raise AssertionError("auto must not ask TensorFlow for a TPU where none was found")

    monkeypatch.setattr(tf.distribute.cluster_resolver, "TPUClusterResolver", resolver)
    assert not isinstance(_resolve.resolve_strategy("auto"), tf.distribute.TPUStrategy)
