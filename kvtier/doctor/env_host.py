"""Host checks of ``doctor --env``: memlock, huge pages, NUMA placement, GPU and GDS."""

from __future__ import annotations

import re
import resource
from typing import Any

from kvtier.config import Config
from kvtier.doctor.env import Check, Host, Verdict
from kvtier.units import format_bytes

THP = "/sys/kernel/mm/transparent_hugepage"
NODES = "/sys/devices/system/node"
GDS_PROC = "/proc/driver/nvidia-fs/stats"
NV_PROC = "/proc/driver/nvidia/version"


def check_memlock(cfg: Config, host: Host) -> Check:
    """The GPU path pins the arena (cudaHostRegister): the memlock limit must cover it."""
    soft, _hard = host.memlock()
    unlimited = soft == resource.RLIM_INFINITY
    shown = "unlimited" if unlimited else format_bytes(soft)
    gpu_ok, _ = host.gpu()
    needs = cfg.hbm.enabled or gpu_ok
    detail = f"memlock limit {shown}; the cpu tier is {format_bytes(cfg.cpu.bytes)}"
    if unlimited or soft >= cfg.cpu.bytes:
        return Check("memlock", Verdict.OK, detail)
    fix = ("systemd: LimitMEMLOCK=infinity; docker: --ulimit memlock=-1; shell: ulimit -l "
           "unlimited (and /etc/security/limits.conf for the daemon's user)")
    if needs:
        return Check("memlock", Verdict.FAIL, detail + " -> pinning the arena for GPU copies "
                     "fails or falls back to slow pageable copies", fix)
    return Check("memlock", Verdict.OK, detail + " (no GPU here: nothing is pinned)")


def _bracketed(text: str | None) -> str:
    m = re.search(r"\[(\w+)\]", text or "")
    return m.group(1) if m else "?"


def check_thp(host: Host) -> Check:
    """Transparent huge pages: the arena is tens of GiB, walked with large copies."""
    enabled = _bracketed(host.read_text(f"{THP}/enabled"))
    shmem = _bracketed(host.read_text(f"{THP}/shmem_enabled"))
    detail = f"transparent_hugepage enabled [{enabled}], shmem_enabled [{shmem}]"
    if enabled == "?":
        return Check("huge pages", Verdict.SKIP, "no transparent huge page support visible")
    if enabled == "never":
        return Check("huge pages", Verdict.WARN, detail + " -> every 4 KiB page of a large "
                     "arena costs a TLB entry", f"echo madvise > {THP}/enabled (and "
                     f"echo advise > {THP}/shmem_enabled for the /dev/shm arena)")
    return Check("huge pages", Verdict.OK, detail)


def _numa_pages(numa_maps: str) -> dict[str, int]:
    """Pages per node of the arena mappings in a /proc/PID/numa_maps text."""
    out: dict[str, int] = {}
    for line in numa_maps.splitlines():
        if ".arena" not in line:
            continue
        for node, n in re.findall(r"\bN(\d+)=(\d+)", line):
            out[f"N{node}"] = out.get(f"N{node}", 0) + int(n)
    return out


def check_numa(host: Host, stats: dict[str, Any] | None) -> Check:
    """On a multi-socket node the arena should live on one node (near the GPUs/NIC)."""
    nodes = [n for n in host.listdir(NODES) if re.fullmatch(r"node\d+", n)]
    if len(nodes) <= 1:
        return Check("numa", Verdict.OK, f"{max(len(nodes), 1)} NUMA node: nothing to place")
    fix = ("run the daemon bound to the GPUs' node: numactl --cpunodebind=N --membind=N "
           "kvtier serve (systemd: NUMAPolicy=bind, NUMAMask=N); `nvidia-smi topo -m` shows "
           "each GPU's node")
    pid = (stats or {}).get("daemon", {}).get("pid")
    known = isinstance(pid, int) and not isinstance(pid, bool) and pid > 0   # not a path
    maps = host.read_text(f"/proc/{pid}/numa_maps") if known else None
    if not maps:
        return Check("numa", Verdict.WARN, f"{len(nodes)} NUMA nodes; where the arena lives "
                     "is unknown (start the daemon and run doctor as its user)", fix)
    pages = _numa_pages(maps)
    spread = ", ".join(f"{k}={v}" for k, v in sorted(pages.items()))
    if len(pages) > 1:
        return Check("numa", Verdict.WARN, f"{len(nodes)} NUMA nodes; the arena's pages are "
                     f"spread over them ({spread}): copies cross the interconnect", fix)
    return Check("numa", Verdict.OK, f"{len(nodes)} NUMA nodes; the arena lives on "
                 f"{spread or 'no resident pages yet'}")


def check_gpu(cfg: Config, host: Host) -> list[Check]:
    """GPU driver, and whether kvikio does GPUDirect Storage or its POSIX compat mode."""
    version = host.read_text(NV_PROC)
    ok, why = host.gpu()
    if version is None and not ok:
        return [Check("gpu", Verdict.SKIP, f"no NVIDIA GPU ({why}): the hbm tier and GDS "
                      "do not apply")]
    line = (version or "").splitlines()[0] if version else "driver version unknown"
    out = [Check("gpu", Verdict.OK if ok else Verdict.FAIL, f"{line.strip()}; {why}",
                 "" if ok else "install/load the NVIDIA driver matching the CUDA runtime; "
                 "check CUDA_VISIBLE_DEVICES and the container's GPU runtime")]
    mode = host.kvikio_mode()
    gds = host.exists(GDS_PROC)
    wants_kvikio = cfg.nvme.backend == "kvikio"
    if mode is None:
        verdict = Verdict.FAIL if wants_kvikio else Verdict.SKIP
        out.append(Check("gds", verdict, "kvikio is not importable: the nvme tier uses POSIX "
                         "I/O", "pip install 'kvtier[gpu]'" if wants_kvikio else ""))
    elif mode == "gds" and gds:
        out.append(Check("gds", Verdict.OK, "kvikio uses cuFile (GPUDirect Storage); "
                         "nvidia-fs is loaded"))
    else:
        out.append(Check("gds", Verdict.WARN, f"kvikio runs in {mode} mode (nvidia-fs "
                         f"{'loaded' if gds else 'not loaded'}): reads bounce through host "
                         "memory, not GPUDirect", "modprobe nvidia-fs, check /etc/cufile.json "
                         "(allow_compat_mode, the file system is ext4/xfs on local NVMe), and "
                         "unset KVIKIO_COMPAT_MODE"))
    return out
