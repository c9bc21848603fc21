"""Detect objects in images with a swapped detector at graph speed; draw the boxes (mmdet's DetInferencer outputs).

    python tools/infer.py CONFIG CHECKPOINT IMAGES... [--out-dir DIR] [--recursive] [--device cuda:0]
                          [--score-thr 0.3] [--amp-dtype {float16,bfloat16}] [--eager | --no-buckets | --canvas]
                          [--max-graphs N] [--cudnn-api {v7,v8}]

IMAGES are files or folders (with --recursive, their subfolders too). Writes ``DIR/vis/<image>`` (the image with its
detections drawn) and ``DIR/preds/<image stem>.json`` (boxes, scores, labels), as mmdet's ``DetInferencer`` does,
keeping each image's path relative to the folder the inputs share (``a/x.jpg`` and ``b/x.jpg`` do not overwrite
each other). A file that is not a readable image (truncated, not an image at all) is skipped with a warning and
counted; grayscale and 16-bit images are converted as mmdet's image loading converts them. Class names come from
the checkpoint, else from the config's dataset. On CUDA the detector runs through
``deform_plugin.apis.enable_fast_inference``: Deformable-DETR and DINO run their backbone at each image's own size
(replayed from a graph once the size recurs) and pad the feature maps to 128 px buckets before the transformer,
whose graphs serve every size of a bucket (the detections are the unpadded image's); other detectors pad each image
to a bucket (32 px steps), whose forward is replayed from a CUDA graph once it recurs; a size seen once runs
eagerly, never paying a capture. ``--canvas`` pads an image whose bucket has no graph into the test pipeline's
largest size (for sizes that rarely repeat; more padding); ``--no-buckets`` keeps mmdet's padding (a graph per exact
size); both pad images for every detector. ``--eager`` runs mmdet's plain inference instead, for comparison. Graph
runs select cuDNN's v7 convolution API, whose planning at each new input size is far cheaper, for replays about 1 ms
slower (``deform_plugin/conv_planning.py`` has both figures); ``--cudnn-api v8`` keeps PyTorch's default v8 API (for
folders of one image size), ``--cudnn-api v7`` selects v7 for ``--eager`` too.
"""
from __future__ import annotations

import os

# Before anything loads torch's OpenMP runtime: idle threads sleep instead of spinning (deform_plugin/cpu_threads.py).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import contextlib
import sys
import time
from typing import List, Optional, Sequence

import deform_plugin  # noqa: F401  (before mmdet: installs the mmcv-lite stand-in and registers our modules)
import torch

from deform_plugin.cli import is_remote, path_problem, read_config, require_path, usage_error
from deform_plugin.cpu_threads import configure_cpu_threads
from deform_plugin.image_files import (IMAGE_SUFFIXES, ImageFile, UnreadableImage, find_images, has_subfolders,
                                       prediction_names, read_image)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", help="detector config (a DETR-family or Mask2Former config of this repository, or "
                        "any mmdet config with custom_imports=['deform_plugin'])")
    parser.add_argument("checkpoint", help="checkpoint file ('none' for random weights, to try the tool)")
    parser.add_argument("images", nargs="+", help="image files or folders of images")
    parser.add_argument("--out-dir", default="outputs", help="where vis/ and preds/ are written (default: outputs)")
    parser.add_argument("--recursive", action="store_true", help="also read the images of subfolders")
    parser.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu",
                        help="default: cuda:0 where a GPU is present, else cpu")
    parser.add_argument("--score-thr", type=float, default=0.3, help="draw detections scoring at least this "
                        "(default: 0.3)")
    parser.add_argument("--amp-dtype", choices=("float16", "bfloat16"), help="run the model under autocast")
    graphs = parser.add_mutually_exclusive_group()
    graphs.add_argument("--eager", action="store_true", help="no CUDA graphs: mmdet's own inference")
    graphs.add_argument("--no-buckets", action="store_true",
                        help="CUDA graphs without padding inputs to buckets: a graph per exact input size")
    graphs.add_argument("--canvas", action="store_true",
                        help="for folders whose image sizes rarely repeat: an image whose size has no graph is "
                        "padded into the test pipeline's largest size (faster; more padding, see docs/results.md)")
    parser.add_argument("--cudnn-api", choices=("v7", "v8"),
                        help="cuDNN's convolution API (default: v7 for graph runs on CUDA, cheaper at each new input "
                        "size; PyTorch's v8 for --eager); v8 for folders of one image size")
    parser.add_argument("--max-graphs", type=int, default=16,
                        help="input shapes kept as CUDA graphs; later new shapes run eagerly (default: 16)")
    return parser.parse_args(argv)


