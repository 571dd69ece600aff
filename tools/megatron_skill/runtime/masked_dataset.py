"""Megatron's GPTDataset with a per-token loss mask stored beside the tokens.

prepare-data's chat format writes PREFIX.bin / .idx (the conversations' tokens, packed as any
pretraining corpus: documents end with the end-of-document token and sequences run across them)
and PREFIX_lossmask.bin / .idx, an indexed dataset of the same document lengths holding 1 on
the tokens the model must learn (the assistant's replies) and 0 on the rest (system and user
turns, the template's markup). A sample's mask is read through GPTDataset's own sample index,
so it covers exactly the sample's tokens; the loss of label j counts when token j + 1 is 1.
Without a mask file beside a prefix the dataset is GPTDataset itself.
"""
from __future__ import annotations

from pathlib import Path

import numpy
import torch
from megatron.core.datasets.gpt_dataset import GPTDataset
from megatron.core.datasets.indexed_dataset import IndexedDataset

from ..data.datasets import MASK_SUFFIX


class MaskedGPTDataset(GPTDataset):
    def __init__(self, dataset, dataset_path, indices, num_samples, index_split, config) -> None:
        super().__init__(dataset, dataset_path, indices, num_samples, index_split, config)
        self.loss_mask_dataset = None
        if dataset_path and Path(dataset_path + MASK_SUFFIX + ".idx").is_file():
            masks = IndexedDataset(dataset_path + MASK_SUFFIX, mmap=config.mmap_bin_files)
            if not numpy.array_equal(masks.sequence_lengths, dataset.sequence_lengths):
                raise ValueError(f"{dataset_path}{MASK_SUFFIX} does not match {dataset_path} document by document: "
                                 "make both with prepare-data again")
            self.loss_mask_dataset = masks

    def __getitem__(self, idx):
        item = super().__getitem__(idx)
        if self.loss_mask_dataset is None:
            return item
        tokens = self.dataset
        self.dataset = self.loss_mask_dataset  # the same sample index, read from the mask file
        try:
            mask, _, _ = self._query_document_sample_shuffle_indices(0 if idx is None else idx)
        finally:
            self.dataset = tokens
        learn = mask[1:] if self.config.add_extra_token_to_sequence else numpy.append(mask[1:], 0)
        item["loss_mask"] = item["loss_mask"] * torch.from_numpy((learn == 1).astype(numpy.float32))
        return item
