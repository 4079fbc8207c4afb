"""The MiniLM encoder against transformers' BertModel on the same weights, and its basic semantics."""

from __future__ import annotations

import numpy as np
import torch

from tokenops.embeddings import DIMENSIONS, bundled_model_dir, mean_pool

TEXTS = [
    "How do I reset my password?",
    "What is the procedure for resetting my password?",
    "The stock market fell sharply on Tuesday.",
    "a",
    "Ünïcödé text, with punctuation!!! and    spaces",
]


def test_matches_transformers_bert(embedder):
    from transformers import BertModel

    ref_model = BertModel.from_pretrained(str(bundled_model_dir()), add_pooling_layer=False).eval()
    ids, mask = embedder.tokenize(TEXTS)
    with torch.no_grad():
        hidden = ref_model(input_ids=ids, attention_mask=mask).last_hidden_state
    ref = mean_pool(hidden, mask)
    ours = torch.from_numpy(embedder.embed(TEXTS))
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-4)
    # batching and padding do not change a row: each text alone gives the same vector
    alone = np.stack([embedder.embed([t])[0] for t in TEXTS])
    np.testing.assert_allclose(alone, ours.numpy(), atol=1e-5)


def test_tokenizer_matches_hf(embedder):
    from transformers import BertTokenizerFast

    hf = BertTokenizerFast.from_pretrained(str(bundled_model_dir()))
    ids, _ = embedder.tokenize(TEXTS[:1])
    assert ids[0].tolist() == hf(TEXTS[0])["input_ids"]


def test_unit_vectors_and_shapes(embedder):
    v = embedder.embed(TEXTS)
    assert v.shape == (len(TEXTS), DIMENSIONS) and v.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(v, axis=1), 1.0, atol=1e-5)
    assert embedder.embed([]).shape == (0, DIMENSIONS)


def test_paraphrases_score_higher_than_unrelated(embedder):
    v = embedder.embed(TEXTS[:3])
    para, unrelated = float(v[0] @ v[1]), float(v[0] @ v[2])
    assert para > 0.8 > 0.3 > unrelated


def test_token_count_flags_truncation(embedder):
    assert embedder.token_count("hello world") == 4  # [CLS] hello world [SEP]
    assert embedder.token_count("word " * 400) is None
