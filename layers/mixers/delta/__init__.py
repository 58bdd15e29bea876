"""The delta-rule mixers: ``gdn`` (GatedDeltaNet) and ``kda`` (KimiDeltaAttention) over ``mixer.DeltaMixer``, whose
concerns live apart: ``options`` (keyword > config field > default), ``params`` (parameter layout and init),
``checkpoint`` (sharded_state_dict), ``cp`` (the CP context of a forward, the layer's description for CP ``auto``)
and ``decode`` (generation caches and the decode step)."""
