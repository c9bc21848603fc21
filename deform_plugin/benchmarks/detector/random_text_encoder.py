"""A random text encoder of BERT-base's shape for Grounding-DINO, built without any download: for timing only.

mmdet's Grounding-DINO builds its language model (``mmdet.models.language_models.BertModel``) with
``from_pretrained('bert-base-uncased')``: the tokenizer's vocabulary, the config and 440 MB of weights come from the
Hugging Face hub. A benchmark or a test on a machine without them gets :class:`RandomBertForTiming` instead (config
type ``'RandomBertForTiming'``):

Two modules: this one writes the vocabulary and edits configs (it imports neither mmdet nor transformers), and
:mod:`.random_text_encoder_model` defines and registers the model classes when a config's ``custom_imports`` names
it.

- a ``transformers.BertModel`` built from a ``BertConfig`` of bert-base-uncased's shape (12 layers, hidden size 768,
  12 heads, FFN 3072, vocabulary 30522), its weights drawn by Hugging Face's own initialisation;
- a ``BertTokenizerFast`` over a WordPiece vocabulary written at run time (:func:`write_wordpiece_vocab`): BERT's
  special tokens, punctuation, every character as a word start and as a ``##`` continuation (so any lowercase ASCII
  text tokenizes without ``[UNK]``), then the words of the class names whole.

Everything else is mmdet's: the forward (tokenization, the sub-sentence masks, the embedded layers) is mmdet's
``BertModel.forward``, and the state-dict keys are mmdet's, so a checkpoint of the real model loads into it. Its
outputs mean nothing: detections and losses of a model that uses it are no measure of accuracy. The work per step is
the real model's but for the token counts, which follow the generated vocabulary (each class-name word one token;
bert-base-uncased splits a few rare words into two or three).

Both live beside the benchmarks so that stock rows (processes that never import deform_plugin itself, see
:mod:`deform_plugin.benchmarks.stock_process`) can import the model module through ``custom_imports`` as well.
"""
from __future__ import annotations

import hashlib
import os
import re
import string
import tempfile
from pathlib import Path
from typing import Iterable, Optional, Sequence

RANDOM_TEXT_ENCODER = "RandomBertForTiming"
TIMING_ONLY_LABEL = "random text encoder, for timing only"
# The module that registers the class (imported through a config's custom_imports); this one only edits configs.
MODULE = "deform_plugin.benchmarks.detector.random_text_encoder_model"
# bert-base-uncased's config.json, the sizes that set the work per step.
BERT_BASE_SHAPE = dict(vocab_size=30522, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                       intermediate_size=3072, hidden_act="gelu", max_position_embeddings=512, type_vocab_size=2,
                       layer_norm_eps=1e-12, pad_token_id=0)
SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
# mmdet's language_model arguments that RandomBertForTiming takes as they are (``name`` picks hub files: dropped).
PASSED_ON = ("max_tokens", "pad_to_max", "use_sub_sentence_represent", "special_tokens_list", "add_pooling_layer",
             "num_layers_of_embedded", "use_checkpoint")
TEXT_ENCODER_CHOICES = ("auto", "real", "random")

__all__ = ["BERT_BASE_SHAPE", "RANDOM_TEXT_ENCODER", "TEXT_ENCODER_CHOICES", "TIMING_ONLY_LABEL",
           "hub_files_cached", "language_model_config", "random_text_encoder_config", "random_text_encoder_override",
           "use_random_text_encoder",
           "write_wordpiece_vocab"]


def vocabulary(words: Iterable[str] = ()) -> list:
    """The generated WordPiece vocabulary, in id order: special tokens, single characters, their ``##``
    continuations, then each distinct lowercased word of ``words`` (split at spaces and punctuation)."""
    characters = string.ascii_lowercase + string.digits + string.punctuation
    tokens = list(SPECIAL_TOKENS) + list(characters) + [f"##{c}" for c in string.ascii_lowercase + string.digits]
    seen = set(tokens)
    for text in words:
        for word in re.findall(r"[a-z0-9]+", str(text).lower()):
            if word not in seen:
                seen.add(word)
                tokens.append(word)
    return tokens