def images_to_run(paths: Sequence[str], recursive: bool) -> List[ImageFile]:
    """The images of ``paths``; a path that does not exist or cannot be read, or no image at all, is a usage
    error."""
    for path in paths:
        problem = path_problem("image", path, folder=os.path.isdir(path))
        if problem is not None:
            usage_error(problem)
    images, ignored = find_images(paths, recursive)
    if not images:
        others = f" ({ignored} other file(s), none with an image suffix)" if ignored else ""
        more = "; pass --recursive to read their subfolders" if not recursive and has_subfolders(paths) else ""
        usage_error(f"no images in {', '.join(map(repr, paths))}{others}{more}")
    if ignored:
        print(f"note: left out {ignored} file(s) whose names do not end in an image suffix "
              f"({' '.join(IMAGE_SUFFIXES)})", file=sys.stderr)
    return images


def save_outputs(inferencer, image: ImageFile, pixels, sample, out_dir: str, json_name: str,
                 score_thr: float) -> None:
    """The drawn image to ``vis/<name>`` and the predictions to ``preds/<json_name>``, as mmdet's inferencer writes
    them for a file input."""
    import mmcv
    import mmengine

    inferencer.visualizer.add_datasample(image.name, pixels[:, :, ::-1], sample, draw_gt=False,
                                         pred_score_thr=score_thr,
                                         out_file=os.path.join(out_dir, "vis", image.name))
    prediction = inferencer.pred2dict(sample)
    json_path = os.path.join(out_dir, "preds", json_name)
    os.makedirs(os.path.dirname(json_path), exist_ok=True)
    if "panoptic_seg" in prediction:  # an (H, W, 3) RGB array: a PNG beside the JSON, as mmdet saves it
        panoptic_path = json_path[:-len(".json")] + "_panoptic_seg.png"
        mmcv.imwrite(prediction.pop("panoptic_seg")[:, :, ::-1], panoptic_path)
        prediction["panoptic_seg_path"] = panoptic_path
    mmengine.dump(prediction, json_path)


def select_cudnn_api(api: str, device: str) -> None:
    """cuDNN's ``api`` ('v7' or 'v8') for this process (read at its first convolution, which has not run yet); a
    clash with ``TORCH_CUDNN_V8_API_DISABLED`` as the user set it is a usage error."""
    from deform_plugin.conv_planning import select_cudnn_api as select
    problem = select(api)
    if problem:
        usage_error(problem)
    if not device.startswith("cuda"):
        usage_error(f"--cudnn-api selects an API of cuDNN, a CUDA library: it needs a CUDA device, not {device!r}")


