"""Layer 3: every workaround for a Keras or TensorFlow bug, version-gated (private).

Owns: the registry of fixes (`keras_fixes.FIXES`), which versions each applies
to, and `is_active(name)`. Layer-1 code asks `is_active` before taking the
fixed path and falls back to plain Keras behaviour otherwise.
Must not: import from layers 1 or 2. Only this package compares versions.
"""

from keras_dist._compat.keras_fixes import FIXES, Fix, active_fixes, disabled, is_active

__all__ = ["FIXES", "Fix", "active_fixes", "disabled", "is_active"]
