"""Layer 1: Keras callbacks made safe on several workers.

Owns: adapting the callbacks a user passes to `DistributedModel.fit` (chief-only
logs, chief-only atomic writes, agreed `stop_training`), the collectives that
run between steps for them (`WorkerAgreement`), and the callbacks of our own:
`LearningRateWarmup`, `ThroughputMonitor`, `RetracingMonitor`, `Timeline`. Must not:
change what a callback computes, or write files on non-chief workers under the
user's paths (except `Timeline`'s, one file per worker by request).
"""

from keras_dist.callbacks._monitors import RetracingMonitor, ThroughputMonitor
from keras_dist.callbacks._timeline import Timeline
from keras_dist.callbacks._warmup import LearningRateWarmup

__all__ = ["LearningRateWarmup", "RetracingMonitor", "ThroughputMonitor", "Timeline"]
