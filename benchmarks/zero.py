#!/usr/bin/env python
"""ZeRO step+sync time and per-rank memory: funcopt against DDP and torch's ZeroRedundancyOptimizer.

The benchmark ships in the package (:mod:`funcopt.bench.zero`); this script is
the same command as ``funcopt bench zero``, with the same options::

    python benchmarks/zero.py                          # W=2, 16M parameters
    python benchmarks/zero.py --params 64M --iters 10 --peers ddp_adam,torch_zero,f_flat,f_flat_bv
    python benchmarks/zero.py --peers ddp_adam,f_flat --profile   # TensorBoard trace in runs/zero
    torchrun --standalone --nproc-per-node 2 benchmarks/zero.py
"""
import sys

from funcopt.bench.zero import main

if __name__ == "__main__":  # spawned ranks re-import this file: launch only here
    sys.exit(main())
