"""The random text encoder's model classes, registered in mmdet's ``MODELS`` when this module is imported (a config's
``custom_imports`` names it): random text encoder, for timing only. What it is and why:
:mod:`.random_text_encoder`, which also puts it into configs."""
from __future__ import annotations

from collections import OrderedDict
from typing import Optional, Sequence

from mmdet.models.language_models.bert import BertEncoder, BertModel
from mmdet.registry import MODELS
from mmengine.logging import print_log
from mmengine.model import BaseModel
from torch import nn
from transformers import BertConfig, BertTokenizerFast
from transformers import BertModel as HuggingFaceBertModel

from .random_text_encoder import (BERT_BASE_SHAPE, RANDOM_TEXT_ENCODER, TIMING_ONLY_LABEL, vocabulary,
                                  write_wordpiece_vocab)

__all__ = ["RandomBertEncoderForTiming", "RandomBertForTiming"]


@MODELS.register_module(force=True)
class RandomBertEncoderForTiming(BertEncoder):
    """mmdet's ``BertEncoder`` around a randomly initialised ``transformers.BertModel`` of ``shape``."""

    def __init__(self, shape: dict, add_pooling_layer: bool = False, num_layers_of_embedded: int = 1,
                 use_checkpoint: bool = False):
        nn.Module.__init__(self)  # mmdet's __init__ would download the weights
        config = BertConfig(**shape)
        config.gradient_checkpointing = use_checkpoint
        self.model = HuggingFaceBertModel(config, add_pooling_layer=add_pooling_layer)
        self.language_dim = config.hidden_size
        self.num_layers_of_embedded = num_layers_of_embedded


@MODELS.register_module(name=RANDOM_TEXT_ENCODER, force=True)
class RandomBertForTiming(BertModel):
    """Random text encoder, for timing only: mmdet's ``BertModel`` (same forward, same state-dict keys) on a randomly
    initialised BERT of bert-base-uncased's shape and a generated WordPiece vocabulary (see
    :mod:`.random_text_encoder`); nothing is downloaded.

    Args:
        vocab_words: texts whose words enter the vocabulary whole (the class names); any other lowercase ASCII text
            is tokenized character by character.
        shape: ``transformers.BertConfig`` fields over ``BERT_BASE_SHAPE`` (tests use tiny sizes).
        The other arguments are mmdet ``BertModel``'s.
    """

    def __init__(self, max_tokens: int = 256, pad_to_max: bool = True, use_sub_sentence_represent: bool = False,
                 special_tokens_list: Optional[Sequence[str]] = None, add_pooling_layer: bool = False,
                 num_layers_of_embedded: int = 1, use_checkpoint: bool = False, vocab_words: Sequence[str] = (),
                 shape: Optional[dict] = None, **kwargs) -> None:
        BaseModel.__init__(self, **kwargs)  # mmdet's __init__ would download the tokenizer
        self.max_tokens = max_tokens
        self.pad_to_max = pad_to_max
        self.shape = dict(BERT_BASE_SHAPE, **(shape or {}))
        tokens = len(vocabulary(vocab_words))
        if tokens > self.shape["vocab_size"]:
            raise ValueError(f"the generated vocabulary has {tokens} tokens, more than the model's vocab_size "
                             f"{self.shape['vocab_size']}")
        self.tokenizer = BertTokenizerFast(vocab_file=str(write_wordpiece_vocab(vocab_words)), do_lower_case=True)
        self.language_backbone = nn.Sequential(OrderedDict([("body", RandomBertEncoderForTiming(
            self.shape, add_pooling_layer=add_pooling_layer, num_layers_of_embedded=num_layers_of_embedded,
            use_checkpoint=use_checkpoint))]))
        self.use_sub_sentence_represent = use_sub_sentence_represent
        if use_sub_sentence_represent:
            if special_tokens_list is None:
                raise ValueError("use_sub_sentence_represent needs special_tokens_list")
            self.special_tokens = self.tokenizer.convert_tokens_to_ids(list(special_tokens_list))
        print_log(f"deform_plugin: the language model is a {TIMING_ONLY_LABEL} ({RANDOM_TEXT_ENCODER}: "
                  f"{self.shape['num_hidden_layers']} layers, hidden size {self.shape['hidden_size']}, random "
                  f"weights, a generated vocabulary of {len(self.tokenizer)} tokens); its detections and losses "
                  "measure nothing", logger="current", level=30)
