"""Session set-up: 4 simulated CPU devices and oneDNN off, before TensorFlow starts.

Topology fixtures follow `<workers>x<replicas per worker>_<device>`; a test that
needs another device count runs in a subprocess.
"""

import os

# oneDNN's CPU kernels round differently at different batch sizes (about 1e-3 after a few
# steps): off, one device and N replicas agree to float rounding. It must be set before
# TensorFlow is imported (here: keras_dist.testing below); worker processes inherit it.
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_DIST_QUIET", "1")
os.environ.pop("TF_CONFIG", None)
os.environ.pop(  # The session's own split below is the only one.
    "KERAS_DIST_CPU_REPLICAS", None
)

import keras_dist.testing  # noqa: E402

NUM_CPU_DEVICES = 4
keras_dist.testing.simulate_cpu_devices(NUM_CPU_DEVICES)

import keras  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402


def mirrored(num_replicas):
    return tf.distribute.MirroredStrategy(
        [f"/cpu:{i}" for i in range(num_replicas)],
        cross_device_ops=tf.distribute.ReductionToOneDevice(),
    )


@pytest.fixture(scope="session")
def mirrored_1x2_cpu():
    return mirrored(2)


@pytest.fixture(scope="session")
def mirrored_1x3_cpu():
    return mirrored(3)


@pytest.fixture(scope="session")
def mirrored_1x2_cpu_collective():
    """MirroredStrategy with TensorFlow's default all-reduce (collective ops, as users and several workers get).

    One per session: two collective strategies in one process reuse collective instance keys
    and fail with 'Shape mismatch in the collective instance'.
    """
    return tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])


@pytest.fixture(params=[2, 3], ids=["mirrored_1x2_cpu", "mirrored_1x3_cpu"], scope="session")
def multi_replica_strategy(request):
    return mirrored(request.param)


@pytest.fixture(autouse=True)
def _seed():
    keras.utils.set_random_seed(1234)
