import pytest

from recipes.testing import make_text_corpus, train_tokenizer


@pytest.fixture(scope="session")
def corpus():
    texts = make_text_corpus(300, median_words=20, seed=11)
    return texts[:150] + ["", "  "] + texts[150:]  # empty and blank samples are kept


@pytest.fixture(scope="session")
def tokenizer(corpus):
    return train_tokenizer(corpus, vocab_size=600)
