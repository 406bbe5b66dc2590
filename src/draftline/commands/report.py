"""``draftline report RUN_DIR``: plots and a one-page summary of a training run."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", type=Path, metavar="RUN_DIR",
                        help="the run directory of `draftline train` (reads its metrics.jsonl; writes the plots "
                             "and summary.md into RUN_DIR/report/); works on a live run too")


def run(args: argparse.Namespace) -> int:
    from draftline.evaluate.report import write_report

    report = write_report(args.run_dir)
    print(f"draftline report: {len(report.plots)} plots in {report.directory}")
    for path in report.plots:
        print(f"  {path}")
    for name, why in report.skipped_plots.items():
        print(f"  ({name}: not drawn, {why})")
    print(f"summary: {report.summary}")
    return 0
