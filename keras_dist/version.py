"""The keras-dist version string (PEP 440)."""

__version__ = "0.1.0.dev0"
