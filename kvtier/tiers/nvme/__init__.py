"""The nvme tier: KV blocks as checksummed frames in fixed slots of local files.

Read in this order:

- ``tier``: ``NvmeTier``, what the store calls (open, alloc, write, read_into, free, close);
- ``slots``: the on-disk layout and slot allocation (one file per size class, hard capacity);
- ``files``: the slot files' descriptors (a bounded number open, reopened with the trust
  checks of the first open, never closed under an I/O in flight);
- ``recovery``: the start-up scan that rebuilds the slot map from header pages;
- ``frameio``: the ``FrameIO`` interface every frame transfer goes through, and the POSIX
  backend; ``split``: how the POSIX backend reads a large frame as concurrent pieces;
  ``kvikio_io``: the kvikio (CuFile) backend; ``backends``: which backend runs and why;
- ``probe``: whether O_DIRECT works under the tier's directory;
- ``lock``: one daemon per nvme directory (an flock held while the tier is open);
- ``health``: a full or failing disk degrades the tier (writes refused, reads go on) until a
  space probe, paced by ``kvtier.backoff``, succeeds;
- ``buffers``: aligned header pages and bounce buffers the I/O threads share.
"""

from kvtier.tiers.aligned import PAGE
from kvtier.tiers.nvme.frameio import FrameIO, PosixFrameIO
from kvtier.tiers.nvme.health import NvmeHealth
from kvtier.tiers.nvme.slots import NvmeSlot, SlotState
from kvtier.tiers.nvme.tier import NvmeDegradedError, NvmeIOError, NvmeTier, TierState

__all__ = ["PAGE", "FrameIO", "NvmeDegradedError", "NvmeHealth", "NvmeIOError", "NvmeSlot",
           "NvmeTier", "PosixFrameIO", "SlotState", "TierState"]
