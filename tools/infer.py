"""Detect objects in images with a swapped detector at graph speed; draw the boxes (mmdet's DetInferencer outputs).

    python tools/infer.py CONFIG CHECKPOINT IMAGES... [--out-dir DIR] [--device cuda:0] [--score-thr 0.3]
                          [--amp-dtype {float16,bfloat16}] [--eager] [--max-graphs N]

IMAGES are files or folders. Writes ``DIR/vis/<image>`` (the image with its detections drawn) and
``DIR/preds/<image>.json`` (boxes, scores, labels), as mmdet's ``DetInferencer`` does. On CUDA each input size's
forward is captured in a CUDA graph on its first image (``deform_plugin.apis.enable_fast_inference``); ``--eager``
runs mmdet's plain inference instead, for comparison.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from typing import Optional, Sequence

import deform_plugin  # noqa: F401  (before mmdet: installs the mmcv-lite stand-in and registers our modules)
import torch

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".tif", ".tiff", ".webp")


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", help="detector config (a DETR-family or Mask2Former config of this repository, or "
                        "any mmdet config with custom_imports=['deform_plugin'])")
    parser.add_argument("checkpoint", help="checkpoint file ('none' for random weights, to try the tool)")
    parser.add_argument("images", nargs="+", help="image files or folders of images")
    parser.add_argument("--out-dir", default="outputs", help="where vis/ and preds/ are written")
    parser.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--score-thr", type=float, default=0.3, help="draw detections scoring at least this")
    parser.add_argument("--amp-dtype", choices=("float16", "bfloat16"), help="run the model under autocast")
    parser.add_argument("--eager", action="store_true", help="no CUDA graphs: mmdet's own inference")
    parser.add_argument("--max-graphs", type=int, default=4, help="input sizes kept as CUDA graphs")
    return parser.parse_args(argv)


def image_files(paths: Sequence[str]) -> list:
    files = []
    for path in paths:
        if os.path.isdir(path):
            files.extend(sorted(os.path.join(path, name) for name in os.listdir(path)
                                if name.lower().endswith(IMAGE_SUFFIXES)))
        elif os.path.isfile(path):
            files.append(path)
        else:
            raise SystemExit(f"error: image {path!r} does not exist")
    if not files:
        raise SystemExit(f"error: no images found in {list(paths)}")
    return files


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if not os.path.isfile(args.config):
        raise SystemExit(f"error: config {args.config!r} does not exist")
    weights = None if args.checkpoint.lower() == "none" else args.checkpoint
    if weights is not None and not os.path.isfile(weights):
        raise SystemExit(f"error: checkpoint {weights!r} does not exist (pass 'none' for random weights)")
    images = image_files(args.images)
    if args.amp_dtype and not args.device.startswith("cuda"):
        raise SystemExit("error: --amp-dtype needs a CUDA device")

    from mmdet.apis import DetInferencer

    from deform_plugin.apis import enable_fast_inference
    inferencer = DetInferencer(model=args.config, weights=weights, device=args.device, show_progress=False)
    if not args.eager and args.device.startswith("cuda"):
        try:
            enable_fast_inference(inferencer.model, max_graphs=args.max_graphs)
        except TypeError as error:
            print(f"note: {error}; running mmdet's plain inference", file=sys.stderr)
    autocast = (torch.autocast("cuda", dtype=getattr(torch, args.amp_dtype)) if args.amp_dtype
                else contextlib.nullcontext())
    started = time.perf_counter()
    with autocast:
        for image in images:
            inferencer(image, out_dir=args.out_dir, pred_score_thr=args.score_thr, no_save_pred=False)
    elapsed = time.perf_counter() - started
    print(f"{len(images)} image(s) in {elapsed:.2f} s (first images of each size include warm-up and capture); "
          f"drawn detections in {os.path.join(args.out_dir, 'vis')}, predictions in "
          f"{os.path.join(args.out_dir, 'preds')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
