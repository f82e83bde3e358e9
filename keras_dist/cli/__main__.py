"""Runs the `keras-dist` command line as `python -m keras_dist.cli`."""

import sys

from keras_dist.cli import main

if __name__ == "__main__":
    sys.exit(main())
