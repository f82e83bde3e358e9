"""Layer 3: adapters to TensorFlow's runtime and Keras' internals (private).

Owns: every import of `keras.src.*` and `tensorflow.python.*`, device set-up,
and re-homing variables onto a `tf.distribute.Strategy`.
Must not: decide policy (which strategy, which fix); layers 1 and 2 decide, this
package only carries it out. Nothing here imports from layers 1 or 2.
"""
