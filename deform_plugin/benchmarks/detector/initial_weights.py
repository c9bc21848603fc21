"""Initial weights of a detector, built by stock mmdet in a process that never imports deform_plugin.

    python deform_plugin/benchmarks/stock_process.py deform_plugin.benchmarks.detector.initial_weights \\
        CONFIG --seeds 0 1 2 --out-dir DIR

For each seed: mmengine's ``set_random_seed(seed)`` (as the Runner seeds a run), the config's model built by mmdet's
registry and initialised by its own ``init_weights``, on the CPU; its state dict saved as
``DIR/seed<seed>.pth`` (``{'meta': ..., 'state_dict': ...}``, tensors and plain values only, so that
``torch.load(weights_only=True)`` reads it). Every row of one seed in the AP parity tool (:mod:`.ap_parity`) starts
from that file through ``load_from``: stock and deform_plugin rows share their initialisation exactly (our modules
have the same parameters and buffers as mmcv's and mmdet's).
"""
from __future__ import annotations

import argparse
import copy
import os
import sys
from pathlib import Path
from typing import Sequence

import torch

from deform_plugin.benchmarks.detector.stock_train import prepare_mmcv
from deform_plugin.benchmarks.stock_process import plugin_imported


def weights_path(out_dir: Path, seed: int) -> Path:
    return Path(out_dir) / f"seed{seed}.pth"


def build_initial_weights(config_path: str, seeds: Sequence[int], out_dir: Path) -> list:
    """Save one initial state dict per seed; returns the paths."""
    from mmdet.registry import MODELS
    from mmdet.utils import register_all_modules
    from mmengine.config import Config
    from mmengine.runner import set_random_seed

    cfg = Config.fromfile(config_path)
    register_all_modules(init_default_scope=True)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for seed in seeds:
        set_random_seed(seed)
        model = MODELS.build(copy.deepcopy(cfg.model))  # mmdet's detectors edit the config they are built from
        model.init_weights()
        state = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
        path = weights_path(out_dir, seed)
        meta = dict(seed=int(seed), config=str(config_path), built_by="stock mmdet (initial_weights)",
                    parameters=int(sum(p.numel() for p in model.parameters())))
        # Runs wait for this file to appear (ParityRunHook): written whole, then renamed into place.
        temporary = path.with_name(f".{path.name}.tmp")
        torch.save(dict(meta=meta, state_dict=state), temporary)
        os.replace(temporary, path)
        print(f"initial_weights: seed {seed}: {len(state)} tensors, {meta['parameters']} parameters -> {path}",
              flush=True)
        paths.append(path)
    return paths


def main(argv: Sequence[str]) -> None:
    parser = argparse.ArgumentParser(description="Initial detector weights per seed, built by stock mmdet")
    parser.add_argument("config")
    parser.add_argument("--seeds", type=int, nargs="+", required=True)
    parser.add_argument("--out-dir", type=Path, required=True)
    args = parser.parse_args(argv)
    served_by = prepare_mmcv()
    print(f"initial_weights: mmcv ops: {served_by}", flush=True)
    build_initial_weights(args.config, args.seeds, args.out_dir)
    if plugin_imported():
        raise SystemExit("deform_plugin was imported while building stock initial weights")


if __name__ == "__main__":
    main(sys.argv[1:])
