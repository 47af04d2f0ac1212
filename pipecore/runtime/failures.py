"""What a run of a step's program that failed means on this rank: which error it raises, and what
becomes of the group and of the plan the run was learning (pipecore/runtime/discovery.py).

- A peer failed (`PeerAbort`: its messages said "aborted"): PeerFailedError with the first failing
  rank's error from the store; the group is fine.
- The group broke (`CommError`: a wait timed out, a connection broke): CommunicationError; no later
  step may use the group (`Comm.abandon_group`).
- This rank's own error: raised as it is, once its peers were told (the executor sent them "aborted"
  messages); when telling them failed too, the group broke: CommunicationError from it.

The module state the run changed is put back first (`Rollback.restore_or_explain`); where that
fails its reason is a note on the error raised, which stays the step's own.
"""

from __future__ import annotations

from pipecore.errors import CommunicationError, PeerFailedError


def peer_failed(step: int, noticed: Exception, rollback_note: str, comm, plans) -> PeerFailedError:
    plans.end_discovery(failed=True)  # the ranks agree that this step learnt no plan
    failed = PeerFailedError(f"{comm.who}: step {step} aborted because {comm.peer_error()} "
                             f"(noticed here: {noticed}). The group is fine: zero the gradients and step again.")
    if rollback_note:
        failed.add_note(rollback_note)
    return failed


def group_broke(error: Exception, rollback_note: str, comm, plans, step: int | None = None,
                explain=None) -> CommunicationError:
    """`explain()`: why, as every rank says it (pipecore/runtime/doctor.py), said first."""
    plans.forget_discovery()  # no agreement can end it

    def diagnosis() -> str:
        text = explain() if explain is not None else ""
        return f"{comm.who}: step {step} failed: {text}" if text else ""
    broke = comm.abandon_group(error, explain=diagnosis)
    if rollback_note:
        broke.add_note(rollback_note)
    return broke


def own_error(step: int, error: BaseException, rollback_note: str, comm, plans, executor) -> CommunicationError | None:
    """This rank's `error` (noted): None when the peers were told, and `error` is the one to raise;
    else the CommunicationError to raise from it."""
    if rollback_note:
        error.add_note(rollback_note)
    also = executor.last_comm_failure
    if also:  # this rank's own error, and releasing its peers failed too: the group broke
        aborted = comm.mark_broken(also)
        plans.forget_discovery()
        broke = CommunicationError(f"{comm.who}: step {step} failed on this rank (its error is the cause, above), "
                                   f"and telling the other ranks failed too: {also}. A peer hung or died: {aborted}"
                                   "rebuild the process group and the Pipeline.")
        backend = executor.last_comm_failure_cause  # (its error is the cause: the backend's text as a note)
        if backend:
            broke.add_note(f"what the backend said of telling the other ranks: {backend}")
        return broke
    plans.end_discovery(failed=True)
    return None
