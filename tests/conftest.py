"""Test-session setup shared by every test file.

Without a CUDA device the Triton kernels can only run in Triton's interpreter, which is chosen when the kernels are
decorated: TRITON_INTERPRET must be set before anything imports triton, so it is set here, first.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import itertools  # noqa: E402

import pytest  # noqa: E402

_SCOPE_NAMES = itertools.count()


@pytest.fixture(autouse=True)
def mmdet_default_scope():
    """Every test starts with mmdet's registry scope current, as mmdet's tools and ``init_detector`` leave it.

    Tests build mmdet's modules by registry name. mmengine keeps the latest default scope for the whole process, so
    a test that made another scope current (a Runner of its own, a tool run in-process) would otherwise change what
    the next test in the same worker finds, and the outcome would depend on the test order.
    """
    from mmengine.registry import DefaultScope
    current = DefaultScope.get_current_instance()
    if current is None or current.scope_name != "mmdet":
        DefaultScope.get_instance(f"deform_plugin-tests-{next(_SCOPE_NAMES)}", scope_name="mmdet")
    yield


@pytest.fixture(autouse=True)
def fresh_visualizers():
    """Each test's Runners build visualizers of their own.

    mmengine keeps a visualizer per name for the whole process, and a Runner names its visualizer by the second it
    was built at: two Runners built within one second (two tests in one worker) would share the first one's, whose
    files went to the first test's temporary folder, deleted since.
    """
    yield
    from mmengine.visualization import Visualizer
    for cls in [Visualizer, *_subclasses(Visualizer)]:
        cls._instance_dict.clear()


def _subclasses(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)
