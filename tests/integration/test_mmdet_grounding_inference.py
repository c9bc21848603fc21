"""Grounding-DINO's graph inference gives mmdet's own predict on the same padded input: eager, captured and replayed
(graphs emulated on the CPU), for each prompt, a prompt of another token count in graphs of its own; the region reads
nothing back from the device, and the kept prompts are those a new call would compute."""
import copy

import pytest
import torch

pytest.importorskip("transformers")

import deform_plugin  # noqa: E402,F401  (mmcv-lite stand-in; registers our module)
from deform_plugin.apis import enable_fast_inference  # noqa: E402
from deform_plugin.cuda_graphs import CapturePolicy, InferenceBuckets  # noqa: E402
from deform_plugin.integration.mmdet_fast_paths import apply_fast_paths  # noqa: E402

small_grounding_dino = pytest.importorskip("small_grounding_dino")
emulated_graphs = pytest.importorskip("emulated_graphs")

CLASSES = small_grounding_dino.CLASSES
# Five names, and two of them: a prompt of another token count.
SHORT_PROMPT = CLASSES[1:3]


def _model():
    """The small Grounding-DINO in float64 (eager and graphed compare to float rounding), 50 detections kept (its 30
    queries give 150 scores per prompt of five names)."""
    model = small_grounding_dino.small_grounding_dino(seed=0).eval().double()
    model.bbox_head.test_cfg["max_per_img"] = 50
    return model


@pytest.fixture(scope="module")
def stock():
    return _model()


def _inputs(model, height, width, image_height=None, image_width=None, text=CLASSES, seed=0):
    """A preprocessed batch-1 input of ``height`` x ``width`` holding an image of ``image_height`` x ``image_width``
    (the rest padding, as the graph inference pads it), prompted with ``text``, each name an entity."""
    batch = small_grounding_dino.grounding_batch(model, (0,), image_height or height, image_width or width, seed)
    data = model.data_preprocessor(batch, False)
    inputs = data["inputs"].double()
    inputs = torch.nn.functional.pad(inputs, (0, width - inputs.shape[-1], 0, height - inputs.shape[-2]))
    samples = data["data_samples"]
    for sample in samples:
        sample.set_metainfo(dict(text=text, custom_entities=True, batch_input_shape=(height, width)))
    return inputs, samples


def _assert_same_detections(got, expected):
    for ours, theirs in zip(got, expected):
        ours, theirs = ours.pred_instances, theirs.pred_instances
        # The region masks an unpadded image's padding with an all-valid mask where stock passes none: rounding.
        torch.testing.assert_close(ours.bboxes, theirs.bboxes, rtol=1e-9, atol=1e-9)
        # mmdet gathers the token scores into a float32 table (convert_grounding_to_cls_scores): float32's rounding.
        torch.testing.assert_close(ours.scores, theirs.scores, rtol=1e-6, atol=1e-7)
        assert torch.equal(ours.labels, theirs.labels)
        assert ours.label_names == theirs.label_names


def _predict(inference, inputs, samples):
    with torch.no_grad():
        return inference.predict(inputs, copy.deepcopy(samples))


def _fast(stock, **kwargs):
    model = copy.deepcopy(stock)
    apply_fast_paths(model, sdpa_attention=True, sync_free_forward=True)
    return model, emulated_graphs.EmulatedGraphInference(model, **kwargs)


def test_eager_captured_and_replayed_calls_give_mmdets_predict(stock):
    _, inference = _fast(stock, policy=CapturePolicy(capture_after=2))
    # 60 x 90 is padded to its 64 x 96 bucket; stock predicts on that padded input (its own masks from img_shape).
    calls = [(64, 96, None, None), (64, 96, 60, 90), (64, 96, 60, 90), (64, 96, 48, 96)]
    kinds = []
    for seed, (height, width, image_height, image_width) in enumerate(calls):
        inputs, samples = _inputs(stock, height, width, image_height, image_width, seed=seed)
        unpadded = inputs[..., :image_height or height, :image_width or width]
        before = (len(inference.graphs.entries), inference.graphs.replays)
        got = _predict(inference, unpadded, samples)
        kinds.append("capture" if len(inference.graphs.entries) > before[0]
                     else "replay" if inference.graphs.replays > before[1] else "eager")
        assert tuple(got[0].metainfo["batch_input_shape"]) == (height, width)
        _assert_same_detections(got, stock.predict(inputs, copy.deepcopy(samples)))
    assert kinds == ["eager", "capture", "replay", "replay"]


