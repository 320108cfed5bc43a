"""A small `recipes bench nlp` in the default run, with conservative ratios."""

from recipes.bench.nlp import compare
from recipes.testing import make_text_corpus, train_tokenizer


def test_cache_and_bucketing_beat_tokenizing_per_item():
    texts = make_text_corpus(4000, seed=3)
    tokenizer = train_tokenizer(texts[:1500], vocab_size=2000)
    rates, rows, counters = compare(texts, tokenizer, batch_size=32, max_tokens=8192, max_length=512, workers=1)
    baseline, recipe = rows
    assert baseline.items == recipe.items  # the same real tokens went through both loaders
    assert counters[0].waste > 0.4  # random batches of long-tailed text are mostly padding
    assert counters[1].waste < 0.10  # bucketing + rounding to multiples of 8
    assert recipe.items_per_s >= 3 * baseline.items_per_s, rows
    assert rates["build_seconds"] < 3 * rates["own_seconds"] + 1.0  # building costs about one tokenizer pass
