"""The DSA flag rows (``--hp-dsa-indexer-*``, megatron-core's ``dsa_indexer_*`` fields): the example's flags set the
fields; under Megatron-LM, whose own ``--dsa-indexer-*`` flags fill ``args.dsa_indexer_*``, those values stand when
our flags are not given, and ours win when they are."""
import argparse


def test_dsa_fields_from_our_flags_and_megatron_lms():
    from hp_megatron.arguments import add_hp_arguments, hp_config_from_args

    parser = add_hp_arguments(argparse.ArgumentParser(), [])
    base = ["--hp-dsa-indexer-topk", "64", "--hp-dsa-indexer-n-heads", "4", "--hp-dsa-indexer-use-sparse-loss"]
    args = parser.parse_args(base)
    args.num_attention_heads, args.hidden_size = 4, 64
    fields = hp_config_from_args(args)
    assert (fields["dsa_indexer_topk"], fields["dsa_indexer_n_heads"], fields["dsa_indexer_use_sparse_loss"],
            fields["dsa_indexer_topk_freq"], fields["dsa_indexer_loss_coeff"]) == (64, 4, True, 1, None)
    args.dsa_indexer_topk, args.dsa_indexer_loss_coeff, args.dsa_indexer_topk_freq = 2048, 0.01, 2   # Megatron-LM's
    fields = hp_config_from_args(args)
    assert (fields["dsa_indexer_topk"], fields["dsa_indexer_loss_coeff"], fields["dsa_indexer_topk_freq"]) == \
        (64, 0.01, 2)
