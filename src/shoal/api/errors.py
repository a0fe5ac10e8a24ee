"""One exception root for everything Shoal raises.

Each error has a stable ``code`` so that a server can send it in an error reply
and the client can raise the same class on the caller's side.
"""

from __future__ import annotations

from collections.abc import Callable


class ShoalError(Exception):
    """Root of every error Shoal raises."""

    code = "ShoalError"


class ConfigError(ShoalError, ValueError):
    """A setting, table spec or launch option is invalid or inconsistent."""

    code = "ConfigError"


class ProtocolError(ShoalError):
    """A message is malformed: unknown version or op, bad header, frames that do not match."""

    code = "ProtocolError"


class MessageTooLargeError(ProtocolError):
    """A message exceeds the configured maximum size."""

    code = "MessageTooLargeError"


class AuthError(ShoalError):
    """A message carried no valid authentication tag, or the peer rejected ours."""

    code = "AuthError"


class ReplayError(AuthError):
    """A message was played again: its request number was already served in its sender's stream, or is
    older than the receiver remembers of that stream (so it may have been)."""

    code = "ReplayError"


class RoleError(AuthError):
    """A request from a sender that may not make it: not a member of the job, or not in the role the
    request needs (a CLOCK naming another worker's rank, a server op from a worker)."""

    code = "RoleError"


class KeyRangeError(ShoalError, IndexError):
    """A key lies outside ``[0, num_keys)`` of its table."""

    code = "KeyRangeError"


class DTypeError(ShoalError, TypeError):
    """An array has a dtype the table or the wire does not accept."""

    code = "DTypeError"


class ShapeError(ShoalError, ValueError):
    """An array's shape does not match the keys or the table's row width."""

    code = "ShapeError"


class NonFiniteError(ShoalError, ValueError):
    """A push carried NaN or Inf and the table's policy is to reject it."""

    code = "NonFiniteError"


class TableError(ShoalError):
    """A table is unknown, or was created twice with different specs."""

    code = "TableError"


class BudgetError(TableError):
    """A table does not fit in the memory a server may give its tables (``Limits.server_memory_bytes``)."""

    code = "BudgetError"


class RequestTimeoutError(ShoalError, TimeoutError):
    """No reply arrived in time; the message names what was waited for."""

    code = "RequestTimeoutError"


class ClusterError(ShoalError):
    """Rendezvous, membership or barrier failed: a peer is missing or gone."""

    code = "ClusterError"


class WriteQuorumError(ClusterError):
    """A push to a replicated table was not acknowledged by ``write_quorum`` replicas.

    The replicas in ``applied_at`` took it (each applies it exactly once), the others
    may or may not have. Pushing the same values again would count them twice:
    ``retry()`` sends the same push again under its number, which every replica
    recognises, and raises this error again if the quorum is still out of reach.
    """

    code = "ClusterError"

    def __init__(self, message: str, applied_at: list[int] | None = None,
                 retry: Callable[[], None] | None = None) -> None:
        super().__init__(message)
        self.applied_at = applied_at or []
        self._retry = retry

    def retry(self) -> None:
        if self._retry is None:
            raise ClusterError(f"this push cannot be sent again from here: {self}")
        self._retry()


class NotServedError(ClusterError):
    """The server a request went to stopped reading before it came (it left the cluster): nothing
    of it was done there."""

    code = "NotServed"


class PeerRestartedError(ClusterError):
    """The server a request went to was started again before it answered: its previous process may
    or may not have served it. A replicated push goes on to another replica under its number (served
    once wherever it lands); other calls fail with this error."""

    code = "PeerRestarted"


class ServerError(ShoalError):
    """The server failed while handling a request (a bug, not bad input)."""

    code = "ServerError"


class ClosedError(ShoalError):
    """The handle, connection or server has been shut down."""

    code = "ClosedError"


class SliceMovedError(ShoalError):
    """The keys' slice is no longer on the server asked (it moved, or the asker's layout is old).

    Nothing of the request was applied; a worker refreshes its layout and
    retries on its own, so callers only see this if a retry also fails.
    """

    code = "SliceMoved"


class CheckpointError(ShoalError):
    """A checkpoint cannot be written, found, or trusted (missing part, wrong size or checksum, other spec)."""

    code = "CheckpointError"


ERRORS_BY_CODE: dict[str, type[ShoalError]] = {
    cls.code: cls
    for cls in (
        ShoalError,
        ConfigError,
        ProtocolError,
        MessageTooLargeError,
        AuthError,
        ReplayError,
        RoleError,
        KeyRangeError,
        DTypeError,
        ShapeError,
        NonFiniteError,
        TableError,
        BudgetError,
        RequestTimeoutError,
        ClusterError,
        NotServedError,
        ServerError,
        ClosedError,
        SliceMovedError,
        CheckpointError,
    )
}


def error_from_code(code: str, message: str) -> ShoalError:
    """Rebuild the error a peer reported; unknown codes become a plain ``ShoalError``."""
    return ERRORS_BY_CODE.get(code, ShoalError)(message)
