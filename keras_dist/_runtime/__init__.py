"""Layer 3: adapters to TensorFlow's runtime and Keras' internals (private).

Owns: every import of `keras.src.*` and `tensorflow.python.*`, device set-up,
and re-homing variables onto a `tf.distribute.Strategy`. `callbacks`, `data`,
`strategy` and `distribute` reach private attributes of Keras and TensorFlow
objects, and replace methods on them, only through named functions here
(`keras_internals`, `backup_and_restore`, `distribute_dataset`), each with a
docstring saying what it reaches or replaces and why; so do `_model` and
`collectives` (the one Keras attribute they touch is `_distribute_strategy`,
which `DistributedModel` sets itself).
Must not: decide policy (which strategy, which fix); layers 1 and 2 decide, this
package only carries it out. Imports: TensorFlow, Keras, `keras_dist._env`, `keras_dist._process`,
`keras_dist.errors`, `keras_dist._compat` (`locations`: where the installed Keras or TensorFlow
keeps a private name; `sums_activity_regularization`: which form of the loss the installed Keras
computes) and this package only; nothing from layers 1 or 2.
"""
