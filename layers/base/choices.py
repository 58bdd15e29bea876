"""The one definition of every named choice: kernel backends, CP methods and layouts, MLA CP strategies and
rotary types.

A leaf module (no imports): ``layers.ops``, ``layers.cp``, the mixers, the specs and ``hp_megatron.arguments``
all read these tuples, so a new method or layout is added in one place.
"""

BACKENDS = ("eager", "triton", "ascendc")                     # layers.ops kernel backends
STATE_METHODS = ("p2p", "allgather", "grouped_allgather_p2p", "recursive_doubling")   # state-passing CP
CP_METHODS = ("ulysses",) + STATE_METHODS                     # every GDN/KDA CP method the engine runs
CP_METHOD_CHOICES = STATE_METHODS + ("ulysses", "auto")       # what a layer / --hp-cp-method accepts ("auto":
                                                              # layers/cp/auto.py picks one of CP_METHODS)
CP_LAYOUTS = ("zigzag", "contiguous")                         # token layouts over CP ranks
MLA_CP_STRATEGIES = ("expanded_ulysses", "latent_ulysses", "latent")
MLA_CP_STRATEGY_CHOICES = MLA_CP_STRATEGIES + ("auto",)       # what an MLA layer / --hp-mla-cp-strategy accepts
ROPE_TYPES = ("rope", "yarn", "none")                         # MLA rotary embeddings ("none": NoPE, Kimi Linear)
# our parts for megatron's --recompute-granularity selective --recompute-modules (layers/shared/recompute.py)
RECOMPUTE_MODULES = ("hp_conv", "hp_gated_norm", "hp_mla_up_proj")
