"""Training curves as a PNG."""

from __future__ import annotations

from pathlib import Path


def plot_steps(steps: list[dict], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    x = [s["step"] for s in steps]
    panels = [("reward_mean", "reward (mean ± std)"), ("kl", "KL to reference"), ("loss", "loss"),
              ("response_length_mean", "response tokens (mean)")]
    fig, axes = plt.subplots(2, 2, figsize=(9, 6), constrained_layout=True)
    for ax, (key, title) in zip(axes.flat, panels):
        y = [s[key] for s in steps]
        ax.plot(x, y, marker="o")
        if key == "reward_mean":
            std = [s["reward_std"] for s in steps]
            ax.fill_between(x, [a - b for a, b in zip(y, std)], [a + b for a, b in zip(y, std)], alpha=0.2)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    fig.suptitle(f"run {steps[0]['run']}")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return Path(path)
