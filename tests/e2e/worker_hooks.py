"""Worker-side hooks for engines run by ``vllm_engine.py``: installed before the engine
starts, so that the TP workers vLLM forks have them too (a worker is another process: what
a hook sees goes to files, not to the runner's memory)."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any


def spoil_loads(salt: str, from_block: int, rank: int) -> None:
    """Once per worker process, on TP rank ``rank`` only: the first load of a request with
    namespace salt ``salt`` fills the pages of its kvtier blocks ``from_block`` on with
    noise and reports them failed, as a get lease that expired during its copy does."""
    import torch
    from kvtier.connectors.vllm.transfers import LoadBatch

    original = LoadBatch.close
    done: list[bool] = []

    def spoiled(self: Any) -> set[int]:
        failed = original(self)
        item = next((i for i in self._open if i.spec.cache_salt == salt and i.blocks), None)
        if item is None or self.tp_rank != rank or done:
            return failed
        done.append(True)
        pages = item.spec.page_ids[from_block * self.caches.pages_per_block:]
        index = torch.tensor(pages, dtype=torch.int64)
        for cache in self.caches.caches:   # (CPU engines: pages on dim 0)
            cache[index] = torch.randn_like(cache[index]) * 4
        return failed | set(pages)

    setattr(LoadBatch, "close", spoiled)  # noqa: B010 (a test hook)


def block_name(salt: str | None, token_ids: Any, end_token: int) -> str:
    """A block's name in the records: its salt and the digest of the tokens through it."""
    import numpy as np

    tokens = np.asarray(token_ids[:end_token], dtype=np.uint32).tobytes()
    return f"{salt or '-'}.{hashlib.sha256(tokens).hexdigest()[:16]}"


def record_pages(directory: str) -> None:
    """Keep, as ``.npy`` files in ``directory``, what each block's pages hold (per layer,
    the engine's own page tensors): ``computed-RANK-NAME-LAYER`` when a step's save is
    planned (the pages the step computed), ``loaded-RANK-NAME-LAYER`` right after a load
    filled them (before the model reads them). The last record of a name wins."""
    import numpy as np
    import torch
    from kvtier.connectors.vllm.transfers import LoadBatch
    from kvtier.connectors.vllm.worker import WorkerSide

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)

    def dump(kind: str, rank: int, caches: Any, spec: Any, blocks: range) -> None:
        tpb = caches.tokens_per_block
        for j in blocks:
            name = block_name(spec.cache_salt, spec.token_ids, (j + 1) * tpb)
            index = torch.tensor(spec.pages[j - spec.first_block], dtype=torch.int64)
            for layer, cache in enumerate(caches.caches):
                np.save(out / f"{kind}-{rank}-{name}-{layer}.npy", cache[index].numpy())

    save, close = WorkerSide.save, LoadBatch.close

    def saving(self: Any, meta: Any) -> None:
        if self.caches is not None:
            for spec in meta.saves:
                dump("computed", self.tp_rank, self.caches, spec,
                     range(spec.first_block, spec.end_block))
        save(self, meta)

    def loaded(self: Any) -> set[int]:
        failed: set[int] = close(self)
        for item in self._open:
            if item.ok and item.blocks and not item.spec.skip_pages:
                dump("loaded", self.tp_rank, self.caches, item.spec,
                     range(item.spec.first_block, item.spec.first_block + len(item.blocks)))
        return failed

    setattr(WorkerSide, "save", saving)  # noqa: B010 (a test hook)
    setattr(LoadBatch, "close", loaded)  # noqa: B010 (a test hook)
