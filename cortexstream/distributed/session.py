"""`DistributedSession`: this process's part in a run over several ranks (started by mlx.launch or mpirun).

    model, tokenizer = cortexstream.load(path)
    with DistributedSession.start(model, tokenizer) as ranks:   # every rank: join, split the model
        if ranks.is_leader:
            engine = ranks.attach(Engine(model, tokenizer, kv_tokens=4096))
            print(cortexstream.batch_generate(model, tokenizer, prompts, engine=engine).texts)
        else:
            ranks.follow()                                      # until rank 0 leaves the `with`

Rank 0 owns the scheduler (and whatever serves requests); the other ranks run its plans. Leaving the `with` on rank
0 tells them to stop (with the error, when it raised). When a rank dies or hangs, the others end within `timeout`
seconds with an error naming it (`on_failure`: by default, print it and end the process, since a rank waiting in an
MLX collective cannot be interrupted otherwise).
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable

from cortexstream.distributed.backends import BackendChoice, RankBackend
from cortexstream.distributed.errors import DistributedError
from cortexstream.distributed.follower import Follower
from cortexstream.distributed.follower_channel import FollowerChannel
from cortexstream.distributed.group import RankGroup
from cortexstream.distributed.leader import DistributedLeader
from cortexstream.distributed.leader_channel import LeaderChannel
from cortexstream.distributed.mpi_finalize import session_ended_cleanly
from cortexstream.distributed.sharding import shard_model

DEFAULT_TIMEOUT = 60.0  # seconds a rank may stay silent, or one step may take, before the others stop


def exit_on_failure(reason: str) -> None:
    """The default failure action: say why on stderr and end this process (exit status 1)."""
    print(f"cortexstream: error: distributed: {reason}", file=sys.stderr, flush=True)
    os._exit(1)


class DistributedSession:
    def __init__(self, group: RankGroup, model: Any, tokenizer: Any, leader: DistributedLeader | None,
                 follower: Follower | None) -> None:
        self.group, self.model, self.tokenizer = group, model, tokenizer
        self.leader, self.follower = leader, follower
        self._closed = False

    @classmethod
    def start(cls, model: Any, tokenizer: Any, *, backend: str | RankBackend | BackendChoice | None = None,
              timeout: float = DEFAULT_TIMEOUT,
              on_failure: Callable[[str], None] = exit_on_failure) -> "DistributedSession":
        """Join the other ranks and keep this rank's shard of `model` (in place). Every rank calls it with the
        same model; a model that cannot be split raises the same DistributedError on every rank. `backend`: "ring"
        or "mpi"; None takes CORTEXSTREAM_RANK_BACKEND, else the backend of the launcher that started the ranks
        (mpirun: mpi), else ring (backends.py)."""
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise DistributedError(f"timeout: {timeout!r} must be a number of seconds > 0")
        group = RankGroup.init(backend)
        shard_model(model, group.group, group.size)
        if group.is_leader:
            return cls(group, model, tokenizer, DistributedLeader(LeaderChannel(group, timeout, on_failure)), None)
        return cls(group, model, tokenizer, None, Follower(model, tokenizer, FollowerChannel(group, timeout)))

    @property
    def is_leader(self) -> bool:
        return self.group.is_leader

    @property
    def size(self) -> int:
        return self.group.size

    def attach(self, engine: Any) -> Any:
        """Rank 0: run `engine` on every rank (see DistributedLeader.attach); returns it."""
        if self.leader is None:
            raise DistributedError(f"attach: rank {self.group.rank} runs rank 0's engines; only rank 0 attaches")
        return self.leader.attach(engine)

    def detach(self, engine: Any) -> None:
        if self.leader is not None:
            self.leader.detach(engine)

    def follow(self) -> None:
        """Every rank but 0: run rank 0's plans until it stops. DistributedError when it stopped with an error,
        went away, or the ranks diverged."""
        if self.follower is None:
            raise DistributedError("follow: rank 0 leads; the other ranks follow")
        try:
            self.follower.run()
            session_ended_cleanly()  # under mpirun: finalize MPI at exit (mpi_finalize.py)
        finally:
            self.follower.channel.close()
            self._closed = True

    def close(self, error: str | None = None) -> None:
        """Rank 0: tell the other ranks to stop (idempotent). After a clean run, DistributedError when a rank's
        block operations (its BlockLedger digest) differ from rank 0's."""
        if self._closed:
            return
        self._closed = True
        if self.leader is not None:
            self.leader.channel.close(error)
            if error is None and self.leader.channel.failed is None:
                mine = self.leader.ledger.digest()
                differ = sorted(rank for rank, digest in self.leader.channel.digests.items() if digest != mine)
                if differ:
                    raise DistributedError(f"ranks {differ} executed other block operations than rank 0 (their "
                                           "block tables differ): the ranks' KV layouts diverged")
                session_ended_cleanly()
        elif self.follower is not None:
            self.follower.channel.close()

    def rank_digests(self) -> dict[int, str]:
        """Rank 0, after close: each rank's BlockLedger digest (rank 0's own included), for comparison."""
        if self.leader is None:
            raise DistributedError("rank_digests: only rank 0 collects the ranks' digests")
        return {0: self.leader.ledger.digest(), **self.leader.channel.digests}

    def __enter__(self) -> "DistributedSession":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.close(None if exc is None else f"{type(exc).__name__}: {exc}")
        if exc is not None and self.leader is not None and not isinstance(exc, DistributedError):
            gone = sorted(self.leader.channel.gone)
            if gone:  # e.g. MLX's "[ring] connection to a peer was lost": say which rank ended
                raise DistributedError(f"rank {', '.join(map(str, gone))} ended during the run (its connection "
                                       f"closed): {type(exc).__name__}: {exc}") from exc
