"""Text tokenized and packed on the fly: a stream of documents (a `ShardedIterableDataset`) cut
into fixed-length rows (`row_packing.py`), resumed exactly on the same or another shape
(`stream_rest.py`), as a dataset for `make_loader` (`packed_text_stream.py`).

May import: `recipes.common`, `recipes.nlp`.
"""
