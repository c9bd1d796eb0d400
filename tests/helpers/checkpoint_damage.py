"""Damage done to a checkpoint on purpose, for the tests of what reads it (one copy, shared by the test modules)."""
import os


def flip_tensor_bytes(ckpt_dir: str, fqn_prefix: str) -> str:
    """Invert 16 bytes in the middle of the first tensor of torch_dist checkpoint ``ckpt_dir`` whose name starts
    with ``fqn_prefix``; the path of the shard file it lies in."""
    from torch.distributed.checkpoint import FileSystemReader

    storage = FileSystemReader(ckpt_dir).read_metadata().storage_data
    info = next(v for k, v in storage.items() if k.fqn.startswith(fqn_prefix))
    path = os.path.join(ckpt_dir, info.relative_path)
    middle = info.offset + info.length // 2
    with open(path, "r+b") as f:
        f.seek(middle)
        data = f.read(16)
        f.seek(middle)
        f.write(bytes(b ^ 0xFF for b in data))
    return path
