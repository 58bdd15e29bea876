"""``python -m hp_megatron.selfcheck --backend ascendc|triton|eager``; see hp_megatron/selfcheck/__init__.py."""
import sys

from hp_megatron.selfcheck.cli import main

if __name__ == "__main__":
    sys.exit(main())
