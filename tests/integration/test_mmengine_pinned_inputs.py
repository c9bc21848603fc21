"""deform_plugin.integration.mmengine_pinned_inputs: images staged through pinned memory, the same values."""
import pytest
import torch

import deform_plugin  # noqa: F401  (mmcv stand-in where mmcv-lite is installed)
from deform_plugin.integration.mmengine_pinned_inputs import PinnedInputStaging, stage_inputs_through_pinned_memory


def _preprocessor(device):
    from mmdet.models.data_preprocessors import DetDataPreprocessor
    return DetDataPreprocessor(mean=[123.675, 116.28, 103.53], std=[58.395, 57.12, 57.375], bgr_to_rgb=True,
                               pad_size_divisor=32).to(device)


def _data(sizes, seed=0):
    from mmdet.structures import DetDataSample
    generator = torch.Generator().manual_seed(seed)
    inputs = [torch.randint(0, 256, (3, h, w), generator=generator, dtype=torch.uint8) for h, w in sizes]
    samples = []
    for h, w in sizes:
        sample = DetDataSample()
        sample.set_metainfo(dict(img_shape=(h, w), ori_shape=(h, w), scale_factor=(1.0, 1.0)))
        samples.append(sample)
    return dict(inputs=inputs, data_samples=samples)


def test_on_the_cpu_the_preprocessor_is_unchanged_and_installing_twice_keeps_one():
    preprocessor = _preprocessor("cpu")
    data = _data([(37, 45), (30, 52)])
    expected = preprocessor(data, False)["inputs"]
    staging = stage_inputs_through_pinned_memory(preprocessor)
    assert isinstance(staging, PinnedInputStaging) and stage_inputs_through_pinned_memory(preprocessor) is staging
    assert torch.equal(preprocessor(data, False)["inputs"], expected)
    assert staging.staged_images == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned staging runs on CUDA only")
def test_staged_images_give_the_preprocessors_own_result_and_the_buffer_is_reused():
    plain, staged = _preprocessor("cuda"), _preprocessor("cuda")
    staging = stage_inputs_through_pinned_memory(staged)
    for step, sizes in enumerate([[(64, 96)], [(40, 30)], [(64, 96), (80, 32)]]):
        data = _data(sizes, seed=step)
        expected, got = plain(data, False), staged(data, False)
        assert torch.equal(got["inputs"], expected["inputs"])
        assert [s.batch_input_shape for s in got["data_samples"]] == [
            s.batch_input_shape for s in expected["data_samples"]]
    assert staging.staged_images == 4 and len(staging.buffers) == 2
    assert all(buffer.is_pinned() for buffer in staging.buffers)
