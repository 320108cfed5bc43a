"""Text corpora read where they live: Parquet and JSONL objects (plain, gzip, zstd) in a folder, a
glob, on S3, HTTP or the Hugging Face Hub, planned from their footers or a first read into a small
local index, and read as a `ShardedIterableDataset` (`open_text_corpus`).

May import: `remote`, `shards`, `caches`, `workers`.
"""
