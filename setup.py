"""deform_plugin: fused Triton multi-scale deformable attention for MMDetection 3.x, as an MMEngine plugin."""
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).parent
version = {}
exec((ROOT / "deform_plugin" / "version.py").read_text(), version)

setup(
    name="deform_plugin",
    version=version["__version__"],
    description="Fused Triton multi-scale deformable attention for MMDetection 3.x (drop-in MMEngine plugin)",
    long_description=(ROOT / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["deform_plugin", "deform_plugin.*"]),
    python_requires=">=3.9",
    # Loose here; requirements/runtime.txt pins the tested versions. mmcv is not listed: either mmcv with its
    # compiled ops or mmcv-lite (>=2.0.0rc4,<2.2.0) serves, and pip cannot express that choice.
    install_requires=["torch>=2.1", "triton>=3.0", "mmengine>=0.10,<1.0", "mmdet>=3.0,<3.4",
                      "setuptools>=77.0.3,<82"],
    # pip ignores extras under --no-deps: in an existing environment, install them by name.
    # onnx: tools/export_onnx.py writes with onnx and checks with onnxruntime (--verify); onnxscript is what torch's
    # default exporter (dynamo=True) translates with, for exports of the op or module in your own code.
    extras_require={"onnx": ["onnx", "onnxruntime", "onnxscript"],
                    "tests": ["pytest>=8", "onnx", "onnxruntime", "onnxscript"],
                    "bench": ["matplotlib"]},
    entry_points={"console_scripts": ["deform-plugin = deform_plugin.__main__:main"]},
    classifiers=["Programming Language :: Python :: 3", "License :: OSI Approved :: Apache Software License"],
)
