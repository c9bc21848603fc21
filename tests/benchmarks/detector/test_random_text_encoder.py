"""The random text encoder (for timing only): built without the network, of BERT-base's shape, and put in place of a
Grounding-DINO config's BERT only when asked or when the real files are missing."""
import socket

import pytest

pytest.importorskip("transformers")

import deform_plugin  # noqa: E402,F401  (mmcv stand-in where mmcv-lite is installed)
from deform_plugin.benchmarks.detector import random_text_encoder as encoder  # noqa: E402
from deform_plugin.benchmarks.detector import random_text_encoder_model  # noqa: E402,F401  (registers the model)


@pytest.fixture
def no_network(monkeypatch):
    """Hugging Face told to stay offline, and any connection attempt fails the test."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    attempts = []

    def refuse(*args, **kwargs):
        attempts.append(args)
        raise OSError("the random text encoder must not reach the network")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    return attempts


def _grounding_config():
    from mmengine.config import Config
    from small_grounding_dino import GROUNDING_DINO_CONFIG, REPO_ROOT
    return Config.fromfile(str(REPO_ROOT / GROUNDING_DINO_CONFIG), import_custom_modules=False)


def test_the_vocabulary_holds_the_class_names_whole_and_spells_anything_else(tmp_path):
    path = encoder.write_wordpiece_vocab(["traffic light", "hair drier"], tmp_path)
    tokens = path.read_text().split("\n")[:-1]
    assert tokens[:5] == list(encoder.SPECIAL_TOKENS) and {"traffic", "light", "hair", "drier"} <= set(tokens)
    assert len(tokens) == len(set(tokens))
    assert encoder.write_wordpiece_vocab(["traffic light", "hair drier"], tmp_path) == path  # rewritten in place


def test_bert_base_shape_builds_without_the_network(no_network):
    from mmdet.registry import MODELS
    model = MODELS.build(dict(type=encoder.RANDOM_TEXT_ENCODER, vocab_words=["traffic light", "zebra"],
                              special_tokens_list=["[CLS]", "[SEP]", ".", "?"], use_sub_sentence_represent=True,
                              pad_to_max=False))
    config = model.language_backbone.body.model.config
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads, config.vocab_size) == (
        12, 768, 12, 30522)
    assert model.language_backbone.body.language_dim == 768
    tokens = model.tokenizer.tokenize("traffic light. zebra. unseen words?")
    assert tokens[:4] == ["traffic", "light", ".", "zebra"] and "[UNK]" not in tokens
    assert no_network == []


def test_the_tiny_encoder_runs_mmdets_forward_offline(no_network):
    import torch
    from mmdet.registry import MODELS
    from small_grounding_dino import TINY_BERT
    model = MODELS.build(dict(type=encoder.RANDOM_TEXT_ENCODER, vocab_words=["cat", "dog"], shape=TINY_BERT,
                              special_tokens_list=["[CLS]", "[SEP]", ".", "?"], use_sub_sentence_represent=True,
                              pad_to_max=False))
    out = model(["cat. dog.", "dog."])
    assert out["embedded"].shape == (2, 6, TINY_BERT["hidden_size"])
    assert out["masks"].shape == (2, 6, 6) and out["text_token_mask"].dtype == torch.bool
    assert no_network == []


def test_config_rewrite_keeps_mmdets_options_and_imports_the_encoder():
    cfg = _grounding_config()
    assert encoder.use_random_text_encoder(cfg, "random")
    language_model = cfg.model.language_model
    assert language_model.type == encoder.RANDOM_TEXT_ENCODER and "name" not in language_model
    assert language_model.special_tokens_list == ["[CLS]", "[SEP]", ".", "?"]
    assert language_model.use_sub_sentence_represent and not language_model.pad_to_max
    assert "person" in language_model.vocab_words and len(language_model.vocab_words) == 80
    assert encoder.MODULE in cfg.custom_imports.imports and "deform_plugin" in cfg.custom_imports.imports
    assert encoder.MODULE == random_text_encoder_model.__name__


def test_auto_replaces_only_missing_weights_and_real_never(monkeypatch):
    monkeypatch.setattr(encoder, "hub_files_cached", lambda name: True)
    assert not encoder.use_random_text_encoder(_grounding_config(), "auto")
    monkeypatch.setattr(encoder, "hub_files_cached", lambda name: False)
    assert encoder.use_random_text_encoder(_grounding_config(), "auto")
    assert not encoder.use_random_text_encoder(_grounding_config(), "real")


def test_a_config_without_bert_is_refused_by_random_and_left_alone_by_auto():
    cfg = dict(model=dict(type="DINO"))
    assert not encoder.use_random_text_encoder(cfg, "auto")
    with pytest.raises(ValueError, match="no mmdet BertModel language_model"):
        encoder.use_random_text_encoder(cfg, "random")
    with pytest.raises(ValueError, match="not one of auto, real, random"):
        encoder.use_random_text_encoder(cfg, "fake")


def test_missing_hub_files_are_found_without_the_network(no_network, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path))
    assert not encoder.hub_files_cached("bert-base-uncased")
    assert encoder.hub_files_cached(str(tmp_path))  # a local folder counts
    assert no_network == []
