"""``--plot``: KV memory against context length at the target concurrency vs HBM.

matplotlib is an optional extra (``pip install 'kvtier[plot]'``); it is imported only
here, and its absence is a PlanError that says how to install it.
"""

from __future__ import annotations

from pathlib import Path

from kvtier.plan.connector_fit import as_the_connector_runs
from kvtier.plan.errors import PlanError
from kvtier.plan.kvmath import kv_bytes_per_sequence
from kvtier.plan.planner import Plan

STEPS = 200   # points of the demand curve


def check_plot_path(name: str) -> Path:
    """Refuse a ``--plot`` name matplotlib would not write as given, before the plan, as
    ``kvtier replay --plot`` does: a directory or a name without a known suffix silently
    became NAME.png, ``p.txt`` was a ValueError traceback (found by review)."""
    from kvtier.replay.cli import PLOT_SUFFIXES  # one list for both tools

    path = Path(name)
    if path.is_dir():
        raise PlanError(f"--plot {name} is a directory: give a file name such as "
                        f"{path / 'kv_memory.png'}")
    if path.suffix.lower() not in PLOT_SUFFIXES:
        raise PlanError(f"--plot {name}: the name must end in one of {' '.join(PLOT_SUFFIXES)}")
    if not path.parent.is_dir():
        raise PlanError(f"--plot {name}: no directory {path.parent} to write it in")
    return path


def plot_series(plan: Plan) -> tuple[list[int], list[float], float]:
    """The plot's numbers, in GB, as the report counts them: the KV of ``concurrency``
    sequences per context length (of the model as the connector runs it) and the HBM KV
    pool, each token counted once. (The pool was drawn as every GPU's KV room, 8 times
    the real pool for an MLA model at TP 8, where every rank holds the whole latent.)"""
    p = plan.inputs
    runs = as_the_connector_runs(p.model)
    top = max(plan.sequence_tokens["p99"] * 5 // 4, 1024)
    xs = [max(1, top * i // STEPS) for i in range(STEPS + 1)]
    ys = [p.concurrency * kv_bytes_per_sequence(runs, p.kv_dtype, x, p.block_tokens) / 1e9
          for x in xs]
    return xs, ys, plan.kv_pool_bytes / 1e9


def write_plot(plan: Plan, path: str | Path) -> Path:
    """Draw the deployment's KV demand per context length and its HBM KV budget."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise PlanError("--plot needs matplotlib: pip install 'kvtier[plot]' "
                        "(or pip install matplotlib)") from exc
    p = plan.inputs
    xs, ys, pool = plot_series(plan)
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    ax.plot(xs, ys, label=f"KV of {p.concurrency} sequences ({p.kv_dtype})")
    ax.axhline(pool, color="tab:red", linestyle="--",
               label=f"HBM KV pool: {pool:,.1f} GB on {p.gpus} GPU(s)")
    for name, tokens in plan.sequence_tokens.items():
        ax.axvline(tokens, color="grey", linestyle=":", linewidth=1)
        ax.annotate(name.upper(), (tokens, ax.get_ylim()[1] * 0.95), rotation=90,
                    ha="right", va="top", fontsize=8, color="grey")
    ax.set_xlabel("tokens per sequence")
    ax.set_ylabel("GB")
    # the name is a config's text: no mathtext or TeX ("$\\undefined{$" raised; found by review)
    ax.set_title(f"{p.model.name}: KV memory vs context length", parse_math=False,
                 usetex=False)
    ax.legend(loc="upper left")
    ax.grid(alpha=0.3)
    out = Path(path)
    try:
        fig.savefig(out)
    except OSError as exc:
        raise PlanError(f"cannot write plot {out}: {exc}") from exc
    finally:
        plt.close(fig)
    return out
