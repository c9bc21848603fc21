"""tools/dist_train.sh as two nodes on one host: two launches over localhost, NNODES=2, each with its own NODE_RANK
and one rank, as on two machines (each node has a work dir of its own).

The demo detector (deform_plugin's MSDA in its encoder and decoder), shrunk, trains 2 iterations of one image per
rank and then validates on the 4 validation images, each rank its share. One pair of launches serves every test here
(each launch pays seconds of imports). tools/dist_test.sh differs only in the tool it starts (the same checks and
torchrun line, tests/tools/test_dist_scripts.py; the same ``--launcher pytorch`` set-up, ``deform_plugin.cli``).

Variants: ``cpu-gloo`` (always; CUDA hidden from the ranks, so the CPU path of ``--launcher pytorch`` runs, on gloo)
and ``cuda-nccl`` (hosts with 2 GPUs: one GPU per node, NCCL over TCP sockets as between machines)::

    python -m pytest tests/tools/test_two_nodes.py -k cuda-nccl
"""
from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
from mmengine.runner.checkpoint import _load_checkpoint
from node_launches import launch_nodes

from deform_plugin.datasets import shapes

REPO_ROOT = Path(__file__).resolve().parents[2]
HELPERS = REPO_ROOT / "tests" / "helpers"
DEMO_CONFIG = REPO_ROOT / "configs" / "demo" / "deformable-detr-refine_r18_tiny_1xb4-500i_shapes.py"
SPLIT_SIZES = {"train": 8, "val": 4}
TRAIN_ITERS = 2
# Generous: on a shared 2-core machine the four processes (two agents, two ranks) each import torch, the ranks mmdet.
LAUNCH_TIMEOUT_S = 300

pytestmark = [
    pytest.mark.skipif(shutil.which("bash") is None, reason="the launch scripts are bash scripts"),
    pytest.mark.skipif(not torch.distributed.is_available(), reason="this torch is built without torch.distributed"),
    pytest.mark.slow,
    pytest.mark.xdist_group("two_nodes"),  # one worker runs the module: its two-node fixture runs once
]

VARIANTS = {
    "cpu-gloo": dict(backend="gloo", device="cpu", env=dict(CUDA_VISIBLE_DEVICES=""), env_of_node=()),
    # NCCL's socket transport over the loopback interface: what two machines joined by Ethernet use, where NCCL
    # would otherwise pass the tensors between the two GPUs of one host through shared memory or NVLink.
    "cuda-nccl": dict(backend="nccl", device="cuda:0",
                      env=dict(NCCL_P2P_DISABLE="1", NCCL_SHM_DISABLE="1", NCCL_IB_DISABLE="1",
                               NCCL_SOCKET_IFNAME="lo"),
                      env_of_node=(dict(CUDA_VISIBLE_DEVICES="0"), dict(CUDA_VISIBLE_DEVICES="1"))),
}


def _overlay_config(path: Path, cache_root: Path) -> Path:
    """The demo config, shrunk, validating after its last iteration, with the hook that records each rank
    (tests/helpers/rank_records.py)."""
    data = f"dict(cache_root={str(cache_root)!r})"
    path.write_text(f"""
_base_ = {str(DEMO_CONFIG)!r}
custom_imports = dict(imports=['deform_plugin', 'rank_records'], allow_failed_imports=False)
custom_hooks = [dict(type='RankRecordsHook')]
model = dict(num_queries=10, encoder=dict(num_layers=1), decoder=dict(num_layers=1))
train_dataloader = dict(batch_size=1, dataset={data})
val_dataloader = dict(batch_size=2, dataset={data})
val_evaluator = {data}
train_cfg = dict(max_iters={TRAIN_ITERS}, val_interval={TRAIN_ITERS})
default_hooks = dict(logger=dict(interval=1), checkpoint=dict(interval={TRAIN_ITERS}))
log_processor = dict(window_size=1)
""")
    return path


