"""Grounding-DINO's ``predict`` split for graph inference (:mod:`.mmdet_graph_inference`): the text prepared eagerly
per call, the image's forward captured, the post-processing eager. Mirrors mmdet 3.3.0's ``GroundingDINO.predict``.

Before the region, per call (:meth:`GroundingPrompts.prepare`):

- the prompt's token positive maps, caption and entities, from ``get_tokens_positive_and_prompts`` as mmdet makes
  them (the tokenizer and the entities' character spans, on the host);
- the text tensors the encoder reads: BERT's embedding through ``text_feat_map`` (``memory_text``), the token mask,
  and the sub-sentence position ids and self-attention masks. mmdet 3.3.0's ``BertModel.forward`` builds the masks on
  the device with a ``nonzero`` and a Python loop over its result (host reads per special token); here the same
  function runs on the tokenizer's host tensors (:func:`.mmdet_fast_paths.graphed_grounding.host_text_inputs`: the
  same integers and booleans), copied without blocking, and BERT runs eagerly on them. A language model other than
  mmdet's ``BertModel`` with sub-sentence masks runs its own forward.

Both are kept for the last few distinct prompts, because a prompt that recurs (a detector's class list) would
otherwise pay a BERT forward per image. They are exact: a prompt's positive maps depend on its text only, and its
text tensors on the captions, the text encoder's and ``text_feat_map``'s weights and the autocast setting, which the
key holds (each weight by its storage and version counter: an in-place update such as an optimizer step or
``load_state_dict`` advances it). Prompts that bring their own token spans (``tokens_positive``) or an enhanced
prompt are prepared anew at each call.

The region takes the padded image batch, each image's size and the four text tensors as its inputs, so a graph's
signature holds the text tensors' shapes: a prompt of another token count gets graphs of its own. It runs the
backbone, neck, fusion encoder, decoder and head forward (without host syncs under ``sync_free_forward``). The
post-processing is the head's ``predict_by_feat`` with each image's token positive map, then the label names as
mmdet's ``predict`` gives them, from the labels read to the host once (mmdet reads each label from the device
twice, a wait for the GPU each). Chunked prompts (``test_cfg.chunked_size > 0``: a forward per chunk of classes)
run mmdet's own ``predict``.
"""
from __future__ import annotations

import itertools
import warnings
from collections import OrderedDict
from typing import Callable, Dict, Hashable, NamedTuple, Optional, Sequence

import torch

from .mmdet_fast_paths.graphed_grounding import host_text_inputs
from .mmdet_fast_paths.graphed_training import detr_decoder
from .mmdet_fast_paths.sync_free_forward import deformable_detr_pre_transformer_from_image_sizes
from .mmdet_version import MIRRORED_MMDET_VERSION

__all__ = ["GroundingPrompts", "grounding_postprocess", "grounding_predict_split", "grounding_region",
           "stock_grounding_predict"]

# Distinct prompts whose positive maps and text tensors are kept (least recently used dropped first).
PROMPTS_KEPT = 8
# The region's text inputs, in the order of grounding_region's arguments.
TEXT_INPUTS = ("memory_text", "text_token_mask", "position_ids", "text_self_attention_masks")


def stock_grounding_predict(detector) -> bool:
    """Whether ``detector`` is a GroundingDINO whose ``predict`` and the pieces the split runs are mmdet 3.3.0's."""
    import mmdet
    from mmdet.models.dense_heads import GroundingDINOHead
    from mmdet.models.detectors import DINO, DeformableDETR, GroundingDINO
    if not isinstance(detector, GroundingDINO) or mmdet.__version__ != MIRRORED_MMDET_VERSION:
        return False
    head = detector.bbox_head
    return (all(getattr(type(detector), name) is getattr(GroundingDINO, name)
                for name in ("predict", "forward_transformer", "forward_encoder", "pre_decoder",
                             "get_tokens_positive_and_prompts"))
            and type(detector).forward_decoder is DINO.forward_decoder
            and all(getattr(type(detector), name) is getattr(DeformableDETR, name)
                    for name in ("pre_transformer", "extract_feat"))
            and isinstance(head, GroundingDINOHead)
            and all(getattr(type(head), name) is getattr(GroundingDINOHead, name)
                    for name in ("forward", "predict", "predict_by_feat")))


