"""The common (non-tensor) state of a megatron-core ``torch_dist`` iteration directory, read and written where the
installed megatron-core keeps it: ``common.pt`` (0.16) or the DCP object ``COMMON_OBJECT`` (0.19, which reads
both; ``layers.base.megatron_compat.common_state_in_dcp``)."""
from __future__ import annotations

import json
import os

import torch

from hp_megatron.checkpoint.dcp_io import error_summary, object_bytes, read_object, verify_dcp_files
from hp_megatron.checkpoint.directory import COMMON_FILE, COMMON_OBJECT
from hp_megatron.checkpoint.errors import CheckpointError
from layers.base.megatron_compat import common_state_in_dcp


def read_common_state(ckpt: str) -> dict:
    """The common state of the iteration directory ``ckpt`` (``common.pt``, else the DCP object
    ``COMMON_OBJECT``); CheckpointError naming the file when neither is there or it is unreadable (truncated)."""
    path = os.path.join(ckpt, COMMON_FILE)
    if not os.path.isfile(path):
        metadata = verify_dcp_files(ckpt)
        if COMMON_OBJECT not in metadata.state_dict_metadata:
            raise CheckpointError(f"{path}: missing, and {ckpt}/.metadata has no {COMMON_OBJECT}; a megatron-core "
                                  "dist checkpoint holds its common state in one of them")
        return read_object(ckpt, COMMON_OBJECT, metadata)[0]
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as err:
        raise CheckpointError(f"{path}: unreadable ({error_summary(err)})") from err


def with_common_state(ckpt: str, common: dict, objects: dict) -> dict:
    """The DCP ``objects`` to write into the iteration directory ``ckpt`` with its common state ``common`` where
    the installed megatron-core keeps it: one more object (``COMMON_OBJECT``, 0.19) or ``ckpt/common.pt`` (0.16),
    written here with ``metadata.json`` naming the backends."""
    objects, backends = dict(objects), {"sharded_backend": "torch_dist", "sharded_backend_version": 1}
    if common_state_in_dcp():
        objects[COMMON_OBJECT] = object_bytes(common)
    else:
        torch.save(common, os.path.join(ckpt, COMMON_FILE))
        backends.update(common_backend="torch", common_backend_version=1)
    with open(os.path.join(ckpt, "metadata.json"), "w") as f:
        json.dump(backends, f)
    return objects
