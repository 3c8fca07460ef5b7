"""Every error cpplan raises on purpose, in one place.

User errors subclass ``ValueError`` (bad config, bad step, bad file); distributed failures
subclass ``RuntimeError`` (ranks disagree, a rank is gone). Each message is one line that says
what was got and what was expected; the CLI prints it as is and exits 2 (or the code the
subclass names).
"""

from __future__ import annotations


class CpplanError(Exception):
    """Base of every error cpplan raises on purpose."""

    exit_code = 2


class ConfigError(CpplanError, ValueError):
    """A ParallelConfig breaks a rule (unsupported topology, bad size, workspace too small)."""


class StepInputError(CpplanError, ValueError):
    """A StepInput is invalid for the config (bad counts, duplicate req_id, extent too long)."""


class PlanFormatError(CpplanError, ValueError):
    """Bytes that are not a valid cpplan file: truncated, mutated, wrong kind, too large."""


class SchemaVersionError(PlanFormatError):
    """A file written by a newer schema than this cpplan reads."""


class InputFileError(PlanFormatError):
    """A path that cannot be read as an input: missing, unreadable, not a regular file (a FIFO,
    a device, a folder) or larger than the cap. Raised before any byte is decoded."""


class OutputError(CpplanError, OSError):
    """An output path that cannot be written: refused (a symlink, device or folder is never
    replaced), or the write failed (read-only folder, full disk, name too long). Names the
    target, never the hidden temp file."""


class CapacityError(CpplanError, ValueError):
    """A plan needs more rows than a runtime buffer sized at start-up holds."""


class PlanMismatchError(CpplanError, RuntimeError):
    """Ranks compiled different plans for one step; raised on every rank before any collective."""

    exit_code = 3


class RankLostError(CpplanError, RuntimeError):
    """A rank did not take part in a control exchange within the timeout."""

    exit_code = 4


class PeerFailedError(RankLostError):
    """Another rank raised during the step (bind, insert, attend...) and said so on the control
    plane; raised on its peers, naming it (``rank``) and its one-line error (``detail``)."""

    def __init__(self, message: str, rank: int = -1, detail: str = "") -> None:
        super().__init__(message)
        self.rank, self.detail = rank, detail

    def __reduce__(self):  # keep rank and detail through pickling (the simulator's pipes)
        return type(self), (str(self), self.rank, self.detail)


class TensorArgError(CpplanError, ValueError):
    """A tensor handed to the runtime (``insert`` / ``attend`` / ``restore`` inputs, a
    ``LayerCache``) whose shape, dtype or device does not fit the config and the bound step."""


class UsageError(CpplanError, RuntimeError):
    """A runtime call made where it cannot run correctly (e.g. ``restore`` inside a CUDA-graph
    capture, where its per-step row count would be frozen)."""

    exit_code = 2


class CollectiveLedgerError(CpplanError, RuntimeError):
    """The collectives a step issued differ from the plan's list (debug mode)."""

    exit_code = 3
