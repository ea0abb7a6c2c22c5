"""Training and held-out evaluation curves as a PNG, and as a data: URI for pages that cannot reach the run
folder (the Prefect UI)."""

from __future__ import annotations

import base64
import io
import math
from pathlib import Path

from refiner_core.eval.evaluate import answer_columns

# Held-out eval panels: (summary key, title); rates are drawn as percentages.
EVAL_PANELS = [
    ("reward", "eval: reward (training reward code)"),
    ("format_valid", "eval: format-valid (%)"),
    ("citation_valid", "eval: citations valid (%)"),
    ("cites_distractor", "eval: cites a distractor (%)"),
    ("judge_score", "eval: judge rubric score"),
    ("pass_at_k", "eval: pass@k (%)"),
]
# Drawn where the evaluation has them (verified prompts; agent conversations), beside the panels above.
ANSWER_PANELS = [
    ("accuracy", "eval: accuracy (%)"),
    ("boxed", "eval: answered in a box (%)"),
    ("tool_call_rate", "eval: called a tool (%)"),
    ("well_formed_calls", "eval: well-formed calls (%)"),
    ("tool_errors", "eval: tool errors (% of calls)"),
    ("turns", "eval: turns per answer"),
    ("mean_tokens", "eval: response tokens (mean)"),
]
RATES = {
    "format_valid",
    "citation_valid",
    "cites_distractor",
    "pass_at_k",
    "accuracy",
    "boxed",
    "tool_call_rate",
    "well_formed_calls",
    "tool_errors",
}
DPI = 100
# A data: URI is stored in every version of its artifact (one per step): past this many PNG bytes the embedded
# copy is stored in a palette of PALETTE_COLOURS (a plot has a few hundred colours, mostly anti-aliasing shades: about
# a third of the bytes, the same picture to the eye), and scaled down only when that is not enough
# (RUN_DIR/curves.png keeps every colour and DPI).
EMBEDDED_PNG_BYTES = 150_000
PALETTE_COLOURS = 256
MIN_EMBEDDED_DPI = 40


def plot_steps(steps: list[dict], path: Path, evals: list[dict] | None = None) -> Path:
    """Reward, KL, loss and response length per step; with `evals` (eval summary rows, see
    refiner_core.eval.evaluate.summarize) a second row of held-out curves, one line per mode. The base model
    before SFT is drawn as a separate marker at step 0."""
    _write(path, _render(steps, evals))
    return Path(path)


def plot_steps_embedded(
    steps: list[dict], path: Path, evals: list[dict] | None = None, max_bytes: int = EMBEDDED_PNG_BYTES
) -> str:
    """plot_steps, and the same figure as a `data:image/png;base64,` URI of at most max_bytes PNG bytes (in a
    palette, then scaled down, when needed; never below MIN_EMBEDDED_DPI). The figure is drawn once."""
    png = _render(steps, evals)
    _write(path, png)
    return "data:image/png;base64," + base64.b64encode(_shrink(png, max_bytes)).decode("ascii")


def _render(steps: list[dict], evals: list[dict] | None) -> bytes:
    plt = _pyplot()
    fig = _draw(steps, evals)
    try:
        buffer = io.BytesIO()
        fig.savefig(buffer, format="png", dpi=DPI)
        return buffer.getvalue()
    finally:
        plt.close(fig)


def _number(value) -> float:
    """A step's figure, NULL as NaN: no point there (a catalog written before the column existed)."""
    return math.nan if value is None else value


def _write(path: Path, png: bytes) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_bytes(png)


