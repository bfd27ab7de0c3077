"""megatron-core 0.15's mock GPT data inside the vocabulary, as 0.16 and later keep it.

``MockGPTLowLevelDataset`` (``--mock-data``) makes every document ``1, 2, ..., length - 1, eod`` with lengths
up to 4095, whatever the tokenizer's vocabulary; 0.16 takes the ids modulo the vocabulary size. With a
vocabulary under 4096 tokens (``--vocab-size 128`` of a tiny test model) 0.15 looks up embedding rows that
do not exist: an IndexError on the CPU, a device-side assert on CUDA. This backports 0.16's rule.
"""
from __future__ import annotations

import functools

import numpy


def wrap_getitem(original):
    @functools.wraps(original)
    def __getitem__(self, idx):
        sample = original(self, idx)
        return numpy.concatenate([sample[:-1] % self.tokenizer.vocab_size, sample[-1:]])

    return __getitem__


def patches():
    from ascendspeed.patching import wrap

    return [wrap("megatron.core.datasets.gpt_dataset:MockGPTLowLevelDataset.__getitem__", wrap_getitem,
                 expect="(self, idx)", megatron="<0.16",
                 name="mock data: token ids modulo the vocabulary size (megatron-core 0.16's rule)")]
