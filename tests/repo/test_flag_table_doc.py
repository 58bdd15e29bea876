"""docs/usage.md's table of the ``--hp-*`` flags is the flag table (``hp_megatron.flags.markdown_table``): every
flag the parsers add is in it, with its config field, keyword, type and default."""
import argparse
import pathlib

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "usage.md"


def test_usage_doc_holds_the_generated_flag_table():
    from hp_megatron.flags import markdown_table

    assert markdown_table() in DOC.read_text(encoding="utf-8"), \
        "regenerate docs/usage.md's flag table from hp_megatron.flags.markdown_table()"


def test_every_parsed_flag_is_a_row():
    from hp_megatron.arguments import add_hp_arguments
    from hp_megatron.cp_choice import GIVEN_DEST
    from hp_megatron.flags import flag_table
    from hp_megatron.registry import MIXER_MODULE_FLAG

    parser = add_hp_arguments(argparse.ArgumentParser(add_help=False), [])
    defaults = vars(parser.parse_args([]))
    rows = {row.dest: row for row in flag_table() if row.flag is not None}
    # besides the rows: the modules flag, and the note whether --cp-comm-type was given (hp_megatron.cp_choice)
    assert set(defaults) == set(rows) | {MIXER_MODULE_FLAG[2:].replace("-", "_"), GIVEN_DEST}
    assert defaults[GIVEN_DEST] is False
    for dest, row in rows.items():
        assert defaults[dest] == (False if row.type is bool else row.default), dest
