"""Reading a metrics source: an http(s) URL or a saved file, with clear failures."""

from __future__ import annotations

import urllib.error
import urllib.request
from pathlib import Path

from kvtier.doctor.errors import DoctorError

#: Seconds to wait for an endpoint before calling it unreadable.
FETCH_TIMEOUT_S = 5.0
#: Largest document doctor reads (a vLLM /metrics page is tens of KB).
MAX_BYTES = 64 << 20


def is_url(ref: str) -> bool:
    """Whether ``ref`` names an endpoint rather than a file."""
    return ref.startswith(("http://", "https://"))


def read_text(ref: str, what: str) -> str:
    """The body of ``ref`` as text; DoctorError says which source failed and why."""
    if is_url(ref):
        try:
            with urllib.request.urlopen(ref, timeout=FETCH_TIMEOUT_S) as resp:
                body = resp.read(MAX_BYTES + 1)
        except urllib.error.HTTPError as exc:
            raise DoctorError(f"cannot read {what} from {ref}: HTTP {exc.code} "
                              f"{exc.reason}") from exc
        except (urllib.error.URLError, OSError, TimeoutError) as exc:
            reason = getattr(exc, "reason", exc)
            raise DoctorError(f"cannot read {what} from {ref}: {reason} "
                              "(is the service running and the address right?)") from exc
        except ValueError as exc:  # urllib's word for an address it cannot parse
            raise DoctorError(f"cannot read {what} from {ref}: not a valid URL "
                              f"({exc})") from None
    else:
        path = Path(ref)
        try:
            with path.open("rb") as fh:
                body = fh.read(MAX_BYTES + 1)
        except OSError as exc:
            raise DoctorError(f"cannot read {what} file {ref}: {exc.strerror or exc}") from exc
    if len(body) > MAX_BYTES:
        raise DoctorError(f"{what} at {ref} is larger than {MAX_BYTES >> 20} MiB")
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DoctorError(f"{what} at {ref} is not UTF-8 text") from exc
