"""Layer 2: which `tf.distribute.Strategy` to train with, and this process's role.

Owns: turning `strategy="auto"` or a name into one strategy object per process,
refusing strategies keras-dist cannot train with, and the plan printed on the
chief. Must not: build models, read data, or start collectives.
"""

from keras_dist.strategy._plan import Plan, describe, is_chief
from keras_dist.strategy._resolve import STRATEGY_NAMES, choose_strategy_name, resolve_strategy

__all__ = ["STRATEGY_NAMES", "Plan", "choose_strategy_name", "describe", "is_chief", "resolve_strategy"]
