"""The corpus programs, one module each (`cNN_name.py`); `NAMES` lists them in order."""

import os

NAMES = sorted(
    name[:-3]
    for name in os.listdir(os.path.dirname(os.path.abspath(__file__)))
    if name.startswith("c") and name[1:3].isdigit() and name.endswith(".py")
)