def _shrink(png: bytes, max_bytes: int) -> bytes:
    """`png` when it fits in max_bytes; else in a palette, scaled down while it does not fit (PNG bytes grow
    about with the pixel count), to at least MIN_EMBEDDED_DPI / DPI of its size."""
    if len(png) <= max_bytes:
        return png
    from PIL import Image

    image = Image.open(io.BytesIO(png)).convert("RGB")  # the figure's background is opaque
    min_scale, scale = MIN_EMBEDDED_DPI / DPI, 1.0
    while True:
        size = (max(1, round(image.width * scale)), max(1, round(image.height * scale)))
        shown = image if scale == 1.0 else image.resize(size, Image.Resampling.LANCZOS)
        buffer = io.BytesIO()
        shown.quantize(PALETTE_COLOURS).save(buffer, format="PNG", optimize=True)
        small = buffer.getvalue()
        if len(small) <= max_bytes or scale <= min_scale:
            return small
        scale = max(min_scale, scale * 0.95 * (max_bytes / len(small)) ** 0.5)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def _draw(steps: list[dict], evals: list[dict] | None):
    plt = _pyplot()
    panels = [
        ("reward_mean", "reward (mean ± std)"),
        ("kl", "KL to reference"),
        ("loss", "loss"),
        ("response_length_mean", "response tokens (mean)"),
    ]
    shown = {key for _, key, _ in answer_columns(evals or [])}  # as the eval table shows them
    eval_panels = EVAL_PANELS + [p for p in ANSWER_PANELS if p[0] in shown]
    if evals:  # training curves on the first row, held-out curves on the rows below
        columns = len(EVAL_PANELS)
        rows = 1 + -(-len(eval_panels) // columns)
        fig, axes = plt.subplots(rows, columns, figsize=(4 * columns, 3 * rows), constrained_layout=True)
        step_axes, eval_axes = list(axes[0]), [ax for row in axes[1:] for ax in row]
        for ax in step_axes[len(panels) :] + eval_axes[len(eval_panels) :]:
            ax.axis("off")
    else:
        fig, axes = plt.subplots(2, 2, figsize=(9, 6), constrained_layout=True)
        step_axes, eval_axes = list(axes.flat), []
    x = [s["step"] for s in steps]
    for ax, (key, title) in zip(step_axes, panels):
        y = [_number(s[key]) for s in steps]
        ax.plot(x, y, marker="o")
        if key == "reward_mean":
            std = [_number(s["reward_std"]) for s in steps]
            ax.fill_between(x, [a - b for a, b in zip(y, std)], [a + b for a, b in zip(y, std)], alpha=0.2)
        if key == "kl" and any(s.get("reward_kl") is not None for s in steps):  # grpo.kl_reward_coef
            ax.lines[-1].set_label("loss term (beta)")
            measured = [(s["step"], s["reward_kl"]) for s in steps if s.get("reward_kl") is not None]
            ax.plot(*zip(*measured), marker="s", label="in the reward (per token)")
            ax.legend(fontsize=7)
        _style(ax, title)
    for ax, (key, title) in zip(eval_axes, eval_panels):
        _eval_panel(ax, evals, key)
        _style(ax, title)
    run = steps[0]["run"] if steps else ""
    fig.suptitle(f"run {run}")
    return fig


def _eval_panel(ax, evals: list[dict], key: str) -> None:
    scale = 100.0 if key in RATES else 1.0
    for mode in sorted({e["mode"] for e in evals}):
        evaluated = [e for e in evals if e["mode"] == mode]
        trained = [e for e in evaluated if e["phase"] != "base"]
        # with no trained policy evaluated, the base model's points are the line
        points = [(e["step"], e[key] * scale) for e in trained or evaluated if e.get(key) is not None]
        if points:
            ax.plot(*zip(*points), marker="o", label=mode)
        base = [e for e in evaluated if e["phase"] == "base" and e.get(key) is not None]
        if base and trained:
            ax.scatter([0], [base[0][key] * scale], marker="x", s=60, label=f"{mode}, base model")
    if ax.get_legend_handles_labels()[0]:  # a panel without data (a judged-only metric of a verified run) has none
        ax.legend(fontsize=7)


def _style(ax, title: str) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.set_title(title)
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    low, high = ax.get_xlim()
    if high - low < 1:  # one step: matplotlib's margins around it would be labelled in fractions of a step
        ax.set_xlim((low + high) / 2 - 1, (low + high) / 2 + 1)
    ax.grid(alpha=0.3)


def eval_summary(db_path: Path | str) -> list[dict]:
    """The eval summary of a run's catalog ([] when it holds no evaluation, or predates the evals table), as the
    eval stage summarized it: pass@k at the run's eval.pass_k (its recipe.yaml beside the catalog), else over every
    sampled response of a prompt."""
    import duckdb

    from refiner_core.eval.evaluate import summarize
    from refiner_core.publish.run_sql import recipe_settings
    from refiner_core.store.storage import query

    try:
        columns, rows = query(db_path, "SELECT * FROM evals")
    except duckdb.CatalogException:
        return []
    settings = recipe_settings(Path(db_path), "eval")
    return summarize([dict(zip(columns, r)) for r in rows], pass_k=settings.get("pass_k") or 1 << 30)
