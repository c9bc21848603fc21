"""Export a DETR-family detector (Deformable-DETR plain/refine/two-stage, DINO, Mask2Former instance segmentation) to
ONNX, and check it in ONNX Runtime.

    python tools/export_onnx.py CONFIG [CHECKPOINT] --out FILE --shape H W [--opset N] [--verify]
                                [--image IMAGE] [--cfg-options KEY=VALUE ...]

The graph takes one raw image of the fixed size H x W — ``image (1, 3, H, W)`` float32 pixel values 0-255 in the
channel order of mmdet's image loading (BGR for the stock configs); the channel flip and the normalisation of the
config's data preprocessor are inside the graph — and returns the DETR family's top-k detections without NMS:
``boxes (1, K, 4)`` xyxy in input pixels, ``scores (1, K)``, ``labels (1, K)``; Mask2Former adds
``masks (1, K, H, W)`` (bool), its detections sorted by score. Without CHECKPOINT the weights are random (said on the
console). Every MSDA layer is exported as standard ONNX operators (GridSample, opset >= 16).

``--verify`` runs the file in ONNX Runtime and the PyTorch model on the same image (random, or ``--image`` resized to
H x W) and prints the errors; it exits 1 if a score differs by more than 1e-4, a box by more than 1e-3 relative (for
masks' boxes: or 1 px), a top-k label does not match, or a mask's IoU with PyTorch's is under 0.99. Bad requests
(no MSDA in the config, unsupported detector, an image size the model cannot take, missing files) exit 2 with a
one-line message. See docs/deployment.md.
"""
from __future__ import annotations

import os

# Before anything loads torch's OpenMP runtime: idle threads sleep instead of spinning (deform_plugin/cpu_threads.py).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import sys
import time
from typing import Optional, Sequence

import deform_plugin  # noqa: F401  (before mmdet: installs the mmcv-lite stand-in and the checkpoint fix)
from mmengine.config import DictAction

from deform_plugin.cli import check_cfg_options_of, is_remote, path_problem
from deform_plugin.cpu_threads import configure_cpu_threads
from deform_plugin.integration.mmdet_detr_onnx import (DEFAULT_OPSET, ExportError, build_detector, check_exportable,
                                                       check_input_size, check_opset, export_detector, export_model,
                                                       verify_onnx)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Export a DETR-family detector or Mask2Former to ONNX "
                                     "(with deform_plugin)")
    parser.add_argument("config", help="config file path")
    parser.add_argument("checkpoint", nargs="?", help="checkpoint file (random weights without it)")
    parser.add_argument("--out", required=True, help="the .onnx file to write")
    parser.add_argument("--shape", nargs=2, type=int, required=True, metavar=("H", "W"),
                        help="the fixed input image size the graph is traced for")
    parser.add_argument("--opset", type=int, default=DEFAULT_OPSET, help=f"ONNX opset (default {DEFAULT_OPSET})")
    parser.add_argument("--verify", action="store_true",
                        help="compare ONNX Runtime with PyTorch on one image; exit 1 on mismatch")
    parser.add_argument("--image", help="with --verify: an image file (read as mmdet does, resized to H x W) "
                        "instead of random pixels")
    parser.add_argument("--cfg-options", nargs="+", action=DictAction,
                        help="override settings of the config, as key=value pairs (mmengine's DictAction syntax)")
    return parser.parse_args(argv)


def read_image(path: str, height: int, width: int):
    """``(1, 3, H, W)`` float32 pixels of ``path`` as mmdet's ``LoadImageFromFile`` reads them (BGR), resized."""
    import mmcv
    import torch

    problem = path_problem("image", path)
    if problem is not None:
        raise ExportError(problem)
    array = mmcv.imread(path)  # BGR uint8, (h, w, 3)
    if array is None:
        raise ExportError(f"cannot read {path} as an image")
    array = mmcv.imresize(array, (width, height))
    return torch.from_numpy(array).permute(2, 0, 1)[None].float().contiguous()


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Export (and verify); return the exit status: 0 done, 1 verification failed, 2 bad request."""
    args = parse_args(argv)
    height, width = args.shape
    try:
        for kind, path in (("config", args.config), ("checkpoint", args.checkpoint)):
            problem = None if path is None or is_remote(path) else path_problem(kind, path)
            if problem is not None:
                raise ExportError(problem)
        check_opset(args.opset)
        out_dir = os.path.dirname(os.path.abspath(args.out))
        if not os.path.isdir(out_dir):
            raise ExportError(f"the directory of --out does not exist: {out_dir}")
        image = read_image(args.image, height, width) if args.image else None
        check_cfg_options_of([args.config], args.cfg_options)
        model = build_detector(args.config, args.checkpoint, args.cfg_options)
        if args.checkpoint is None:
            print("note: no checkpoint given: exporting randomly initialised weights (the graph is the same; the "
                  "detections are not a trained model's)")
        check_exportable(model)
        sizes = check_input_size(model, height, width)
        wrapper = export_model(model, height, width)
        start = time.perf_counter()
        operators = export_detector(wrapper, args.out, args.opset)
        seconds = time.perf_counter() - start
    except ExportError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    levels = ", ".join(f"{h}x{w}" for h, w in sizes.level_shapes)
    print(f"exported {type(model).__name__} to {args.out} ({os.path.getsize(args.out) / 2**20:.1f} MiB, opset "
          f"{args.opset}, {seconds:.1f} s)")
    print(f"  input:   image (1, 3, {height}, {width}) float32 raw pixels 0-255"
          + (", BGR (flipped to RGB in the graph)" if wrapper.flip_channels else "")
          + (", normalised in the graph" if wrapper.normalize else ""))
    k = wrapper.max_per_img
    print(f"  outputs: boxes (1, {k}, 4) xyxy pixels, scores (1, {k}), labels (1, {k}) int64"
          + (f", masks (1, {k}, {height}, {width}) bool" if "masks" in wrapper.output_names else ""))
    print(f"  MSDA levels at this size: {levels} ({sizes.num_keys} keys)")
    print(f"  operators: {' '.join(operators)}")
    if not args.verify:
        return 0
    try:
        report = verify_onnx(args.out, wrapper, image=image)
    except ExportError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"verify on {'--image ' + args.image if image is not None else 'a random image'} (ONNX Runtime vs "
          "PyTorch):")
    for line in report.lines():
        print(f"  {line}")
    print("verify: PASSED" if report.passed else "verify: FAILED")
    return 0 if report.passed else 1


if __name__ == "__main__":
    configure_cpu_threads()
    sys.exit(main(sys.argv[1:]))
