#!/usr/bin/env python
"""Optimizer-step throughput: funcopt against the peers a user would pick instead.

The benchmark ships in the package (:mod:`funcopt.bench.step`); this script is
the same command as ``funcopt bench step``, with the same options::

    python benchmarks/step.py                  # the full run (an hour or more on 2 cores)
    python benchmarks/step.py --quick          # smoke run (well under a minute)
    python benchmarks/step.py --algos Adam --sizes 16M,tiny --repeats 30
    python benchmarks/step.py --algos RMSprop,Adam --sizes tiny,1M --threads 1,all --no-compile
    python benchmarks/step.py --algos Lion --sizes 16M --peers "funcopt eager,compiled"  # compiled peers
    python benchmarks/step.py --threads-only   # only the GIL figure
    python benchmarks/step.py --profile --algos Adam --sizes tiny   # TensorBoard traces in runs/step
"""
import sys

from funcopt.bench.step import main

if __name__ == "__main__":
    sys.exit(main())
