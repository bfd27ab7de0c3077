"""``--mock-data`` stays inside the tokenizer's vocabulary on every megatron-core release (0.15 did not)."""
import types

import numpy

from megatron.core.datasets.gpt_dataset import MockGPTLowLevelDataset


def test_mock_documents_use_only_ids_of_the_vocabulary():
    tokenizer = types.SimpleNamespace(vocab_size=128, eod=0)
    dataset = MockGPTLowLevelDataset(tokenizer)
    documents = [dataset[index] for index in range(64)]
    longest = max(documents, key=len)
    assert len(longest) > 128, "the documents must be long enough to pass the vocabulary size"
    for document in documents:
        assert document.max() < tokenizer.vocab_size and document[-1] == tokenizer.eod
        body = document[:-1]
        assert numpy.array_equal(body, (numpy.arange(len(body)) + 1) % tokenizer.vocab_size)
    assert numpy.array_equal(dataset.get(7, offset=3, length=5), documents[7][3:8])