def write_wordpiece_vocab(words: Iterable[str] = (), directory: Optional[os.PathLike] = None) -> Path:
    """Write :func:`vocabulary` (``words``) as a ``vocab.txt`` and return its path.

    The file lands in ``directory``, else in a folder of the temporary directory named by the vocabulary's hash (so
    repeated builds share one file, and another vocabulary never reads a stale one); it is written to a temporary
    name and renamed, so processes building at once never read half a file.
    """
    text = "\n".join(vocabulary(words)) + "\n"
    if directory is None:
        digest = hashlib.sha256(text.encode()).hexdigest()[:16]
        directory = Path(tempfile.gettempdir()) / f"deform_plugin-wordpiece-{digest}"
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "vocab.txt"
    if not path.is_file() or path.read_text() != text:
        handle, partial = tempfile.mkstemp(dir=directory, prefix="vocab.", suffix=".partial")
        with os.fdopen(handle, "w") as file:
            file.write(text)
        os.replace(partial, path)
    return path


def language_model_config(cfg) -> Optional[dict]:
    """The ``model.language_model`` of an mmengine config (or a plain dict of one), or None."""
    model = cfg.get("model") or {}
    language_model = model.get("language_model")
    return language_model if isinstance(language_model, dict) else None


def hub_files_cached(name: str) -> bool:
    """Whether the weights mmdet's ``BertModel`` loads for ``name`` are on this machine: a local folder, or the
    Hugging Face cache (asked without the network)."""
    if Path(name).is_dir():
        return True
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return False
    found = [try_to_load_from_cache(repo_id=name, filename=filename)
             for filename in ("config.json", "vocab.txt")]
    weights = [try_to_load_from_cache(repo_id=name, filename=filename)
               for filename in ("model.safetensors", "pytorch_model.bin")]
    return all(isinstance(path, str) for path in found) and any(isinstance(path, str) for path in weights)


def random_text_encoder_config(language_model: dict, vocab_words: Sequence[str] = (),
                               shape: Optional[dict] = None) -> dict:
    """The ``language_model`` config of :class:`RandomBertForTiming` standing in for mmdet's ``BertModel``
    config ``language_model`` (its tokenization and embedding options kept, its hub name dropped)."""
    if language_model.get("type") not in ("BertModel", "mmdet.BertModel", RANDOM_TEXT_ENCODER):
        raise ValueError(f"the random text encoder stands in for mmdet's BertModel, not {language_model.get('type')!r}")
    replacement = dict(type=RANDOM_TEXT_ENCODER, vocab_words=list(vocab_words))
    replacement.update({key: language_model[key] for key in PASSED_ON if key in language_model})
    if shape:
        replacement["shape"] = dict(shape)
    return replacement


def dataset_class_names(cfg) -> list:
    """The class names a config's training set prompts with: its ``metainfo.classes``, else COCO's (``CocoDataset``)."""
    dataset = (cfg.get("train_dataloader") or {}).get("dataset") or {}
    classes = (dataset.get("metainfo") or {}).get("classes")
    if classes:
        return list(classes)
    from mmdet.datasets import CocoDataset
    return list(CocoDataset.METAINFO["classes"])


def random_text_encoder_override(cfg, choice: str = "auto", shape: Optional[dict] = None) -> Optional[dict]:
    """The ``language_model`` config that stands in for the config's BERT under ``choice``, or None to keep it.

    ``choice``: ``'random'`` always; ``'real'`` never; ``'auto'`` where the real weights are not on this machine
    (:func:`hub_files_cached`). Configs without a BERT ``language_model`` keep theirs (None), except that
    ``'random'`` refuses them.
    """
    if choice not in TEXT_ENCODER_CHOICES:
        raise ValueError(f"text encoder choice {choice!r} is not one of {', '.join(TEXT_ENCODER_CHOICES)}")
    language_model = language_model_config(cfg)
    is_bert = language_model is not None and language_model.get("type") in ("BertModel", "mmdet.BertModel")
    if choice == "random" and not is_bert:
        raise ValueError("--text-encoder random: the config has no mmdet BertModel language_model to replace")
    if not is_bert or choice == "real":
        return None
    if choice == "auto" and hub_files_cached(language_model.get("name", "bert-base-uncased")):
        return None
    return random_text_encoder_config(language_model, dataset_class_names(cfg), shape)


def use_random_text_encoder(cfg, choice: str = "auto", shape: Optional[dict] = None) -> bool:
    """Put :class:`RandomBertForTiming` in place of the config's BERT (in place) where
    :func:`random_text_encoder_override` says so; returns whether it did. The config's ``custom_imports`` gain
    this module, which registers the class."""
    replacement = random_text_encoder_override(cfg, choice, shape)
    if replacement is None:
        return False
    cfg["model"]["language_model"] = replacement
    imports = dict(cfg.get("custom_imports") or dict(imports=[], allow_failed_imports=False))
    names = imports.get("imports", [])
    names = [names] if isinstance(names, str) else list(names)
    if MODULE not in names:
        imports["imports"] = names + [MODULE]
    cfg["custom_imports"] = imports
    return True