def summary(done: int, skipped: int, seconds: float, first_seconds: float, graphs: bool) -> str:
    """What the run did, in words true of the device it ran on."""
    rate = f"{done / seconds:.2f} img/s" if seconds > 0 else "-"
    line = f"{done} image(s) in {seconds:.1f} s, {rate} end to end (reading, inference, drawing, saving)"
    if done > 1:
        # The first image pays one-off costs: lazy initialisation, and on CUDA the first kernels' loading.
        line += f"; {(done - 1) / max(seconds - first_seconds, 1e-9):.2f} img/s after the first"
        if graphs:
            line += " (the first image of each new input size also captures its CUDA graph)"
    if skipped:
        line += f"; skipped {skipped} unreadable file(s), each named above"
    return line


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    require_path("config", args.config)
    weights = None if args.checkpoint.lower() == "none" else args.checkpoint
    if weights is not None and not is_remote(weights):
        require_path("checkpoint", weights, hint=" (pass 'none' for random weights)")
    images = images_to_run(args.images, args.recursive)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        usage_error(f"--device {args.device}: torch sees no CUDA device here; pass --device cpu")
    if args.amp_dtype and not args.device.startswith("cuda"):
        usage_error("--amp-dtype needs a CUDA device")
    if args.cudnn_api:
        select_cudnn_api(args.cudnn_api, args.device)
    cfg = read_config(args.config)
    from deform_plugin.apis import CapturePolicy, enable_fast_inference, throughput_buckets
    try:
        policy = CapturePolicy(max_graphs=args.max_graphs)
    except ValueError as error:
        usage_error(f"--max-graphs: {error}")

    from tqdm import tqdm

    from deform_plugin.integration.mmdet_inferencer import NamedClassesInferencer
    inferencer = NamedClassesInferencer(model=cfg, weights=weights, device=args.device, show_progress=False)
    classes = inferencer.model.dataset_meta["classes"]
    shown = ", ".join(classes[:6]) + (", ..." if len(classes) > 6 else "")
    print(f"classes: {len(classes)} from {inferencer.class_names_source} ({shown})", file=sys.stderr)
    if weights is None:
        print("note: checkpoint 'none': random weights, to try the tool; the detections mean nothing",
              file=sys.stderr)
    graphs = False
    if not args.eager and args.device.startswith("cuda"):
        try:
            buckets = (dict(buckets=None) if args.no_buckets else
                       dict(buckets=throughput_buckets(inferencer.model)) if args.canvas else {})
            enable_fast_inference(inferencer.model, policy=policy, **buckets)
            graphs = True
        except TypeError as error:
            print(f"note: {error}; running mmdet's plain inference", file=sys.stderr)
    autocast = (torch.autocast("cuda", dtype=getattr(torch, args.amp_dtype)) if args.amp_dtype
                else contextlib.nullcontext())

    json_names = prediction_names([image.name for image in images])
    done, skipped, first_seconds = 0, 0, 0.0
    # disable=None: no bar where stderr is not a terminal (logs, pipes); the summary line says the same.
    progress = tqdm(total=len(images), desc="infer", unit="img", disable=None, dynamic_ncols=True, file=sys.stderr)
    started = time.perf_counter()
    for image, json_name in zip(images, json_names):
        try:
            pixels = read_image(image.path)
        except UnreadableImage as reason:
            skipped += 1
            progress.write(f"warning: skipped {image.path}: {reason}", file=sys.stderr)
            progress.set_postfix(skipped=skipped, refresh=False)
            progress.update(1)
            continue
        with autocast:
            result = inferencer(pixels, return_datasamples=True, no_save_vis=True, no_save_pred=True)
        save_outputs(inferencer, image, pixels, result["predictions"][0], args.out_dir, json_name, args.score_thr)
        done += 1
        if done == 1:
            first_seconds = time.perf_counter() - started
        progress.update(1)
    progress.close()
    elapsed = time.perf_counter() - started
    print(summary(done, skipped, elapsed, first_seconds, graphs))
    if done == 0:
        print(f"error: none of the {len(images)} image(s) could be read", file=sys.stderr)
        return 1
    print(f"drawn detections in {os.path.join(args.out_dir, 'vis')}, predictions in "
          f"{os.path.join(args.out_dir, 'preds')}")
    return 0


if __name__ == "__main__":
    configure_cpu_threads()
    sys.exit(main())
