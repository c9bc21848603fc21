"""Training curves as mmengine logs them: the scalars of a run's ``*/vis_data/scalars.json``.

mmengine's ``LocalVisBackend`` appends one JSON object per logging iteration (``{"loss": ..., "iter": ...}``, each
value the mean over the log processor's window) and one per evaluation (``{"coco/bbox_mAP": ..., "step": ...}``).
``tools/plot_loss_curves.py`` and the AP parity tool (:mod:`.ap_parity`) read them here. Standard library only.
"""
from __future__ import annotations

import glob
import json
import os
from typing import List, Tuple


def newest_scalars_file(work_dir: str) -> str:
    """The newest ``*/vis_data/scalars.json`` under ``work_dir`` (a training script's ``--work-dir``)."""
    candidates = sorted(glob.glob(os.path.join(work_dir, "*", "vis_data", "scalars.json")), key=os.path.getmtime)
    if not candidates:
        raise FileNotFoundError(f"no */vis_data/scalars.json under {work_dir!r}: is it a tools/train.py work dir?")
    return candidates[-1]


def read_scalars(work_dir: str) -> List[dict]:
    """Every record of the newest scalars file under ``work_dir``, in the order logged."""
    with open(newest_scalars_file(work_dir)) as handle:
        return [json.loads(line) for line in handle if line.strip()]


def read_losses(work_dir: str, key: str = "loss") -> List[Tuple[int, float]]:
    """(iteration, value) of the training scalar ``key`` (non-finite values kept: ``json`` reads ``NaN``)."""
    points = [(int(record["iter"]), float(record[key])) for record in read_scalars(work_dir)
              if key in record and "iter" in record and "coco/bbox_mAP" not in record]
    if not points:
        raise ValueError(f"{newest_scalars_file(work_dir)} has no {key!r} entries")
    return points


def smooth(values: List[float], window: int = 5) -> List[float]:
    """Trailing mean over ``window`` points."""
    out = []
    for index in range(len(values)):
        chunk = values[max(0, index - window + 1):index + 1]
        out.append(sum(chunk) / len(chunk))
    return out
