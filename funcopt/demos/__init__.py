"""What ``funcopt demo`` runs; everything ships in the package.

* :mod:`funcopt.demos.local`: ``funcopt demo``: torch.optim.Adam(fused=True)
  against scripted funcopt.Adam on one small MLP, bitwise;
* :mod:`funcopt.demos.zero`: ``funcopt demo --zero 1|2|3``: the same MLP
  trained sharded over local gloo ranks (or torchrun's), checked against a
  single-process torch.optim run;
* :mod:`funcopt.demos.rpc`: ``funcopt demo --rpc``: a parameter server and
  trainers over torch.distributed.rpc with funcopt's DistributedOptimizer
  (``examples/rpc_parameter_server.py`` is a thin script over it).

Importing this package imports nothing heavy and scripts nothing.
"""
