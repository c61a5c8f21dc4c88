"""Parameter-server training with funcopt's RPC DistributedOptimizer.

One parameter server ``ps`` (rank 0) owns a small MLP; N trainer processes
train it together over ``torch.distributed.rpc``, each stepping it through
:class:`funcopt.distributed.DistributedOptimizer` (a drop-in for
``torch.distributed.optim.DistributedOptimizer``).  The code lives in the
package, :mod:`funcopt.demos.rpc` (``funcopt demo --rpc`` runs it briefly,
round-robin and checked); this script is its command line.

Run on one machine (spawns 1 server + N trainers, TensorPipe on loopback)::

    python examples/rpc_parameter_server.py --trainers 2 --steps 200
    python examples/rpc_parameter_server.py --trainers 2 --steps 200 --schedule round-robin

``--schedule round-robin`` makes the trainers take turns, so the run is
deterministic and ``ps`` checks it bitwise against a local run.

Run across machines with ``torchrun``: rank 0 is the parameter server, every
other rank a trainer (``--trainers`` is then ignored).  On each of two
machines, with ``HOST0`` the first one's address::

    TP_SOCKET_IFNAME=eth0 torchrun --nnodes 2 --nproc-per-node 2 --node-rank <0|1> \\
        --master-addr HOST0 --master-port 29500 examples/rpc_parameter_server.py --steps 400

(``TP_SOCKET_IFNAME`` names the network interface TensorPipe should use when
the default one is not reachable from the other machine.)  On one machine:
``torchrun --nproc-per-node 3 examples/rpc_parameter_server.py``.
"""
from funcopt.demos.rpc import main, parse_args  # noqa: F401 (parse_args: for callers of this module)

if __name__ == "__main__":  # spawned ranks re-import this file: launch only here
    raise SystemExit(main())
