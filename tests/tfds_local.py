"""Offline TFDS fixtures: a real, small, sharded TFDS dataset built from sklearn digits.

Importable without pytest. Nothing here touches the network:

* the data comes from ``sklearn.datasets.load_digits`` (bundled with sklearn);
* ``tfds.core.utils.gcs_utils._is_gcs_disabled`` is True by default in
  tensorflow-datasets 4.9.10 (we force it anyway) and ``try_download_gcs=False``
  is passed when preparing, so no ``gs://tfds-data`` lookup is attempted.

Usage::

    from tfds_local import build_digits_tfds   # tests/ is on sys.path under pytest
    name = build_digits_tfds(str(tmp_path), num_shards=4)
    ds = tfds.load(name, split="train", data_dir=str(tmp_path))
    files = digits_shard_files(str(tmp_path), "train")   # the 4 TFRecord paths

Mocking a standard registered dataset (no data, no metadata, no network)::

    with tfds.testing.mock_data(num_examples=8,
                                policy=tfds.testing.MockPolicy.USE_CODE):
        ds = tfds.load("mnist", split="train")   # 8 random examples

``mock_mnist`` below wraps that snippet.
"""

from __future__ import annotations

import contextlib
import os

import numpy as np
import tensorflow_datasets as tfds

DIGITS_NAME = "keras_dist_digits"
NUM_TRAIN = 1500  # train = rows [0, 1500), test = rows [1500, 1797)
NUM_TOTAL = 1797


def _disable_gcs() -> None:
    try:
        from tensorflow_datasets.core.utils import gcs_utils

        gcs_utils._is_gcs_disabled = True
    except Exception:  # pragma: no cover - layout differs in other tfds versions
        pass


_disable_gcs()


def _already_registered(name: str) -> bool:
    # Importing this file under two module names (e.g. `tfds_local` and
    # `tests.tfds_local`) would otherwise raise "already registered".
    try:
        from tensorflow_datasets.core import registered

        return name in registered._DATASET_REGISTRY
    except Exception:  # pragma: no cover
        return False


class KerasDistDigits(tfds.core.GeneratorBasedBuilder, skip_registration=_already_registered(DIGITS_NAME)):
    """sklearn's 8x8 digits as a TFDS dataset; ``id`` is the sklearn row index."""

    # Registered (by class definition) under the name "keras_dist_digits".
    name = DIGITS_NAME
    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "Initial release."}

    def _info(self) -> tfds.core.DatasetInfo:
        return tfds.core.DatasetInfo(
            builder=self,
            description="sklearn load_digits, 8x8x1 uint8 images (pixels 0-16 scaled x16).",
            features=tfds.features.FeaturesDict(
                {
                    "image": tfds.features.Image(shape=(8, 8, 1), dtype=np.uint8),
                    "label": tfds.features.ClassLabel(num_classes=10),
                    "id": np.int64,
                }
            ),
            supervised_keys=("image", "label"),
        )

    def _split_generators(self, dl_manager):
        del dl_manager  # nothing to download
        return {
            "train": self._generate_examples(0, NUM_TRAIN),
            "test": self._generate_examples(NUM_TRAIN, NUM_TOTAL),
        }

    def _generate_examples(self, start, stop):
        from sklearn.datasets import load_digits

        digits = load_digits()
        images = np.clip(digits.images * 16.0, 0, 255).astype(np.uint8)[..., None]
        for i in range(start, stop):
            yield i, {"image": images[i], "label": int(digits.target[i]), "id": i}


@contextlib.contextmanager
def _quiet_progress():
    """Hides tfds' progress bars while preparing, restoring the previous setting."""
    try:
        from tensorflow_datasets.core.utils import tqdm_utils

        was = tqdm_utils._active
    except Exception:  # pragma: no cover
        yield
        return
    tfds.display_progress_bar(False)
    try:
        yield
    finally:
        tfds.display_progress_bar(was)


def digits_shard_files(data_dir: str, split: str = "train") -> list[str]:
    """Sorted TFRecord shard paths of one split of the built dataset."""
    builder = tfds.builder(DIGITS_NAME, data_dir=data_dir)
    prefix = f"{DIGITS_NAME}-{split}.tfrecord-"
    return sorted(os.path.join(builder.data_dir, f) for f in os.listdir(builder.data_dir) if f.startswith(prefix))


def build_digits_tfds(data_dir: str, num_shards: int = 4) -> str:
    """Prepares ``keras_dist_digits`` under ``data_dir``; returns its name.

    The ``train`` split (1500 examples) is written as exactly ``num_shards``
    TFRecord files; ``test`` (297 examples) likewise, up to its size.
    Note that TFDS writes examples in hashed-key order, so shard k does NOT
    hold a contiguous id range; use the ``id`` feature to check coverage.
    Rebuilds if the directory holds a build with another shard count.
    Takes about 1-2 s on 2 CPU cores.
    """
    if num_shards < 1:
        raise ValueError("num_shards must be >= 1")
    data_dir = os.fspath(data_dir)
    builder = tfds.builder(DIGITS_NAME, data_dir=data_dir)
    mode = tfds.download.GenerateMode.REUSE_DATASET_IF_EXISTS
    if builder.is_prepared() and len(digits_shard_files(data_dir)) != num_shards:
        mode = tfds.download.GenerateMode.FORCE_REDOWNLOAD
    config = tfds.download.DownloadConfig(
        num_shards=num_shards,  # tfds >= 4.9.3; honoured exactly by the writer
        try_download_gcs=False,
        download_mode=mode,
    )
    with _quiet_progress():
        builder.download_and_prepare(download_config=config)
    got = len(digits_shard_files(data_dir))
    if got != num_shards:  # pragma: no cover - guards against a tfds change
        raise RuntimeError(f"expected {num_shards} train shards, tfds wrote {got}")
    return DIGITS_NAME


@contextlib.contextmanager
def mock_mnist(num_examples: int = 8):
    """``tfds.load("mnist", ...)`` yields ``num_examples`` random examples, offline.

    USE_CODE builds the features from the dataset's code, so no metadata files
    and no data_dir are needed (AUTO would look for metadata under data_dir first,
    then fall back to USE_CODE).
    """
    with tfds.testing.mock_data(num_examples=num_examples, policy=tfds.testing.MockPolicy.USE_CODE):
        yield