@pytest.fixture(scope="module", params=[
    "cpu-gloo",
    pytest.param("cuda-nccl", marks=pytest.mark.skipif(torch.cuda.device_count() < 2,
                                                       reason="one GPU per node needs 2 GPUs")),
])
def two_nodes(request, tmp_path_factory):
    """Train on two nodes; returns the variant, the nodes' work dirs and the launches (exit status, log)."""
    variant = request.param
    settings = VARIANTS[variant]
    root = tmp_path_factory.mktemp(variant)
    cache_root = root / "shapes_cache"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(shapes, "SPLIT_SIZES", SPLIT_SIZES)
        shapes.ensure_shapes_dataset(cache_root)  # the ranks find it there and read it
    config = _overlay_config(root / "two_nodes.py", cache_root)
    work_dirs = [root / "node0", root / "node1"]
    env = dict(os.environ, PYTHON=sys.executable,
               PYTHONPATH=os.pathsep.join(filter(None, [str(HELPERS), os.environ.get("PYTHONPATH")])),
               **settings["env"])
    runs = launch_nodes("dist_train.sh", [[str(config), "1", "--work-dir", str(d)] for d in work_dirs],
                        root / "logs", env, LAUNCH_TIMEOUT_S, settings["env_of_node"])
    for run in runs:
        assert run.returncode == 0, run.describe()
    return dict(variant=variant, work_dirs=work_dirs, runs=runs)


def _records(two_nodes):
    return [json.loads((work_dir / f"rank{rank}.json").read_text())
            for rank, work_dir in enumerate(two_nodes["work_dirs"])]


def _parameters(two_nodes):
    return [torch.load(work_dir / f"rank{rank}_parameters.pth", map_location="cpu")
            for rank, work_dir in enumerate(two_nodes["work_dirs"])]


def test_the_two_nodes_form_one_world_of_two_ranks(two_nodes):
    settings = VARIANTS[two_nodes["variant"]]
    records = _records(two_nodes)
    assert [(r["rank"], r["world_size"], r["backend"], r["device"]) for r in records] == [
        (rank, 2, settings["backend"], settings["device"]) for rank in range(2)]
    if two_nodes["variant"] == "cpu-gloo":
        assert "note: no CUDA device: the ranks join a gloo process group" in two_nodes["runs"][0].log


def test_the_ranks_train_on_different_images(two_nodes):
    image_ids = [[image for batch in record["images"] for image in batch] for record in _records(two_nodes)]
    assert [len(ids) for ids in image_ids] == [TRAIN_ITERS, TRAIN_ITERS]
    # The distributed sampler deals each rank its own share of one shuffled order.
    assert not set(image_ids[0]) & set(image_ids[1])
    assert set(image_ids[0]) | set(image_ids[1]) <= set(range(1, SPLIT_SIZES["train"] + 1))


def test_the_ranks_end_with_the_same_parameters_and_node_0_saves_them(two_nodes):
    # Each rank computes gradients on its own images; averaged over the world, they make the same update on both.
    rank0, rank1 = _parameters(two_nodes)
    assert rank0["final"].keys() == rank1["final"].keys()
    for name, value in rank0["final"].items():
        torch.testing.assert_close(rank1["final"][name], value, rtol=0, atol=0, msg=name)
        torch.testing.assert_close(rank1["initial"][name], rank0["initial"][name], rtol=0, atol=0, msg=name)
    changed = [name for name, value in rank0["final"].items() if not torch.equal(value, rank0["initial"][name])]
    assert len(changed) > 0.9 * len(rank0["final"]), "training left most parameters unchanged"
    assert any("sampling_offsets" in name for name in changed)
    # Checkpoints are rank 0's to write: node 0's work dir has one, node 1's none.
    checkpoint = two_nodes["work_dirs"][0] / f"iter_{TRAIN_ITERS}.pth"
    saved = _load_checkpoint(str(checkpoint), map_location="cpu")["state_dict"]
    for name, value in rank0["final"].items():
        torch.testing.assert_close(saved[name], value, rtol=0, atol=0, msg=name)
    assert not list(two_nodes["work_dirs"][1].glob("iter_*.pth"))


def test_the_two_nodes_validate_every_image_once(two_nodes):
    # Each rank predicts its share of the validation images; rank 0 gathers both shares and scores them.
    validated = [record["validated_images"] for record in _records(two_nodes)]
    assert sorted(validated[0] + validated[1]) == list(range(1, SPLIT_SIZES["val"] + 1))
    assert [len(ids) for ids in validated] == [SPLIT_SIZES["val"] // 2] * 2
    assert "coco/bbox_mAP:" in two_nodes["runs"][0].log
