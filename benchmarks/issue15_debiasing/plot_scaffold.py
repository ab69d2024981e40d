"""Plots SCAFFOLD's table-1 curves (every trial) from reproduce_debiasing JSON
files: mean test accuracy and training loss per round.

  python benchmarks/issue15_debiasing/plot_scaffold.py OUT.png LABEL=FILE.json ...
"""
import json
import sys

import matplotlib
matplotlib.use('Agg')
import matplotlib.pyplot as plt  # noqa: E402


def main(out, *specs):
  fig, axes = plt.subplots(1, 2, figsize=(11, 4))
  for spec in specs:
    label, path = spec.split('=', 1)
    rows = json.load(open(path))['results']['table1']
    for method, r in rows.items():
      for t, curve in enumerate(r['curves']):
        rounds = [c[0] for c in curve]
        kw = dict(lw=1, label=f'{label} {method} trial {t}')
        line, = axes[0].plot(rounds, [c[1] for c in curve], **kw)
        axes[1].plot(rounds, [c[2] for c in curve], color=line.get_color(), lw=1)
  axes[0].set_ylabel('mean test accuracy')
  axes[1].set_ylabel('train loss')
  axes[1].set_yscale('log')
  for ax in axes:
    ax.set_xlabel('round')
    ax.grid(alpha=0.3)
  axes[0].legend(fontsize=6)
  fig.tight_layout()
  fig.savefig(out, dpi=100)
  print('wrote', out)


if __name__ == '__main__':
  main(*sys.argv[1:])
