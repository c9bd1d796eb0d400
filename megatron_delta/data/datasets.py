"""GPT datasets for Megatron-Core: blends of indexed prefixes (--data-path / --train-data-path ...), splits,
and the checks that name the flag before Megatron-Core's builder fails deep inside.
"""
from __future__ import annotations

import os
import re
from typing import Callable, Optional

from megatron_delta.data.indexed import _PREPROCESS_HINT, validate_indexed_prefix


# =============================================================================== datasets
def _flatten_paths(paths) -> Optional[list[str]]:
    if paths is None:
        return None
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    out: list[str] = []
    for p in paths:
        if isinstance(p, (list, tuple)):
            out.extend(str(q) for q in p)
        else:
            out.append(str(p))
    return out or None


def _parse_blend(paths, flag: str):
    """Megatron-LM's blend list -> (prefixes, weights|None), every prefix validated."""
    from megatron.core.datasets.utils import get_blend_from_list

    paths = _flatten_paths(paths)
    if not paths:
        return None
    numeric = []
    for p in paths:
        try:
            float(p)
            numeric.append(True)
        except ValueError:
            numeric.append(False)
    if len(paths) % 2 == 0 and any(numeric):
        if numeric[0::2] != [True] * (len(paths) // 2) or any(numeric[1::2]):
            raise ValueError(f"{flag}: {' '.join(paths)}: expected 'PREFIX [PREFIX ...]' or "
                             f"'WEIGHT PREFIX [WEIGHT PREFIX ...]'")
    elif any(numeric):
        raise ValueError(f"{flag}: {' '.join(paths)}: a weighted blend needs a weight before "
                         f"every prefix ('WEIGHT PREFIX [WEIGHT PREFIX ...]')")
    prefixes, weights = get_blend_from_list(paths)
    if weights is not None and (any(w < 0 for w in weights) or sum(weights) <= 0):
        raise ValueError(f"{flag}: blend weights must be non-negative with a positive sum "
                         f"(got {weights})")
    for p in prefixes:
        validate_indexed_prefix(p, flag)
    return list(prefixes), (list(weights) if weights is not None else None)


def _check_split(split: str) -> str:
    s = "" if split is None else str(split).strip()
    parts = re.split(r"[,/]", s) if s else []
    try:
        vals = [float(x) for x in parts]
    except ValueError:
        vals = None
    if not vals or len(vals) > 3 or any(v < 0 for v in vals) or sum(vals) <= 0:
        raise ValueError(f"--split: {split!r} is not valid; expected up to three comma-separated "
                         f"non-negative weights for train,valid,test with a positive sum, "
                         f"e.g. '969,30,1' or '90,10,0'")
    return ",".join(parts)


def _check_splits_have_documents(blend, split_matrix, sizes, split_arg):
    """Megatron loops forever building samples from a split with no documents: refuse it first."""
    for i, name in enumerate(("train", "valid", "test")):
        if sizes[i] == 0 or split_matrix[i] is None:
            continue
        for prefix in blend[0]:
            n = validate_indexed_prefix(prefix)
            # The same rounding as Megatron's BlendedMegatronDatasetBuilder.
            docs = int(round(split_matrix[i][1] * n)) - int(round(split_matrix[i][0] * n))
            if docs == 0:
                raise ValueError(f"--split {split_arg}: the {name} split of {prefix} ({n} documents) gets no "
                                 f"document; give it a larger share or use more data")


def build_gpt_datasets(data_path, split: str, seq_length: int, seed: int,
                       num_samples: tuple[int, int, int], tokenizer, mock: bool = False,
                       cache_dir: Optional[str] = None, valid_data_path=None, test_data_path=None,
                       is_built_on_rank: Optional[Callable[[], bool]] = None,
                       **gpt_config_kwargs):
    """(train, valid, test) Megatron GPT datasets via BlendedMegatronDatasetBuilder.

    data_path: Megatron-LM's --data-path list: ["prefA"] or ["0.3", "prefA", "0.7", "prefB"]
      (prefixes of .bin/.idx pairs). Split into train/valid/test by `split` ("969,30,1").
    valid_data_path / test_data_path (optional, same format): use these for valid/test instead; then
      data_path is entirely train (blend_per_split; `split` is ignored) and a split without a path
      is None.
    mock: MockGPTDataset (no data needed; use with NullTokenizer).
    num_samples: samples per split (Megatron builds whole epochs, so len(ds) >= this); 0 for a
      split -> None returned for it (so is a split without data, e.g. weight 0 in `split`).
    cache_dir: where the sample indices are cached. Without torch.distributed initialised and with a
      blend of several prefixes, Megatron's BlendedDataset cannot use a cache (it queries the rank),
      so then no cache path is passed and GPTDataset caches next to the data (<prefix>/cache/);
      with torch.distributed initialised (pretrain_gpt.py) cache_dir is used as given. Every rank
      must call this function (Megatron builds on rank 0, barrier, then the other ranks).
    is_built_on_rank: Megatron's predicate (default: every rank builds).
    gpt_config_kwargs: passed to GPTDatasetConfig (e.g. eod_mask_loss=True,
      create_attention_mask=False); defaults: reset_position_ids/reset_attention_mask/eod_mask_loss
      False.
    Each sample is a dict of torch tensors: tokens and labels (seq_length each, from seq_length+1
    consecutive tokens), loss_mask, position_ids and (unless create_attention_mask=False)
    attention_mask.
    """
    import torch
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset

    if not isinstance(seq_length, int) or seq_length <= 0:
        raise ValueError(f"--seq-length: must be a positive integer (got {seq_length!r})")
    sizes = [int(x) for x in num_samples]
    if len(sizes) != 3 or any(x < 0 for x in sizes):
        raise ValueError(f"num_samples: expected three non-negative sample counts (train, valid, "
                         f"test), got {num_samples!r}")
    if tokenizer is None:
        raise ValueError("tokenizer: required (build_tokenizer(...))")

    blend = blend_per_split = None
    split_arg: Optional[str] = None
    if mock:
        split_arg = _check_split(split or "969,30,1")
    elif valid_data_path is not None or test_data_path is not None:
        blend_per_split = [_parse_blend(data_path, "--data-path"),
                           _parse_blend(valid_data_path, "--valid-data-path"),
                           _parse_blend(test_data_path, "--test-data-path")]
        if blend_per_split[0] is None:
            raise ValueError("--data-path: required (training data prefixes); "
                             f"{_PREPROCESS_HINT}, or use mock data")
    else:
        split_arg = _check_split(split)
        blend = _parse_blend(data_path, "--data-path")
        if blend is None:
            raise ValueError(f"--data-path: no data path given; {_PREPROCESS_HINT}, "
                             f"or use mock data (--mock-data)")

    dist = torch.distributed.is_available() and torch.distributed.is_initialized()
    path_to_cache = cache_dir
    blends = [blend] if blend is not None else [b for b in (blend_per_split or []) if b]
    if not dist and any(len(b[0]) > 1 for b in blends):
        path_to_cache = None      # BlendedDataset + cache path calls torch.distributed.get_rank()
    if path_to_cache:
        os.makedirs(path_to_cache, exist_ok=True)

    cfg = dict(reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False)
    cfg.update(gpt_config_kwargs)
    config = GPTDatasetConfig(
        random_seed=int(seed), sequence_length=seq_length, blend=blend,
        blend_per_split=blend_per_split, split=split_arg, path_to_cache=path_to_cache,
        tokenizer=tokenizer, **cfg)
    if mock:
        assert config.mock
    cls = MockGPTDataset if mock else GPTDataset
    if blend is not None and config.split_matrix is not None:
        # Megatron builds every split with a positive --split weight, even one asked for 0 samples,
        # and loops forever on a split without documents: do not build the splits nobody reads.
        # (split_matrix holds absolute bounds, so the other splits keep exactly their documents.)
        config.split_matrix = [None if n == 0 else bounds for n, bounds in zip(sizes, config.split_matrix)]
        _check_splits_have_documents(blend, config.split_matrix, sizes, split_arg)
    try:
        datasets = BlendedMegatronDatasetBuilder(
            cls, sizes, is_built_on_rank or (lambda: True), config).build()
    except IndexError as e:
        raise ValueError(f"num_samples {tuple(sizes)}: Megatron could not draw the requested "
                         f"samples from --data-path ({e})") from e
    return tuple(None if n == 0 else ds for n, ds in zip(sizes, datasets))
