"""deform_plugin: fused multi-scale deformable attention for MMDetection 3.x.

``import deform_plugin`` (or ``custom_imports = dict(imports=['deform_plugin'])`` in an mmdet config):

1. where mmcv is installed without its compiled ops (mmcv-lite), installs a stand-in ``mmcv._ext`` so that
   ``mmdet.models`` and friends import (see :mod:`deform_plugin.integration.mmcv_lite`);
2. makes mmengine checkpoints load under torch >= 2.6, and a data loader's ``pin_memory`` pin the data samples too;
3. registers our ``MultiScaleDeformableAttention`` and rebinds mmdet's MSDA construction sites to it;
4. registers the step-level speedups (:mod:`deform_plugin.engine`) and the embedded demo dataset.

The ops (:mod:`deform_plugin.ops`) need only torch (and triton for the Triton backend).
"""
import importlib.util

if importlib.util.find_spec("torch") is None:
    # One clear line (also from `python -m deform_plugin check`) instead of an import error deep in the ops.
    raise ImportError("deform_plugin needs PyTorch (torch >= 2.1), which this environment lacks: install torch "
                      "first, then mmengine, mmcv (or mmcv-lite) and mmdet; see the README", name=__name__)

from .integration import install_openmmlab_integration, openmmlab_installed
from .ops import default_backend, get_default_backend, set_default_backend
from .version import __version__

__all__ = ["__version__", "default_backend", "get_default_backend", "set_default_backend"]

if openmmlab_installed():
    install_openmmlab_integration()
    from . import engine, models  # noqa: F401,E402  (registers the modules, optimizer wrappers and hooks)
    if importlib.util.find_spec("mmdet") is not None:
        from . import datasets  # noqa: F401,E402  (registers the embedded dataset)
