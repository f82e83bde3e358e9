"""Installed Keras and TensorFlow versions, parsed once with `packaging.version`."""

import keras
import tensorflow as tf
from packaging.version import Version

KERAS_VERSION = Version(keras.__version__)
TF_VERSION = Version(tf.__version__)

INSTALLED = {"keras": KERAS_VERSION, "tensorflow": TF_VERSION}
