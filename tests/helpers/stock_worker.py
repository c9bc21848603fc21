"""Runs in a subprocess that never imports deform_plugin: what stock mmdet builds and computes.

Usage:
    python tests/helpers/stock_worker.py count CONFIG [CONFIG ...]  -> JSON {config: number of stock MSDA modules}
    python tests/helpers/stock_worker.py forward CONFIG OUT.pt       -> saves the stock model's state_dict, outputs

Where mmcv has no compiled ops (mmcv-lite), mmcv_lite.py's placeholder ``mmcv._ext`` (not deform_plugin's stand-in:
it serves no op) lets mmdet import; on the CPU the stock MSDA then runs mmcv's pure-PyTorch path and never calls it.
The file is run by path, so that this process never imports the deform_plugin package.
"""
import json
import runpy
import sys
from pathlib import Path

import torch

MMCV_LITE = Path(__file__).resolve().parents[2] / "deform_plugin" / "integration" / "mmcv_lite.py"


def install_bare_ext() -> None:
    runpy.run_path(str(MMCV_LITE))["install_placeholder_ext"]()


def load_config(path):
    from mmengine.config import Config
    cfg = Config.fromfile(path, import_custom_modules=False)
    return cfg


def build_msda_owner(cfg):
    """The stock model, or for Grounding-DINO (whose BERT needs a download) its encoder and decoder."""
    from mmdet.registry import MODELS
    from mmdet.utils import register_all_modules
    register_all_modules()
    model_cfg = cfg.model
    if model_cfg.type == "GroundingDINO":
        # Activation checkpointing (num_cp) needs fairscale; it does not change which modules are built.
        model_cfg.encoder.num_cp = 0
        from mmdet.models.layers.transformer.grounding_dino_layers import (GroundingDinoTransformerDecoder,
                                                                            GroundingDinoTransformerEncoder)
        return torch.nn.ModuleList([GroundingDinoTransformerEncoder(**model_cfg.encoder),
                                    GroundingDinoTransformerDecoder(**model_cfg.decoder)])
    if "backbone" in model_cfg:
        model_cfg.backbone.init_cfg = None  # no pretrained download
    return MODELS.build(model_cfg)


def detection_inputs(batch=2, height=160, width=192, seed=0):
    from mmdet.structures import DetDataSample
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(batch, 3, height, width, generator=generator, dtype=torch.float64)
    samples = []
    for index in range(batch):
        shape = (height - 8 * index, width - 16 * index)  # unequal images: padding masks are exercised
        samples.append(DetDataSample(metainfo=dict(img_shape=shape, batch_input_shape=(height, width),
                                                   pad_shape=(height, width), ori_shape=shape,
                                                   scale_factor=(1.0, 1.0))))
    return inputs, samples


def main(argv):
    install_bare_ext()
    from mmcv.ops import MultiScaleDeformableAttention as StockMSDA
    command = argv[0]
    if command == "count":
        counts = {}
        for path in argv[1:]:
            model = build_msda_owner(load_config(path))
            counts[path] = sum(type(m) is StockMSDA for m in model.modules())
        assert "deform_plugin" not in sys.modules
        print(json.dumps(counts))
    elif command == "forward":
        path, out_path = argv[1], argv[2]
        torch.manual_seed(0)
        model = build_msda_owner(load_config(path))
        model.init_weights()
        model = model.double().eval()
        inputs, samples = detection_inputs()
        with torch.no_grad():
            outputs = model(inputs, samples, mode="tensor")
        assert "deform_plugin" not in sys.modules
        torch.save(dict(state_dict=model.state_dict(), outputs=outputs), out_path)
    else:
        raise SystemExit(f"unknown command {command!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
