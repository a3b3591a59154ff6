"""A budgeted tier over a plain dict: the device and host tiers of the tests' small stores."""
from tierkv.storage.base import Tier


class DictTier(Tier):
    def __init__(self, name, budget):
        super().__init__(budget)
        self.name = name
        self._data = {}

    def _store(self, key, block):
        self._data[key] = block
        return block.nbytes

    def _load(self, key):
        return self._data[key]

    def _drop(self, key):
        del self._data[key]
