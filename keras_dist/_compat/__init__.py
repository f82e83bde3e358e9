"""Layer 3: every workaround for a Keras or TensorFlow bug, version-gated (private).

Owns: the registry of fixes (`registry.FIXES`; switched in `keras_fixes`), the versions each was
verified on, and `is_active(name)`. Layer-1 code asks `is_active` before taking
the fixed path and falls back to plain Keras behaviour otherwise. Importing this
package warns once when the installed Keras or TensorFlow is outside a fix's
verified range (the fix is then off; `KERAS_DIST_FORCE_FIXES` turns it on).
Must not: import from layers 1 or 2. Only this package compares versions.
"""

from keras_dist._compat.keras_fixes import (
    FIXES,
    Fix,
    active_fixes,
    disabled,
    is_active,
    is_forced,
    sums_activity_regularization,
    unverified_fixes,
    warn_if_unverified,
)

__all__ = [
    "FIXES",
    "Fix",
    "active_fixes",
    "disabled",
    "is_active",
    "is_forced",
    "sums_activity_regularization",
    "unverified_fixes",
    "warn_if_unverified",
]

warn_if_unverified()
