"""Framework integration tests: this directory goes on ``sys.path`` so that the test
modules (and a framework's spawned children) import ``_common`` by name."""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)
