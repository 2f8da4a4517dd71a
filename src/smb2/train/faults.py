"""Faults in training terms.

Below the store a fault is a connection or a segment: ``connection to
127.0.0.1:7602 lost``, ``no segment 26``.  A worker's user thinks in stores,
ranks and steps, and needs to know what to do next.  :func:`in_training_terms`
rewords the faults a training job meets (a memory server lost, the store
removed under a running job) as one line naming the store, the rank, the
step and the server, with the remedy as the hint; anything else passes
unchanged.  The original message is kept in ``err.detail``, and the new
error keeps the original's type, so code that catches ``TransportError``
or ``NoSuchBuffer`` still does.

A worker that does not catch such a fault ends with it: :func:`end_ranks_briefly`
(which the torch optimizer calls) makes that end the fault's own lines on
stderr (message, DETAIL, HINT), not 20 lines of traceback repeated by every
rank; the traceback is still there for who asks (``SMB2_DEBUG=1``, or the
``smb2`` logger at DEBUG).
"""

from __future__ import annotations

import sys
import threading
from types import TracebackType

from ..errors import NoSuchBuffer, OutOfMemory, Smb2Error, TransportError, debug_wanted

# the hook end_ranks_briefly replaced (every other exception goes to it)
_previous_hook = sys.excepthook
_installed = threading.Lock()


def in_training_terms(err: BaseException, *, store: str, rank: int, step: int) -> BaseException:
    """The error a training worker should see for ``err``."""
    if not isinstance(err, Smb2Error) or getattr(err, "in_training_terms", False):
        return err
    server = getattr(err, "server", None) or "a memory server"
    out: Smb2Error
    if isinstance(err, TransportError) and step == 0 and err.message.startswith("cannot connect"):
        # (before the first step: most often a server of the list that is not up, not one lost)
        out = type(err)(
            f"rank {rank} cannot reach memory server {server} to train store {store!r}",
            errno=err.errno, status=err.status, server=err.server, detail=err.message,
            hint="start that smb2-server, or leave it out of the job's server list (SMB2_SERVERS or servers=; "
                 "every worker lists the same ones); `smb2 doctor SERVERS` checks a list before a job")
    elif isinstance(err, TransportError):
        out = type(err)(
            f"rank {rank} lost memory server {server} at step {step} of store {store!r}",
            errno=err.errno, status=err.status, server=err.server, detail=err.message,
            hint=f"restart that smb2-server (with its --data-dir, so it keeps the store) and run the job again: "
                 f"it resumes store {store!r} from its last step; if the server's data is gone, start from a "
                 "checkpoint (init_from=PATH) or over (resume=False); to train on through a lost server, give the "
                 "store replicas=2 (servers started with --membership)")
    elif isinstance(err, NoSuchBuffer):
        out = type(err)(
            f"store {store!r} is gone from memory server {server} while rank {rank} was at step {step} "
            "(removed with `smb2 rm`, or the server restarted without its data)",
            server=err.server, detail=err.message,
            hint="nothing was written to another buffer; start the job again (a fresh run) or from a "
                 "checkpoint (init_from=PATH), and remove a store only when `smb2 ls` shows its run finished")
    elif isinstance(err, OutOfMemory) and step == 0:
        # (the store is made before the first step: the servers' --capacity, shared with the stores of
        # earlier runs, which stay until removed so that a run can resume)
        out = OutOfMemory(
            f"memory server {server} has no room for store {store!r} (rank {rank}, before the first step)",
            server=err.server, detail=err.message,
            hint="`smb2 ls` lists the stores the servers hold and `smb2 rm NAME` removes one whose run is over "
                 "(each keeps its memory so that its run can resume); or start the servers with a larger "
                 "--capacity, or add servers to the job's list (a store is striped over all of them)")
    else:
        return err
    setattr(out, "in_training_terms", True)     # noqa: B010 (worded once, not again by an outer layer)
    return out


def end_ranks_briefly() -> None:
    """Report a fault in training terms that ends this process (uncaught)
    as its message and hint, without the traceback; idempotent."""
    global _previous_hook
    with _installed:
        if sys.excepthook is not _brief_report:
            _previous_hook = sys.excepthook
            sys.excepthook = _brief_report


def _brief_report(kind: type[BaseException], err: BaseException, tb: TracebackType | None) -> None:
    if not getattr(err, "in_training_terms", False) or debug_wanted():
        _previous_hook(kind, err, tb)
        return
    print(f"smb2: {err}\n(the traceback: run with SMB2_DEBUG=1)", file=sys.stderr, flush=True)