def test_a_prompt_of_another_length_gets_its_own_signature(stock):
    _, inference = _fast(stock, policy=CapturePolicy(capture_after=1))
    for text in (CLASSES, CLASSES, SHORT_PROMPT, SHORT_PROMPT, CLASSES):
        inputs, samples = _inputs(stock, 64, 96, text=text)
        got = _predict(inference, inputs, samples)
        _assert_same_detections(got, stock.predict(inputs, copy.deepcopy(samples)))
        assert set(got[0].pred_instances.label_names) <= set(text)
    signatures = list(inference.graphs.entries)
    # Each prompt: eager (its kind's warm-up), captured (a capture replays too); then the first prompt replayed.
    assert len(signatures) == 2 and inference.graphs.eager_calls == 2 and inference.graphs.replays == 3
    text_shapes = [dict((name, shape) for name, shape, _ in signature[-2]) for signature in signatures]
    # [CLS], each name's words and its dot, [SEP]: five names of nine words, two of four.
    assert [shapes["memory_text"] for shapes in text_shapes] == [(1, 16, 256), (1, 8, 256)]
    assert [shapes["text_self_attention_masks"] for shapes in text_shapes] == [(1, 16, 16), (1, 8, 8)]


def test_the_region_reads_nothing_back_from_the_device(stock):
    from host_transfers import HostTransferSpy

    from deform_plugin.integration.mmdet_fast_paths.graphed_inputs import image_sizes_tensor
    _, inference = _fast(stock)
    inputs, samples = _inputs(stock, 64, 96)
    prepared = inference.prepare(samples, inputs.device)
    with torch.no_grad(), HostTransferSpy() as spy:
        inference.region(inference.detector, inputs, image_sizes_tensor(samples, inputs.device), **prepared.inputs)
    # _corners: the CPU reference op's sampling tables (a GPU runs the Triton kernel).
    assert [call for call in spy.calls if call[1] != "_corners"] == []


def _kept_texts(inference):
    return inference.prepare.__self__.texts  # the GroundingPrompts whose prepare the split calls


def test_kept_text_tensors_follow_the_text_encoders_weights(stock):
    model, inference = _fast(stock, policy=CapturePolicy(capture_after=1))
    reference = copy.deepcopy(stock)
    inputs, samples = _inputs(stock, 64, 96)
    _predict(inference, inputs, samples)
    kept = {key: {name: tensor.clone() for name, tensor in text.items()}
            for key, text in _kept_texts(inference).items()}
    for step in range(2):  # replayed, then after an in-place update of BERT's and text_feat_map's weights
        got = _predict(inference, inputs, samples)
        with torch.no_grad():
            _assert_same_detections(got, reference.predict(inputs, copy.deepcopy(samples)))
        if step == 0:
            # The region never writes into the kept tensors.
            for key, text in kept.items():
                for name, tensor in text.items():
                    assert torch.equal(_kept_texts(inference)[key][name], tensor), name
            for owner in (model, reference):
                with torch.no_grad():
                    owner.text_feat_map.weight.mul_(1.5)
                    next(owner.language_model.parameters()).add_(0.25)
    assert len(_kept_texts(inference)) == 2  # the update made a new key


def test_chunked_prompts_run_mmdets_own_predict(stock):
    model, inference = _fast(stock)
    reference = copy.deepcopy(stock)
    for detector in (model, reference):
        detector.test_cfg["chunked_size"] = 2
        detector.bbox_head.test_cfg["max_per_img"] = 25  # the last chunk's one name has 30 scores
    inputs, samples = _inputs(stock, 64, 96)
    got = _predict(inference, inputs, samples)
    with torch.no_grad():
        expected = reference.predict(inputs, copy.deepcopy(samples))
    # Five names in chunks of two: 25 detections of each of three chunks.
    assert len(got[0].pred_instances) == 75 and not inference.graphs.entries and inference.graphs.eager_calls == 0
    _assert_same_detections(got, expected)


def test_enable_fast_inference_takes_a_grounding_dino(stock):
    model = copy.deepcopy(stock)
    changed = enable_fast_inference(model, buckets=InferenceBuckets())
    assert changed["sync_free_forward"] == 1 and changed["sdpa_attention"] > 0
    inputs, samples = _inputs(stock, 64, 96)
    got = _predict(model, inputs, samples)
    with torch.no_grad():
        _assert_same_detections(got, stock.predict(inputs, copy.deepcopy(samples)))
