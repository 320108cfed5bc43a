"""The tokenizers fork hazard: parallelism used in the parent, then forked workers tokenize."""

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import os
    import torch
    from recipes.common import make_loader
    from recipes.testing import make_text_corpus, train_tokenizer

    texts = make_text_corpus(400, seed=1)
    tok = train_tokenizer(texts, vocab_size=500)
    tok.backend_tokenizer.encode_batch(texts)  # the Rust thread pool runs in the parent

    class Tokenizing(torch.utils.data.Dataset):
        def __len__(self):
            return len(texts)
        def __getitem__(self, i):
            n = len(tok.backend_tokenizer.encode_batch([texts[i], texts[-i]])[0].ids)
            return torch.tensor([n, os.environ.get("TOKENIZERS_PARALLELISM") == "false"])

    loader = make_loader(Tokenizing(), profile="text", num_workers=2, batch_size=50,
                         multiprocessing_context="fork", timeout=60)
    batches = list(loader)
    off = all(bool(b[:, 1].all()) for b in batches)
    print("tokenized", len(batches), "parallelism off in workers:", off)
""")


@pytest.mark.slow  # 8 s
def test_forked_workers_tokenize_after_the_parent_used_parallelism():
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=180
    )
    assert out.returncode == 0, out.stderr[-3000:]
    # completed (no deadlock), and worker_init switched tokenizers parallelism off in the workers
    assert "tokenized 8 parallelism off in workers: True" in out.stdout
