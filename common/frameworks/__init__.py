"""Frameworks: glue that keeps our loaders exact under a training framework, one module each,
imported only when used (`import recipes` imports no framework): Lightning (`lightning_glue`: a
`LightningDataModule` whose checkpoint resumes a `make_loader` loader mid-epoch, also where
Lightning drops loader states), Hugging Face Accelerate (`accelerate_glue`: a prepared loader kept
as it is, its state in `save_state`), and the transformers `Trainer` (`hf_trainer_glue`: a callback
that resumes the loader instead of skipping batches).

May import: `loading`, `resume`, `sampling`, `loader_warning`.
"""
