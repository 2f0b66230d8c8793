"""Why a job operation cannot be done (potocolom.web maps each code to its HTTP status)."""
from __future__ import annotations

from potocolom.protocol.errors import DomainError


class JobAlreadyEnded(DomainError):
    """The job has already ended."""

    code = "job_already_ended"


class TooManyJobs(DomainError):
    """The account already has ACCOUNT_JOB_LIMIT unfinished jobs; wait for some to end."""

    code = "too_many_jobs"


class JobNotPaused(DomainError):
    """The job is not paused: only a paused job can be resumed."""

    code = "job_not_paused"


class SocketLimitReached(DomainError):
    """The account already holds ACCOUNT_SOCKET_LIMIT open /ws/jobs/ sockets; close one first."""

    code = "socket_limit"
