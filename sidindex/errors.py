"""Exceptions raised for problems a user can act on.

The CLI prints ``str(error)`` as one line and exits non-zero; anything else is a bug.
"""

from __future__ import annotations


class SidIndexError(Exception):
    """Base class: an error whose message tells the user what to fix."""

    exit_code = 2


class InputError(SidIndexError):
    """A catalog, request table or targeting spec violates its contract."""

    # set by `sidindex.ingest.Validator`: (column, check, row), which of two errors a whole-file
    # validation reports first
    rank: tuple[int, int, int]


class ConfigError(SidIndexError):
    """A configuration file or option has a bad value."""


class ArtifactError(SidIndexError):
    """A codebook or other artifact on disk is missing, corrupt or of an unknown format."""


class ScorerError(SidIndexError):
    """A user's scorer (a model plugged into the search) could not be loaded, failed, or returned
    logits of the wrong shape or dtype, or none finite for a request."""

    # set where one request of the batch is to blame: its row in the batch and the id the message
    # names (a server that renumbered its clients' requests names theirs: `renamed`)
    row: int | None = None
    request_id: object = None

    def renamed(self, request_id: object) -> ScorerError:
        """The same error naming the blamed request by `request_id`."""
        out = ScorerError(str(self).replace(f"for request {self.request_id} ", f"for request {request_id} ", 1))
        out.row, out.request_id = self.row, request_id
        return out


class EngineError(SidIndexError):
    """A build engine failed outside the user's data: a cluster that cannot be reached, a worker
    that died."""


class QualityGateError(SidIndexError):
    """The SID quality report crossed a configured fail threshold."""

    exit_code = 3
