"""Reading a metrics source: an http(s) URL or a saved file, with clear failures."""

from __future__ import annotations

from kvtier import httpget
from kvtier.doctor.errors import DoctorError

#: Seconds one fetch of an endpoint may take in all before doctor calls it unreadable.
FETCH_TIMEOUT_S = httpget.DEFAULT_DEADLINE_S
#: Largest document doctor reads (a vLLM /metrics page is tens of KB).
MAX_BYTES = httpget.MAX_BODY_BYTES


def is_url(ref: str) -> bool:
    """Whether ``ref`` names an endpoint rather than a file (a URL's scheme is
    case-insensitive: ``HTTP://host/metrics`` is no file name)."""
    return ref[:8].lower().startswith(("http://", "https://"))


def read_text(ref: str, what: str) -> str:
    """The body of ``ref`` as text; DoctorError says which source failed and why. Both
    kinds are bounded (httpget): an endpoint by a deadline and a size cap, a file by the cap
    and by being a regular file (a FIFO or /dev/zero would never end)."""
    if is_url(ref):
        try:
            body = httpget.get(ref, deadline_s=FETCH_TIMEOUT_S, max_bytes=MAX_BYTES)
        except httpget.Unreachable as exc:
            raise DoctorError(f"cannot read {what} from {ref}: {exc} "
                              "(is the service running and the address right?)") from None
        except httpget.FetchError as exc:
            raise DoctorError(f"cannot read {what} from {ref}: {exc}") from None
    else:
        try:
            body = httpget.read_file(ref, max_bytes=MAX_BYTES)
        except httpget.FetchError as exc:
            raise DoctorError(f"cannot read {what} file {ref}: {exc}") from None
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError:
        raise DoctorError(f"{what} at {ref} is not UTF-8 text") from None
