"""Layer 1: Keras callbacks made safe on several workers.

Owns: adapting the callbacks a user passes to `DistributedModel.fit` (chief-only
logs, chief-only atomic writes, agreed `stop_training`) and the collectives that
run between steps for them (`WorkerAgreement`). Must not: change what a
callback computes, or write files on non-chief workers under the user's paths.
"""

__all__ = []
