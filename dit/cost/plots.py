"""PNG charts of the cost model (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from dit.cost.analytic import forward_macs, param_counts
from dit.cost.memory import estimate_training_memory, trace_training_memory
from dit.model.config import PATCH_SIZES, DiTConfig, describe, model_config, model_names


def pyplot():
    """matplotlib's pyplot on the Agg backend (the charts of the cost model, the benchmarks and the studies)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: str) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    pyplot().close(fig)
    return path


def _plain_ticks(axis, ticks) -> None:
    """Plain numbers at chosen ticks on a log axis (matplotlib's default 3x10^1 labels collide)."""
    from matplotlib.ticker import FixedLocator, NullFormatter, ScalarFormatter

    axis.set_major_locator(FixedLocator(ticks))
    axis.set_major_formatter(ScalarFormatter())
    axis.set_minor_formatter(NullFormatter())


def plot_flops_vs_params(path: str, image_size: int = 256) -> str:
    """Forward GFLOPs per image against parameters for every registry config: size by colour, patch by marker."""
    plt = pyplot()
    names = [name.removeprefix("DiT-").split("/") for name in model_names()]
    sizes = dict.fromkeys(size for size, _ in reversed(names))  # smallest first, as _SIZES lists them
    colours = {size: f"C{i}" for i, size in enumerate(sizes)}
    markers = dict(zip(PATCH_SIZES, "Dos^v<>p"))
    fig, ax = plt.subplots(figsize=(7, 5))
    for size, patch in names:
        name = f"DiT-{size}/{patch}"
        cfg = model_config(name, input_size=image_size // 8)
        x, y = param_counts(cfg).total / 1e6, forward_macs(cfg).flops / 1e9
        ax.scatter(x, y, c=colours[size], marker=markers[int(patch)], s=60, zorder=3)
        ax.annotate(name, (x, y), textcoords="offset points", xytext=(6, -3), fontsize=8)
    for size, colour in colours.items():
        ax.scatter([], [], c=colour, label=f"DiT-{size}")
    for patch, marker in markers.items():
        ax.scatter([], [], c="grey", marker=marker, label=f"patch {patch}")
    ax.set(xscale="log", yscale="log", xlabel="parameters (millions)", ylabel="forward GFLOPs per image")
    _plain_ticks(ax.xaxis, [30, 50, 100, 200, 500, 700])
    ax.set_title(f"DiT forward cost at {image_size} px (1 MAC = 2 FLOPs; training = 3x)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    return save_figure(fig, path)


def plot_memory_vs_batch(
    path: str,
    cfg: DiTConfig,
    precision: str = "bf16",
    device_memory_bytes: int | None = None,
    batches: list[int] | None = None,
    traced_batches: tuple[int, ...] = (),
) -> str:
    """Analytic peak memory per device against batch, with and without checkpointing every block;
    ``traced_batches`` adds FakeTensor traces as points, so the chart shows its own check."""
    plt = pyplot()
    batches = batches or [1, 2, 4, 8, 16, 32, 64, 128, 256]
    fig, ax = plt.subplots(figsize=(7, 5))
    curves = ((0, "no checkpointing", "tab:blue"), (cfg.depth, "checkpoint every block", "tab:green"))
    for blocks, label, colour in curves:
        gib = [estimate_training_memory(cfg, b, precision, blocks).total / 2**30 for b in batches]
        ax.plot(batches, gib, marker=".", color=colour, label=f"{label} (analytic)")
        if traced_batches:
            traced = [trace_training_memory(cfg, b, precision, blocks).peak_bytes / 2**30 for b in traced_batches]
            ax.scatter(traced_batches, traced, marker="x", s=60, color=colour, label=f"{label} (traced)", zorder=3)
    if device_memory_bytes:
        ax.axhline(device_memory_bytes / 2**30, color="black", linestyle="--", label="device memory")
    ax.set(xscale="log", xlabel="batch per device", ylabel="peak training memory (GiB)", ylim=(0, None))
    _plain_ticks(ax.xaxis, batches)
    ax.set_title(f"{describe(cfg)}, {precision}, AdamW + EMA", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, path)


def plot_quality(
    path: str,
    runs: list[str],
    labels: list[str] | None = None,
    title: str | None = None,
    up_to_steps: list[int] | None = None,
    count: str = "model",
    groups: list[str] | None = None,
) -> str:
    """FID (and precision/recall, where recorded) against cumulative training FLOPs, one line per run (the DiT
    paper's FID-vs-Gflops figure). ``up_to_steps`` cuts each run at a budget; ``count`` "total" adds a recipe's
    auxiliary and upstream FLOPs; ``groups`` (a name per run) colours a group's runs alike (one legend entry)."""
    from matplotlib.lines import Line2D

    from dit.cost.quality import pflops_of, read_run

    plt = pyplot()
    limits = up_to_steps or [None] * len(runs)
    series = [read_run(run, n)[1] for run, n in zip(runs, limits)]
    has_pr = any(e.get("precision") is not None for evals in series for e in evals)
    fig, axes = plt.subplots(1, 2 if has_pr else 1, figsize=(13 if has_pr else 7, 4.8), squeeze=False)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    order = list(dict.fromkeys(groups)) if groups else []
    for i, (run, evals) in enumerate(zip(runs, series)):
        if groups:
            n = groups.count(groups[i])
            first = groups.index(groups[i]) == i
            name = f"{groups[i]} ({n} seed{'s' if n > 1 else ''})" if first else "_nolegend_"
            style = {"color": colours[order.index(groups[i]) % len(colours)], "alpha": 0.85}
        else:
            name, style = labels[i] if labels else run, {}
        x = [pflops_of(e, count) * 1e15 for e in evals]
        (line,) = axes[0][0].plot(x, [e["fid"] for e in evals], marker="o", label=name, **style)
        if has_pr:
            ax, style = axes[0][1], {**style, "color": line.get_color()}
            pr_name = "_nolegend_" if groups else name
            ax.plot(x, [e.get("precision") for e in evals], marker="o", label=f"{pr_name} precision", **style)
            ax.plot(x, [e.get("recall") for e in evals], marker="s", ls="--", label=f"{pr_name} recall", **style)
    network = series[0][-1].get("feature_network", "")
    what = "model" if count == "model" else "total: DiT + auxiliary + upstream"
    xlabel = f"training FLOPs ({what}, cumulative)"
    axes[0][0].set(xscale="log", yscale="log", ylabel=f"FID ({network})", xlabel=xlabel)
    axes[0][0].set_title(title or "Quality against training compute")
    if has_pr:
        axes[0][1].set(xscale="log", xlabel=xlabel, ylabel="precision / recall", ylim=(0, 1))
    for ax in axes[0]:
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    if has_pr and groups:  # the marker says which metric; the colours are the left panel's
        axes[0][1].legend(
            [Line2D([], [], color="grey", marker="o"), Line2D([], [], color="grey", marker="s", ls="--")],
            ["precision", "recall"],
            fontsize=8,
        )
    return save_figure(fig, path)
