"""Ending a rank that joined over MLX's mpi backend so that mpirun counts a clean run's exit as clean.

MPI wants every process that called MPI_Init to call MPI_Finalize before it exits; mpirun treats a process that
does not as crashed (exit status 1, "exiting improperly") and kills the other ranks. MLX calls MPI_Finalize when its
world group is destroyed, and Python destroys it only if the interpreter tears its modules down, which it skips when
a daemon thread (the control channel's watchdog, a server's threads) is still alive at exit. So the rank takes the
ending over: it keeps MLX's group alive for good (MLX never finalizes) and calls MPI_Finalize itself, once, at exit
(or before `os._exit`, see finalize_mpi).

Only after the session ended cleanly on this rank: MPI_Finalize waits for every rank to reach its own (a fence), so
a rank that failed must not wait for the others, which may hang. It exits without finalizing instead, and mpirun
ends the other ranks.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import sys
from dataclasses import dataclass
from typing import Any

LIBRARY_VARIABLE = "MLX_MPI_LIBNAME"  # the library MLX's mpi backend loads instead of libmpi.so / libmpi.dylib


@dataclass
class _Ending:
    library: Any = None  # the libmpi MLX loaded, once this process took the ending over
    clean: bool = False  # the session ended without an error on this rank


_ENDING = _Ending()


def take_over(group: Any) -> None:
    """Called once the mpi backend connected the ranks: MLX's `group` is never destroyed, and finalize_mpi() runs
    at exit."""
    if _ENDING.library is not None:
        return
    default = "libmpi.dylib" if sys.platform == "darwin" else "libmpi.so"
    name = os.environ.get(LIBRARY_VARIABLE) or default
    try:  # the library MLX already loaded under that name (RTLD_NOLOAD: never a second copy)
        library = ctypes.CDLL(name, mode=getattr(os, "RTLD_NOLOAD", 0) | os.RTLD_GLOBAL)
    except OSError:
        return  # not found under that name: MLX keeps finalizing on its own
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(group))  # a reference nothing releases: MLX never finalizes
    _ENDING.library = library
    atexit.register(finalize_mpi)


def session_ended_cleanly() -> None:
    """This rank's session ended without an error (rank 0 closed it, or a follower was told to stop): MPI is
    finalized at exit."""
    _ENDING.clean = True


def finalize_mpi() -> None:
    """Call MPI_Finalize once, when this process took the ending over and its session ended cleanly (a no-op
    otherwise, and the second time). Waits until every rank reaches its own MPI_Finalize."""
    if _ENDING.library is None or not _ENDING.clean:
        return
    done = ctypes.c_int(0)
    _ENDING.library.MPI_Finalized(ctypes.byref(done))
    if not done.value:
        sys.stdout.flush()
        sys.stderr.flush()
        _ENDING.library.MPI_Finalize()


__all__ = ["finalize_mpi", "session_ended_cleanly", "take_over"]
