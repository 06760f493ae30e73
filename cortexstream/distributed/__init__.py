"""Several ranks (processes, machines) running one model tensor-parallel: rank 0 schedules, every rank computes
its shard. See docs/distributed.md and session.py."""

from cortexstream.distributed.backends import RankBackend, launched
from cortexstream.distributed.errors import DistributedError
from cortexstream.distributed.mpi_finalize import finalize_mpi
from cortexstream.distributed.plan_wire import policy_problem
from cortexstream.distributed.session import DistributedSession

__all__ = ["DistributedError", "DistributedSession", "RankBackend", "finalize_mpi", "launched", "policy_problem"]