def _stock_bert_with_sub_sentences(language_model) -> bool:
    from mmdet.models.language_models.bert import BertModel
    return (isinstance(language_model, BertModel) and type(language_model).forward is BertModel.forward
            and language_model.use_sub_sentence_represent)


class GroundingSplit(NamedTuple):
    """What graph inference runs of a GroundingDINO's predict: ``prepare`` per call, then ``region`` (captured)
    with the prepared inputs, then ``postprocess`` with the prepared context."""
    region: Callable
    postprocess: Callable
    prepare: Callable


def grounding_predict_split(detector) -> Optional[GroundingSplit]:
    """The split of a GroundingDINO whose predict is mmdet 3.3.0's (:func:`stock_grounding_predict`), else None."""
    if not stock_grounding_predict(detector):
        return None
    return GroundingSplit(grounding_region, grounding_postprocess, GroundingPrompts(detector).prepare)


class Prepared(NamedTuple):
    """A call's region inputs besides the pixels (name -> tensor) and what its post-processing needs."""
    inputs: Dict[str, torch.Tensor]
    context: object


class GroundingPrompts:
    """The text side of a GroundingDINO's calls, with the last :data:`PROMPTS_KEPT` prompts kept (see the module)."""

    def __init__(self, detector):
        self.detector = detector
        self.prompts: "OrderedDict[Hashable, tuple]" = OrderedDict()
        self.texts: "OrderedDict[Hashable, Dict[str, torch.Tensor]]" = OrderedDict()

    def prepare(self, batch_data_samples, device: torch.device) -> Optional[Prepared]:
        """mmdet 3.3.0's ``GroundingDINO.predict`` before the image features, and its language model: the text
        tensors and ``(entities, is_rec_tasks)``; each sample's ``token_positive_map`` set as mmdet sets it. None
        for chunked prompts (mmdet's own predict runs them)."""
        text_prompts, enhanced_text_prompts, tokens_positives = [], [], []
        for sample in batch_data_samples:
            text_prompts.append(sample.text)
            enhanced_text_prompts.append(sample.caption_prompt if "caption_prompt" in sample else None)
            tokens_positives.append(sample.get("tokens_positive", None))
        custom_entities = (batch_data_samples[0].custom_entities if "custom_entities" in batch_data_samples[0]
                           else False)
        if len(text_prompts) == 1:
            prompts = [self._prompt(text_prompts[0], custom_entities, enhanced_text_prompts[0],
                                    tokens_positives[0])] * len(batch_data_samples)
        else:
            prompts = [self._prompt(text_prompt, custom_entities, enhanced, tokens_positive)
                       for text_prompt, enhanced, tokens_positive in zip(text_prompts, enhanced_text_prompts,
                                                                         tokens_positives)]
        token_positive_maps, captions, _, entities = zip(*prompts)
        if isinstance(captions[0], list):
            return None
        is_rec_tasks = []
        for sample, token_positive_map in zip(batch_data_samples, token_positive_maps):
            is_rec_tasks.append(token_positive_map is None)
            sample.token_positive_map = token_positive_map
        return Prepared(self._text(tuple(captions), device), (entities, is_rec_tasks))

    # -- the prompt's positive maps ---------------------------------------------------------------------------------
    def _prompt(self, text, custom_entities, enhanced_text_prompt, tokens_positive) -> tuple:
        detector = self.detector
        key = None
        if enhanced_text_prompt is None and tokens_positive is None:
            key = _prompt_key(text, custom_entities, detector.test_cfg.get("chunked_size", -1))
        if key is None:
            return detector.get_tokens_positive_and_prompts(text, custom_entities, enhanced_text_prompt,
                                                            tokens_positive)
        return _kept(self.prompts, key, lambda: detector.get_tokens_positive_and_prompts(text, custom_entities))

    # -- the text tensors -------------------------------------------------------------------------------------------
    def _text(self, captions: tuple, device: torch.device) -> Dict[str, torch.Tensor]:
        device = torch.device(device)
        key = (captions, device, torch.is_autocast_enabled(device.type), torch.get_autocast_dtype(device.type),
               self._weights_signature())
        return _kept(self.texts, key, lambda: self._text_tensors(captions, device))

    def _weights_signature(self) -> tuple:
        modules = [self.detector.language_model] + ([self.detector.text_feat_map]
                                                    if self.detector.text_feat_map is not None else [])
        tensors = itertools.chain.from_iterable(itertools.chain(module.parameters(), module.buffers())
                                                for module in modules)
        return tuple((tensor.data_ptr(), tensor._version) for tensor in tensors)

    def _text_tensors(self, captions: Sequence[str], device: torch.device) -> Dict[str, torch.Tensor]:
        """mmdet 3.3.0's ``language_model(captions)`` and ``text_feat_map``, as the region's text inputs."""
        detector = self.detector
        language = detector.language_model
        if _stock_bert_with_sub_sentences(language):
            text = host_text_inputs(language, list(captions), device)
            text_dict = language.language_backbone({name: text[name] for name in (
                "input_ids", "attention_mask", "position_ids", "token_type_ids")})
            text_dict.update(position_ids=text["position_ids"], text_token_mask=text["text_token_mask"])
        else:
            text_dict = language(list(captions))
        if detector.text_feat_map is not None:
            text_dict["embedded"] = detector.text_feat_map(text_dict["embedded"])
        return dict(memory_text=text_dict["embedded"], text_token_mask=text_dict["text_token_mask"],
                    position_ids=text_dict["position_ids"], text_self_attention_masks=text_dict["masks"])


