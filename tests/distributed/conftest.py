"""Distributed tests: ranks are spawned processes (see ``_dist_harness.py``).

This directory goes on ``sys.path`` so that the test modules, and the spawned
children (spawn hands them the parent's ``sys.path``), import the helper
modules ``_dist_*`` by name whatever pytest's import mode.
"""
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

@pytest.fixture(scope="session")
def dist_tmp(tmp_path_factory):
    """A session directory for spawn rendezvous files, results and checkpoints."""
    return tmp_path_factory.mktemp("dist")
