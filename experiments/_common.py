"""What the experiment scripts share: atomic CSV and PNG writes."""

from __future__ import annotations

import csv
import io
from pathlib import Path

from netpart.files import write_atomic


def write_csv(path: Path, rows: list[dict]) -> None:
    """`rows` (dicts with the same keys) as CSV, written to a temp file and renamed."""
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(rows[0]))
    w.writeheader()
    w.writerows(rows)
    write_atomic(path, buf.getvalue().encode())


def save_figure(fig, path: Path, dpi: int = 110) -> None:
    """Save a matplotlib figure as PNG atomically and close it."""
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    plt.close(fig)
    write_atomic(path, buf.getvalue())
