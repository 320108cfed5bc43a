"""Whole uint8 batches: their buffers, their collate, threads that make them, the device's work.

Lives here: `batch_buffers.py` (uint8 batches in shared memory, the heap trim), `device.py`
(`uint8_collate`, `DeviceNormalize`), `thread_batches.py` (`ImageFolderFast.read_batch`: batches
made by threads of the training process), `device_crop.py` (`DeviceCropLoader`: warm epochs
cropped on the GPU) and `gpu_decode.py` (`GpuDecode`: nvJPEG decodes of whole batches).
May import: `recipes.common`, `recipes.vision.decoding`, `recipes.vision.cache` and this room;
datasets only through their public side (`thread_batches.py` names what it reads).
"""
