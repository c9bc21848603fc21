"""A hook for tests that train through tools/dist_train.sh in other processes: each rank leaves in its work dir what
it was and saw, ``rank{R}.json`` (rank, world size, backend, device, the image ids of each training iteration and
those it predicted in validation), and its parameters before and after training, ``rank{R}_parameters.pth``.

A config names it with ``custom_imports = dict(imports=['deform_plugin', 'rank_records'])`` and
``custom_hooks = [dict(type='RankRecordsHook')]``, with tests/helpers on PYTHONPATH."""
import json
import os

import torch
import torch.distributed as dist
from mmengine.hooks import Hook
from mmengine.model import is_model_wrapper
from mmengine.registry import HOOKS


def _parameters(runner) -> dict:
    model = runner.model.module if is_model_wrapper(runner.model) else runner.model
    return {name: parameter.detach().cpu().clone() for name, parameter in model.named_parameters()}


@HOOKS.register_module()
class RankRecordsHook(Hook):
    def before_train(self, runner) -> None:
        self.images_per_iteration = []
        self.validated_images = []
        self.initial_parameters = _parameters(runner)

    def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None) -> None:
        self.images_per_iteration.append([sample.img_id for sample in data_batch["data_samples"]])

    def after_val_iter(self, runner, batch_idx, data_batch=None, outputs=None) -> None:
        self.validated_images += [sample.img_id for sample in outputs]

    def after_train(self, runner) -> None:
        rank = dist.get_rank()
        record = dict(rank=rank, world_size=dist.get_world_size(), backend=dist.get_backend(),
                      device=str(next(runner.model.parameters()).device), images=self.images_per_iteration,
                      validated_images=self.validated_images)
        with open(os.path.join(runner.work_dir, f"rank{rank}.json"), "w") as handle:
            json.dump(record, handle)
        torch.save(dict(initial=self.initial_parameters, final=_parameters(runner)),
                   os.path.join(runner.work_dir, f"rank{rank}_parameters.pth"))
