"""A third-party mixer that declares nothing beyond training on one CP rank: ``P`` (``toy_plain``), the toy EMA's
class (tests/support/toy_mixer.py) registered with ``MixerSupport()``'s defaults (no context parallelism, no packed
sequences, no decode, no MTP, eager only), as an author who wrote only a training forward would register it.

Every entry point must refuse what it does not declare before building a model (tests/integration/
test_mixer_support.py): ``--context-parallel-size 2`` in the example, generation from a checkpoint of it.
"""
from __future__ import annotations

from hp_megatron.registry import MixerEntry, MixerSupport, register_mixer
from tests.support.toy_mixer import toy_spec

PLAIN = register_mixer(MixerEntry(
    symbol="P", name="toy_plain", title="plain toy", spec=toy_spec, module="tests.support.toy_mixer:ToyEMAMixer",
    family="toy", supports=MixerSupport()))
