"""`--plot out.png`: dsl's time ratio to each peer, per kernel and size."""
from __future__ import annotations

import math

from benchmarks import peers as peer_names
from benchmarks import sizes
from benchmarks.report import fmt_ratio


def plot(rows, path: str, title: str = "") -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  labels = [f"{r.case.bench.name}\n{sizes.label(r.case.size)}\n{r.case.backend}"
            for r in rows]
  n_peers = len(peer_names.PEERS)
  width = 0.8 / n_peers
  fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * len(rows) + 2), 4.8))
  colors = {"xla": "tab:blue", "pallas": "tab:orange", "triton": "tab:green"}
  finite, labelled = [], set()
  for j, peer in enumerate(peer_names.PEERS):
    for i, r in enumerate(rows):
      x = i + (j - (n_peers - 1) / 2) * width
      ratio = r.ratio(peer)
      if ratio is None or not math.isfinite(ratio) or ratio <= 0:
        cell = r.peers.get(peer)
        note = (cell.note if cell is not None and cell.note else "n/a")
        ax.text(x, 1.0, note.split(":")[0], rotation=90, ha="center",
                va="bottom", fontsize=6, color=colors[peer])
        continue
      finite.append(ratio)
      label = None
      if peer not in labelled:
        labelled.add(peer)
        label = f"vs {peer_names.PEER_TITLES[peer]}"
      ax.bar(x, ratio, width, color=colors[peer], label=label)
      ax.text(x, ratio, fmt_ratio(ratio), ha="center", va="bottom",
              fontsize=6)
  ax.axhline(1.0, color="black", linewidth=0.8)
  ax.set_yscale("log")
  if finite:
    ax.set_ylim(min(min(finite), 0.5) / 2, max(max(finite), 2) * 3)
  ax.set_xticks(range(len(rows)))
  ax.set_xticklabels(labels, fontsize=7)
  ax.set_ylabel("dsl time / peer time (lower is better)")
  ax.set_title(title or "dsl vs peers")
  handles, names = ax.get_legend_handles_labels()
  if handles:
    ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
