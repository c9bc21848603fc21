"""BucketViewDistributedDataParallel: the default wrapper's updates, without per-parameter copies into the buckets."""
import json
import os

import pytest
import torch
from torch import nn


def _tiny_model():
    from mmengine.model import BaseModel

    class Tiny(BaseModel):
        def __init__(self):
            super().__init__()
            self.layers = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))

        def forward(self, inputs, targets, mode="loss"):
            return dict(loss=((self.layers(inputs) - targets) ** 2).mean())

    torch.manual_seed(0)
    return Tiny()


def _train(wrapper_type, rank, steps, **wrapper_kwargs):
    """Parameters after ``steps`` AdamW steps of the wrapped tiny model, and the reducer's per-parameter copies,
    divisions and gradient storages seen in the last step."""
    from mmengine.optim import OptimWrapper
    from torch.profiler import ProfilerActivity, profile

    model = wrapper_type(module=_tiny_model(), **wrapper_kwargs)
    optim_wrapper = OptimWrapper(torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1))
    generator = torch.Generator().manual_seed(100 + rank)
    data = [dict(inputs=torch.randn(6, 8, generator=generator), targets=torch.randn(6, 4, generator=generator))
            for _ in range(steps)]
    for batch in data[:-1]:
        model.train_step(batch, optim_wrapper)
    pointers_before = [p.grad.data_ptr() if p.grad is not None else None for p in model.parameters()]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        model.train_step(data[-1], optim_wrapper)
    reducer_ops = sorted({e.key for e in prof.key_averages() if e.key.startswith("torch::distributed::reducer::")})
    per_parameter = sum(e.count for e in prof.key_averages()
                        if e.key in ("torch::distributed::reducer::copy_", "torch::distributed::reducer::mul_out"))
    return dict(params=[p.detach().clone() for p in model.parameters()],
                grad_pointers_kept=[p.grad is not None and p.grad.data_ptr() == before
                                    for p, before in zip(model.parameters(), pointers_before)],
                per_parameter_reducer_ops=per_parameter, reducer_ops=reducer_ops)


def _compare_worker(rank, out_dir):
    from mmengine.model import MMDistributedDataParallel

    from deform_plugin.engine import BucketViewDistributedDataParallel

    stock = _train(MMDistributedDataParallel, rank, steps=4, gradient_as_bucket_view=True, static_graph=True)
    ours = _train(BucketViewDistributedDataParallel, rank, steps=4, static_graph=True)
    same = [bool(torch.equal(a, b)) for a, b in zip(stock["params"], ours["params"])]
    moved = [not bool(torch.equal(a, b)) for a, b in zip(ours["params"], _tiny_model().parameters())]
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(dict(same=same, moved=moved,
                       stock_per_parameter=stock["per_parameter_reducer_ops"],
                       ours_per_parameter=ours["per_parameter_reducer_ops"],
                       stock_grads_kept=stock["grad_pointers_kept"], ours_grads_kept=ours["grad_pointers_kept"]), f)


def test_bucket_views_give_the_default_wrappers_parameters_without_per_parameter_copies(tmp_path):
    from gloo_ranks import run_gloo_ranks
    run_gloo_ranks(_compare_worker, str(tmp_path))
    for rank in range(2):
        with open(tmp_path / f"rank{rank}.json") as f:
            result = json.load(f)
        assert all(result["moved"]), rank  # the steps did update every parameter
        assert all(result["same"]), (rank, result["same"])  # bitwise the default wrapper's parameters
        # The default wrapper copies every parameter's new gradient into its bucket (6 parameters); ours none,
        # and each gradient stays where it was: a view of its bucket.
        assert result["stock_per_parameter"] == 6, rank
        assert result["ours_per_parameter"] == 0, rank
        assert not any(result["stock_grads_kept"]), rank
        assert all(result["ours_grads_kept"]), rank


def test_turning_bucket_views_off_is_refused_by_value():
    from deform_plugin.engine import BucketViewDistributedDataParallel

    with pytest.raises(ValueError, match="gradient_as_bucket_view=False"):
        BucketViewDistributedDataParallel(module=_tiny_model(), gradient_as_bucket_view=False)




def test_the_fast_detr_configs_select_it():
    from mmengine.config import Config

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for name in ("deformable-detr-refine-twostage_r50_16xb2-50e_coco_deform-plugin-fast.py",
                 "dino-4scale_r50_8xb2-12e_coco_deform-plugin-fast.py"):
        cfg = Config.fromfile(os.path.join(root, "configs", "fast", name), import_custom_modules=False)
        assert cfg.model_wrapper_cfg["type"] == "BucketViewDistributedDataParallel", name
