"""Old home of the nvme I/O backend selection (kept so existing imports work).

Import from ``kvtier.tiers.nvme.backends`` (selection, CUDA driver probe) and
``kvtier.tiers.nvme.kvikio_io`` (the kvikio backend) instead.
"""

from kvtier.tiers.nvme.backends import (
    LIBCUDA,
    BackendChoice,
    DriverStatus,
    cuda_driver_status,
    make_frame_io,
    select_nvme_backend,
)
from kvtier.tiers.nvme.kvikio_io import KvikioFileIO, kvikio_mode

__all__ = ["LIBCUDA", "BackendChoice", "DriverStatus", "KvikioFileIO", "cuda_driver_status",
           "kvikio_mode", "make_frame_io", "select_nvme_backend"]