def _prompt_key(text, custom_entities, chunked_size) -> Optional[Hashable]:
    """A key equal only for prompts that give the same positive maps, caption and entities; None for prompts of
    other types (prepared anew)."""
    if isinstance(text, str):
        return (text, bool(custom_entities), chunked_size)
    if isinstance(text, (list, tuple)) and all(isinstance(name, str) for name in text):
        # mmdet treats a list and a tuple of names alike.
        return (("names",) + tuple(text), bool(custom_entities), chunked_size)
    return None


def _kept(store: OrderedDict, key: Hashable, make):
    value = store.get(key)
    if value is None:
        value = store[key] = make()
        while len(store) > PROMPTS_KEPT:
            store.popitem(last=False)
    else:
        store.move_to_end(key)
    return value


def grounding_region(detector, batch_inputs, image_sizes, memory_text, text_token_mask, position_ids,
                     text_self_attention_masks):
    """mmdet 3.3.0's ``extract_feat`` and ``forward_transformer`` (with the padding masks made from ``image_sizes``,
    as for the other DETRs) and the head's forward: ``(all_cls_scores, all_bbox_preds)``."""
    img_feats = detector.extract_feat(batch_inputs)
    encoder_inputs, decoder_inputs = deformable_detr_pre_transformer_from_image_sizes(
        detector, img_feats, image_sizes, batch_inputs.shape[-2], batch_inputs.shape[-1])
    text_dict = dict(embedded=memory_text, text_token_mask=text_token_mask, position_ids=position_ids,
                     masks=text_self_attention_masks)
    encoder_outputs = detector.forward_encoder(**encoder_inputs, text_dict=text_dict)
    head_inputs = detr_decoder(detector, encoder_outputs, decoder_inputs)
    return detector.bbox_head(head_inputs["hidden_states"], head_inputs["references"], head_inputs["memory_text"],
                              head_inputs["text_token_mask"])


def grounding_postprocess(detector, outs, batch_data_samples, rescale, context):
    """The tail of mmdet 3.3.0's ``GroundingDINOHead.predict`` and ``GroundingDINO.predict`` (see the module)."""
    entities, is_rec_tasks = context
    batch_img_metas = [sample.metainfo for sample in batch_data_samples]
    results_list = detector.bbox_head.predict_by_feat(
        *outs, batch_img_metas=batch_img_metas,
        batch_token_positive_maps=[sample.token_positive_map for sample in batch_data_samples], rescale=rescale)
    for data_sample, pred_instances, entity, is_rec_task in zip(batch_data_samples, results_list, entities,
                                                               is_rec_tasks):
        if len(pred_instances) > 0:
            label_names = []
            for label in pred_instances.labels.tolist():
                if is_rec_task:
                    label_names.append(entity)
                    continue
                if label >= len(entity):
                    warnings.warn("The unexpected output indicates an issue with named entity recognition. You can "
                                  "try setting custom_entities=True and running again to see if it helps.")
                    label_names.append("unobject")
                else:
                    label_names.append(entity[label])
            pred_instances.label_names = label_names
        data_sample.pred_instances = pred_instances
    return batch_data_samples
