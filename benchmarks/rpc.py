#!/usr/bin/env python
"""Parameter-server optimizer steps: funcopt's RPC DistributedOptimizer vs torch's.

The benchmark ships in the package (:mod:`funcopt.bench.rpc`); this script is
the same command as ``funcopt bench rpc``, with the same options::

    python benchmarks/rpc.py                      # everything (see docs/benchmarks.md for times)
    python benchmarks/rpc.py --server only        # the server-alone GIL table only
    python benchmarks/rpc.py --models small --optims adam --trainers 1,4 --server no
    python benchmarks/rpc.py --profile            # also a TensorBoard trace per peer in runs/rpc
"""
import sys

from funcopt.bench.rpc import main

if __name__ == "__main__":  # spawned ranks re-import this file: launch only here
    sys.exit(main())
