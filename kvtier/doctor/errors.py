"""The doctor's typed error."""

from __future__ import annotations

from kvtier.errors import KVTierError


class DoctorError(KVTierError, ValueError):
    """Metrics could not be read or made sense of; the message names the source."""

    code = "doctor"
