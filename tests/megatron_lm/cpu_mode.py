"""CPU/gloo mode of Megatron-LM's training loop (test infrastructure, never imported by the library).

Megatron-LM's ``megatron/training`` asserts CUDA and allocates on ``'cuda'`` in a fixed set of places. This
module redirects exactly those call sites to CPU, no other caller:

* :data:`SITES` lists each one as ``(file, line, call, text)``: the file under ``megatron/``, the line, the
  call that is redirected there and a piece of that source line; one table per supported Megatron-LM release,
  keyed by the (major, minor) of the megatron-core it pairs with (:func:`sites`: the installed one's).
  :func:`check_sites` reads every listed line from the installed megatron-core and the Megatron-LM tree and
  raises when the text is not there, so a Megatron-LM or megatron-core upgrade that moved a site fails before
  training starts, naming it.
* The redirected callables (``torch.cuda.*``, factories with ``device='cuda'``, ``Tensor.cuda``,
  ``Tensor.type``, ``Module.cuda`` and three start-up functions) look at their caller: a listed site gets the
  CPU behaviour and is recorded; any other caller gets the original callable. A call from ``megatron/`` that
  is not listed and fails on CPU raises ``RuntimeError`` naming the site; one that is not listed but is served
  by ``hp_megatron.platform``'s shims is recorded as unlisted.
* ``torch.cuda.current_device`` / ``synchronize`` / ``current_stream``, the RNG tracker, the schedules' token
  counter and the CP slice of rotary tables come from ``hp_megatron.platform.apply_cpu_training_shims`` (reused,
  wrapped here only to record their megatron callers).

:func:`install` applies all of it right before ``megatron.training`` executes (and no-ops
``_warmup_jit_function`` once ``megatron.training.initialize`` has executed) through ``import_hook``;
``tests/megatron_lm/site/sitecustomize.py`` calls it in every Python process started with that folder on
``PYTHONPATH``. With ``HP_MEGATRON_LM_SITES_DIR`` set, each process writes the sites it reached to
``$HP_MEGATRON_LM_SITES_DIR/sites-<pid>.json`` at exit (``{"reached": [...], "unlisted": [...],
"discovered": [...]}``). For finding the sites of a new release: with ``HP_MEGATRON_LM_DISCOVER_SITES=1`` an
unlisted megatron call that fails on CPU gets the CPU behaviour and is recorded as discovered instead of raising
(calls that do not raise on CPU but whose result is wrong there, ``torch.cuda.is_available`` / ``device_count``,
are found by reading the code). Never set in the tests.
"""
from __future__ import annotations

import atexit
import contextlib
import json
import os
import sys

from import_hook import run_after, run_before

# (file under megatron/ or an entry script, line, redirected call, text on that line). Megatron-LM tag core_v0.16.1 over
# megatron-core 0.16.1. The comment says what the CPU side does.
SITES_016 = (
    # start-up: the CUDA assert, one device per rank (model-parallel groups and seeds are set up only then), the
    # dataset-helper build (`make` in site-packages), fused kernels, JIT warm-up
    ("megatron/training/initialize.py", 62, "torch.cuda.is_available", "assert torch.cuda.is_available()"),
    ("megatron/training/initialize.py", 319, "torch.cuda.device_count", "torch.cuda.device_count()"),
    ("megatron/training/initialize.py", 331, "torch.cuda.set_device", "torch.cuda.set_device(args.local_rank)"),
    ("megatron/training/initialize.py", 422, "torch.cuda.device_count", "torch.cuda.device_count() > 0"),
    ("megatron/training/initialize.py", 192, "compile_helpers", "compile_helpers()"),
    ("megatron/training/initialize.py", 224, "fused_kernels.load", "fused_kernels.load(args)"),
    ("megatron/training/initialize.py", 228, "fused_kernels.load", "fused_kernels.load(args)"),
    ("megatron/training/initialize.py", 460, "_warmup_jit_function", "_warmup_jit_function()"),
    # model set-up: .cuda() of the model, the DDP side stream
    ("megatron/training/training.py", 1258, "Module.cuda", "model_module.cuda(torch.cuda.current_device())"),
    ("megatron/training/training.py", 1258, "torch.cuda.current_device", "torch.cuda.current_device()"),
    ("megatron/training/training.py", 1325, "torch.cuda.Stream", "torch.cuda.Stream()"),
    ("megatron/training/training.py", 1327, "torch.cuda.current_stream", "torch.cuda.current_stream()"),
    ("megatron/training/training.py", 1329, "torch.cuda.stream", "torch.cuda.stream(ddp_stream)"),
    ("megatron/training/training.py", 1344, "torch.cuda.current_stream", "torch.cuda.current_stream()"),
    # small tensors of the training and evaluation loops
    ("megatron/training/training.py", 812, "torch.tensor", "device='cuda'"),
    ("megatron/training/training.py", 1816, "torch.tensor", "device='cuda'"),
    ("megatron/training/training.py", 2072, "torch.tensor", "device='cuda'"),
    ("megatron/training/training.py", 3112, "Tensor.cuda", ").cuda()"),
    ("megatron/training/training.py", 3405, "torch.tensor", "flags = torch.tensor("),
    ("megatron/training/utils.py", 253, "torch.cuda.current_device", "torch.cuda.current_device()"),
    ("megatron/training/utils.py", 272, "torch.cuda.current_device", "torch.cuda.current_device()"),
    ("megatron/training/utils.py", 448, "torch.cuda.get_device_properties", "torch.cuda.get_device_properties("),
    ("megatron/training/utils.py", 534, "Tensor.cuda", 'data["tokens"].cuda('),
    ("megatron/training/utils.py", 535, "Tensor.cuda", 'data["labels"].cuda('),
    ("megatron/training/utils.py", 536, "Tensor.cuda", 'data["loss_mask"].cuda('),
    ("megatron/training/utils.py", 540, "Tensor.cuda", 'data["attention_mask"].cuda('),
    ("megatron/training/utils.py", 542, "Tensor.cuda", 'data["position_ids"].cuda('),
    ("megatron/training/utils.py", 561, "torch.cuda.current_device", "torch.cuda.current_device()"),
    ("megatron/training/utils.py", 605, "torch.cuda.current_device", "torch.cuda.current_device()"),
    # batches of TP ranks > 0 (get_batch_on_this_tp_rank receives them)
    ("megatron/training/utils.py", 634, "torch.cuda.current_device", "torch.cuda.current_device()"),
    ("megatron/training/utils.py", 639, "torch.cuda.current_device", "torch.cuda.current_device()"),
    ("megatron/training/utils.py", 644, "torch.cuda.current_device", "torch.cuda.current_device()"),
    ("megatron/training/utils.py", 651, "torch.cuda.current_device", "torch.cuda.current_device()"),
    ("megatron/training/utils.py", 658, "torch.cuda.current_device", "torch.cuda.current_device()"),
    ("megatron/training/utils.py", 683, "torch.cuda.current_device", "torch.cuda.current_device()"),
    ("megatron/training/utils.py", 731, "torch.cuda.current_device", "torch.cuda.current_device()"),
    ("megatron/training/checkpointing.py", 315, "torch.tensor", "device='cuda'"),  # loading
    ("megatron/training/checkpointing.py", 343, "torch.cuda.get_rng_state", "torch.cuda.get_rng_state()"),
    # megatron-core: timers, grad buffers, optimizer, gradient clipping, checkpoint saving
    ("megatron/core/timers.py", 152, "torch.cuda.synchronize", "torch.cuda.synchronize()"),
    ("megatron/core/timers.py", 165, "torch.cuda.synchronize", "torch.cuda.synchronize()"),
    ("megatron/core/timers.py", 303, "torch.cuda.current_device", "torch.cuda.current_device()"),
    ("megatron/core/utils.py", 1207, "torch.tensor", 'device="cuda"'),
    ("megatron/core/distributed/param_and_grad_buffer.py", 800, "torch.cuda.current_device",
     "torch.cuda.current_device()"),
    ("megatron/core/distributed/param_and_grad_buffer.py", 806, "torch.cuda.current_device",
     "torch.cuda.current_device()"),
    ("megatron/core/optimizer/optimizer.py", 481, "torch.tensor", "device='cuda'"),  # fp32/fp16 only
    ("megatron/core/optimizer/optimizer.py", 485, "torch.tensor", "device='cuda'"),
    ("megatron/core/optimizer/distrib_optimizer.py", 361, "Tensor.type", "model_param.type() in"),
    ("megatron/core/optimizer/distrib_optimizer.py", 420, "Tensor.type", "model_param.type() =="),  # fp32
    ("megatron/core/optimizer/distrib_optimizer.py", 582, "Tensor.type", "param.type() in"),
    ("megatron/core/optimizer/clip_grads.py", 103, "torch.zeros", "device='cuda'"),
    ("megatron/core/optimizer/clip_grads.py", 167, "Tensor.type", "param.grad.type() =="),
    ("megatron/core/optimizer/clip_grads.py", 174, "torch.zeros", "device='cuda'"),
    ("megatron/core/dist_checkpointing/strategies/filesystem_async.py", 230, "torch.cuda.synchronize",
     "torch.cuda.synchronize()"),
    ("megatron/core/dist_checkpointing/strategies/state_dict_saver.py", 252, "torch.cuda.current_device",
     "torch.cuda.current_device()"),
    # megatron-core model code under TP/SP and RoPE
    ("megatron/core/tensor_parallel/mappings.py", 91, "torch.cuda.current_device", "torch.cuda.current_device()"),
    ("megatron/core/tensor_parallel/mappings.py", 141, "torch.cuda.current_device", "torch.cuda.current_device()"),
    ("megatron/core/tensor_parallel/mappings.py", 181, "torch.cuda.current_device", "torch.cuda.current_device()"),
    ("megatron/core/tensor_parallel/layers.py", 552, "torch.cuda.current_device", "torch.cuda.current_device()"),
    ("megatron/core/utils.py", 631, "torch.cuda.current_device", "torch.cuda.current_device()"),
    ("megatron/core/models/common/embeddings/rotary_pos_embedding.py", 162, "torch.cuda.current_device",
     "torch.cuda.current_device()"),
    # served by hp_megatron.platform's module-level torch of the schedules (not seen by the recorder)
    ("megatron/core/pipeline_parallel/schedules.py", 596, "platform:schedules.torch", 'device="cuda"'),
)

# Megatron-LM tag core_v0.19.0 over megatron-core 0.19.2.
SITES_019 = (
    # start-up: the CUDA assert, one device per rank (model-parallel groups and seeds are set up only then), the
    # dataset-helper build, JIT warm-up
    ("megatron/training/initialize.py", 66, "torch.cuda.is_available", "assert torch.cuda.is_available()"),
    ("megatron/training/initialize.py", 270, "torch.cuda.device_count", "torch.cuda.device_count()"),
    ("megatron/training/initialize.py", 282, "torch.cuda.set_device", "torch.cuda.set_device(args.local_rank)"),
    ("megatron/training/initialize.py", 447, "torch.cuda.device_count", "torch.cuda.device_count() > 0"),
    ("megatron/training/initialize.py", 178, "compile_helpers", "compile_helpers()"),
    ("megatron/training/initialize.py", 494, "_warmup_jit_function", "_warmup_jit_function(tp_size=tp_size)"),
    # model set-up: the DDP side stream (megatron/training/models: 0.19's model builders)
    ("megatron/training/models/dist_utils.py", 303, "torch.cuda.Stream", "ddp_stream = torch.cuda.Stream()"),
    ("megatron/training/models/dist_utils.py", 304, "torch.cuda.current_stream", "torch.cuda.current_stream()"),
    ("megatron/training/models/dist_utils.py", 306, "torch.cuda.stream", "torch.cuda.stream(ddp_stream)"),
    ("megatron/training/models/dist_utils.py", 366, "torch.cuda.current_stream", "torch.cuda.current_stream()"),
    # small tensors of the training loop
    ("megatron/training/training.py", 1131, "torch.tensor", "device='cuda'"),  # the entry scripts' start time
    ("megatron/training/training.py", 1137, "torch.tensor", "device='cuda'"),
    ("megatron/training/training.py", 2613, "torch.tensor", "device='cuda'"),
    ("megatron/training/training.py", 2884, "torch.tensor", "device='cuda'"),
    ("megatron/training/training.py", 4270, "torch.tensor", "device='cuda'"),
    ("megatron/training/training.py", 4587, "torch.tensor", "flags = torch.tensor("),
    ("megatron/training/utils/common_utils.py", 285, "torch.cuda.current_device", "torch.cuda.current_device()"),
    ("megatron/training/utils/common_utils.py", 308, "torch.cuda.current_device", "torch.cuda.current_device()"),
    ("megatron/training/utils/common_utils.py", 504, "torch.cuda.get_device_properties",
     "torch.cuda.get_device_properties("),
    # the batch of TP rank 0 (Megatron-LM 0.19's entry scripts move it to the device)
    ("pretrain_gpt.py", 128, "Tensor.cuda", "batch[key].cuda(non_blocking=True)"),
    ("pretrain_hybrid.py", 128, "Tensor.cuda", "batch[key].cuda(non_blocking=True)"),
    # batches of TP ranks > 0 (megatron-core's get_batch_on_this_tp_rank receives them)
    ("megatron/core/utils.py", 2275, "torch.cuda.current_device", "torch.cuda.current_device()"),
    ("megatron/core/utils.py", 2276, "torch.cuda.current_device", "torch.cuda.current_device()"),
    ("megatron/core/utils.py", 2277, "torch.cuda.current_device", "torch.cuda.current_device()"),
    ("megatron/core/utils.py", 2278, "torch.cuda.current_device", "torch.cuda.current_device()"),
    ("megatron/core/utils.py", 2293, "torch.cuda.current_device", "torch.cuda.current_device()"),
    ("megatron/training/checkpointing.py", 375, "torch.tensor", "device='cuda'"),  # loading
    ("megatron/training/checkpointing.py", 417, "torch.cuda.get_rng_state", "torch.cuda.get_rng_state()"),
    # megatron-core: timers, grad buffers, optimizer, gradient clipping
    ("megatron/core/timers.py", 152, "torch.cuda.synchronize", "torch.cuda.synchronize()"),
    ("megatron/core/timers.py", 165, "torch.cuda.synchronize", "torch.cuda.synchronize()"),
    ("megatron/core/timers.py", 303, "torch.cuda.current_device", "torch.cuda.current_device()"),
    ("megatron/core/utils.py", 1332, "torch.tensor", 'device="cuda"'),
    ("megatron/core/distributed/param_and_grad_buffer.py", 632, "torch.cuda.current_stream",
     "torch.cuda.current_stream()"),
    ("megatron/core/distributed/param_and_grad_buffer.py", 1180, "torch.cuda.current_device",
     "torch.cuda.current_device()"),
    ("megatron/core/distributed/param_and_grad_buffer.py", 1186, "torch.cuda.current_device",
     "torch.cuda.current_device()"),
    ("megatron/core/optimizer/optimizer.py", 315, "torch.tensor", "device='cuda'"),
    ("megatron/core/optimizer/optimizer.py", 698, "torch.tensor", "device='cuda'"),  # fp32/fp16 only
    ("megatron/core/optimizer/optimizer.py", 702, "torch.tensor", "device='cuda'"),
    ("megatron/core/optimizer/distrib_optimizer.py", 401, "Tensor.type", "model_param.type() in"),
    ("megatron/core/optimizer/distrib_optimizer.py", 466, "Tensor.type", "model_param.type() =="),  # fp32
    ("megatron/core/optimizer/distrib_optimizer.py", 758, "Tensor.type", "param.type() in"),
    ("megatron/core/optimizer/clip_grads.py", 108, "torch.zeros", "device='cuda'"),
    ("megatron/core/optimizer/clip_grads.py", 112, "torch.zeros", "device='cuda'"),
    ("megatron/core/optimizer/clip_grads.py", 174, "Tensor.type", "param.grad.type() =="),
    ("megatron/core/optimizer/clip_grads.py", 180, "torch.zeros", "device='cuda'"),
    ("megatron/core/dist_checkpointing/strategies/filesystem_async.py", 248, "torch.cuda.synchronize",
     "torch.cuda.synchronize()"),
    ("megatron/core/dist_checkpointing/strategies/state_dict_saver.py", 252, "torch.cuda.current_device",
     "torch.cuda.current_device()"),
    # megatron-core model code under TP/SP and RoPE
    ("megatron/core/tensor_parallel/mappings.py", 95, "torch.cuda.current_device", "torch.cuda.current_device()"),
    ("megatron/core/tensor_parallel/mappings.py", 145, "torch.cuda.current_device", "torch.cuda.current_device()"),
    ("megatron/core/tensor_parallel/mappings.py", 185, "torch.cuda.current_device", "torch.cuda.current_device()"),
    ("megatron/core/tensor_parallel/layers.py", 647, "torch.cuda.current_device", "torch.cuda.current_device()"),
    ("megatron/core/utils.py", 715, "torch.cuda.current_device", "torch.cuda.current_device()"),
    ("megatron/core/models/common/embeddings/rotary_pos_embedding.py", 162, "torch.cuda.current_device",
     "torch.cuda.current_device()"),
    # pipeline stages (pretrain_hybrid.py at PP2): the p2p receive buffers and the batched-p2p sync
    ("megatron/core/pipeline_parallel/p2p_communication.py", 334, "torch.cuda.current_device",
     "torch.cuda.current_device()"),
    ("megatron/core/pipeline_parallel/p2p_communication.py", 342, "torch.cuda.current_device",
     "torch.cuda.current_device()"),
    ("megatron/core/pipeline_parallel/p2p_communication.py", 419, "torch.cuda.synchronize", "torch.cuda.synchronize()"),
    # served by hp_megatron.platform's module-level torch of the schedules (not seen by the recorder)
    ("megatron/core/pipeline_parallel/schedules.py", 749, "platform:schedules.torch", 'device="cuda"'),
)

# reached by MoE models only (the 2026 families from --hp-hf-config: tests/megatron_lm/test_megatron_lm_hf_config.py;
# SITES_019 is what tests/megatron_lm/test_megatron_lm_019.py's dense runs reach, every entry)
SITES_019_MOE = (
    ("megatron/training/initialize.py", 131, "torch.cuda.current_device", "torch.cuda.current_device()"),
    ("megatron/core/transformer/moe/router.py", 98, "torch.cuda.current_device", "torch.cuda.current_device()"),
    ("megatron/core/transformer/moe/router.py", 184, "torch.cuda.current_device", "torch.cuda.current_device()"),
    ("megatron/core/transformer/moe/router.py", 193, "torch.cuda.current_device", "torch.cuda.current_device()"),
)

SITES = {(0, 16): SITES_016, (0, 19): SITES_019 + SITES_019_MOE}  # by the (major, minor) of megatron-core
DISCOVER = "HP_MEGATRON_LM_DISCOVER_SITES"

_LISTED: set = set()
_reached: set = set()
_unlisted: set = set()
_discovered: set = set()


def sites() -> tuple:
    """The site table of the installed megatron-core (imports it); RuntimeError naming the versions with one."""
    from megatron.core.package_info import MAJOR, MINOR

    if (MAJOR, MINOR) not in SITES:
        known = ", ".join("%d.%d" % key for key in SITES)
        raise RuntimeError(f"tests/megatron_lm/cpu_mode.py has no CUDA-site table for megatron-core {MAJOR}.{MINOR} "
                           f"(tables: {known}); find its sites (HP_MEGATRON_LM_DISCOVER_SITES=1) and add one")
    return SITES[(MAJOR, MINOR)]


def megatron_file(rel_path: str) -> str:
    """The installed file of ``megatron/<...>`` (megatron-core or the Megatron-LM tree) or of an entry script of the
    Megatron-LM tree (``pretrain_gpt.py``), without importing it."""
    import megatron  # namespace package over site-packages' megatron-core and the Megatron-LM checkout

    for root in megatron.__path__:
        candidate = os.path.join(os.path.dirname(root), rel_path)
        if os.path.isfile(candidate):
            return candidate
    raise RuntimeError(f"{rel_path} not found under megatron.__path__={list(megatron.__path__)}; is the "
                       "Megatron-LM checkout (MEGATRON_LM_PATH) on PYTHONPATH?")


def check_sites() -> None:
    """Raise ``RuntimeError`` listing every site of :data:`SITES` whose line no longer holds its text."""
    moved, lines = [], {}
    for path, line, call, text in sites():
        if path not in lines:
            with open(megatron_file(path), encoding="utf-8") as f:
                lines[path] = f.read().splitlines()
        found = lines[path][line - 1] if line <= len(lines[path]) else "<past the end of the file>"
        if text not in found:
            moved.append(f"{path}:{line} {call}: expected {text!r}, found {found.strip()!r}")
    if moved:
        raise RuntimeError("Megatron-LM/megatron-core changed; these CUDA call sites of tests/megatron_lm/"
                           "cpu_mode.py.SITES moved (find them again and update SITES):\n  " + "\n  ".join(moved))


# Megatron-LM's entry scripts (top level of the checkout; 0.19 moves the batch's .cuda() into them)
ENTRY_SCRIPTS = ("pretrain_gpt.py", "pretrain_hybrid.py")


def _caller(depth: int = 2) -> str | None:
    """``megatron/<...>.py:<line>`` (or ``pretrain_*.py:<line>`` of :data:`ENTRY_SCRIPTS`) of the frame ``depth``
    levels up, or None outside megatron's packages and those scripts."""
    frame = sys._getframe(depth)
    path = frame.f_code.co_filename
    cut = path.rfind(os.sep + "megatron" + os.sep)
    if cut < 0:
        name = os.path.basename(path)
        is_entry = name in ENTRY_SCRIPTS and os.path.isdir(os.path.join(os.path.dirname(path), "megatron"))
        return f"{name}:{frame.f_lineno}" if is_entry else None
    return f"{path[cut + 1:]}:{frame.f_lineno}"


def _redirect(call: str, original, on_cpu, depth: int = 2):
    """``original`` for every caller but the listed sites of ``call``, which get ``on_cpu``; ``depth``: frames
    from the returned function up to megatron's caller."""
    def redirected(*args, **kwargs):
        site = _caller(depth)
        if site is not None and (site, call) in _LISTED:
            _reached.add(f"{site} {call}")
            return on_cpu(*args, **kwargs)
        try:
            return original(*args, **kwargs)
        except (RuntimeError, AssertionError) as err:
            if site is None:
                raise
            if os.environ.get(DISCOVER) == "1":
                _discovered.add(f"{site} {call}")
                return on_cpu(*args, **kwargs)
            raise RuntimeError(f"{call} at {site} fails on CPU and is not in tests/megatron_lm/cpu_mode.py.SITES "
                               "(a new CUDA call site of Megatron-LM?)") from err
    redirected.__wrapped__ = original
    return redirected


def _recorded(call: str, shimmed):
    """``shimmed`` (hp_megatron.platform's CPU version) for everyone; megatron callers are recorded."""
    def recorded(*args, **kwargs):
        site = _caller()
        if site is not None:
            (_reached if (site, call) in _LISTED else _unlisted).add(f"{site} {call}")
        return shimmed(*args, **kwargs)
    recorded.__wrapped__ = shimmed
    return recorded


def _cuda_device(kwargs) -> bool:
    device = kwargs.get("device")
    return device is not None and str(device).startswith("cuda")


def _factory(call: str, original):
    """A factory that allocates on CPU where a listed site asks for ``device='cuda'``."""
    def on_cpu(*args, **kwargs):
        return original(*args, **{**kwargs, "device": "cpu"})

    redirect = _redirect(call, original, on_cpu, depth=3)

    def factory(*args, **kwargs):
        if not _cuda_device(kwargs):
            return original(*args, **kwargs)
        return redirect(*args, **kwargs)
    factory.__wrapped__ = original
    return factory


def _redirected_class(call: str, original, on_cpu):
    """A class standing in for the class ``original`` whose construction is :func:`_redirect`'s (a listed site gets
    ``on_cpu()``, any other caller ``original(...)``); a class, so annotations such as ``torch.cuda.Stream | None``
    (transformers' modules, imported with FLA) still evaluate."""
    redirect = _redirect(call, original, on_cpu, depth=3)
    return type(original.__name__, (), {"__new__": staticmethod(lambda cls, *a, **k: redirect(*a, **k)),
                                         "__wrapped__": original, "__doc__": original.__doc__})


class _CpuStream:
    """Stand-in for ``torch.cuda.Stream`` on CPU, where work is ordered anyway."""

    def wait_stream(self, stream):
        return None


class _DeviceProperties:
    """What ``get_device_arch_version`` reads: an architecture below Blackwell keeps Megatron-LM's checks of
    ``CUDA_DEVICE_MAX_CONNECTIONS=1`` (set by the launch scripts) for TP/CP > 1."""

    major = 9


_HOPPER = _DeviceProperties()


def _cuda_type(original):
    def cuda_type(tensor, *args, **kwargs):
        name = original(tensor, *args, **kwargs)
        return name.replace("torch.", "torch.cuda.", 1) if not args and not kwargs else name
    return cuda_type


def _noop(*args, **kwargs):
    return None


def _apply_before_training() -> None:
    """Everything but the JIT warm-up: runs right before ``megatron.training`` executes."""
    import torch

    if torch.cuda.is_available():
        raise RuntimeError("tests/megatron_lm/cpu_mode.py is on PYTHONPATH on a machine with CUDA; it is for "
                           "CPU-only runs (remove tests/megatron_lm/site from PYTHONPATH)")
    check_sites()
    table = sites()
    _LISTED.update((f"{path}:{line}", call) for path, line, call, _ in table)
    calls = {call for _, _, call, _ in table}
    from hp_megatron.platform import apply_cpu_training_shims

    apply_cpu_training_shims()
    cuda = torch.cuda
    cuda.current_device = _recorded("torch.cuda.current_device", cuda.current_device)
    cuda.synchronize = _recorded("torch.cuda.synchronize", cuda.synchronize)
    cuda.is_available = _redirect("torch.cuda.is_available", cuda.is_available, lambda: True)
    cuda.device_count = _redirect("torch.cuda.device_count", cuda.device_count, lambda: 1)  # one per rank
    cuda.set_device = _redirect("torch.cuda.set_device", cuda.set_device, _noop)
    cuda.get_device_properties = _redirect("torch.cuda.get_device_properties", cuda.get_device_properties,
                                           lambda *a, **k: _HOPPER)
    cuda.Stream = _redirected_class("torch.cuda.Stream", cuda.Stream, _CpuStream)
    cuda.current_stream = _recorded("torch.cuda.current_stream", cuda.current_stream)
    cuda.stream = _redirect("torch.cuda.stream", cuda.stream, lambda stream: contextlib.nullcontext())
    cuda.get_rng_state = _redirect("torch.cuda.get_rng_state", cuda.get_rng_state,
                                   lambda *a, **k: torch.get_rng_state())
    torch.tensor = _factory("torch.tensor", torch.tensor)
    torch.zeros = _factory("torch.zeros", torch.zeros)
    torch.Tensor.cuda = _redirect("Tensor.cuda", torch.Tensor.cuda, lambda tensor, *a, **k: tensor)
    torch.Tensor.type = _redirect("Tensor.type", torch.Tensor.type, _cuda_type(torch.Tensor.type))
    torch.nn.Module.cuda = _redirect("Module.cuda", torch.nn.Module.cuda, lambda module, *a, **k: module)

    from megatron.core.datasets import utils as dataset_utils  # the wheel ships helpers_cpp, not its Makefile

    dataset_utils.compile_helpers = _redirect("compile_helpers", dataset_utils.compile_helpers, _noop)
    if "fused_kernels.load" in calls:  # CUDA extensions (megatron/legacy: Megatron-LM before 0.17)
        from megatron.legacy import fused_kernels

        fused_kernels.load = _redirect("fused_kernels.load", fused_kernels.load, _noop)


def _apply_after_initialize(module) -> None:
    """``megatron.training.initialize`` has executed: its JIT warm-up runs fused kernels on 'cuda' tensors."""
    module._warmup_jit_function = _redirect("_warmup_jit_function", module._warmup_jit_function, _noop)


def _write_sites() -> None:
    out_dir = os.environ.get("HP_MEGATRON_LM_SITES_DIR")
    if out_dir and (_reached or _unlisted or _discovered):
        with open(os.path.join(out_dir, f"sites-{os.getpid()}.json"), "w", encoding="utf-8") as f:
            json.dump({"reached": sorted(_reached), "unlisted": sorted(_unlisted), "discovered": sorted(_discovered)},
                      f, indent=1)


def install() -> None:
    """Arm the CPU mode (cheap: imports nothing until ``megatron.training`` is imported)."""
    run_before("megatron.training", _apply_before_training)
    run_after("megatron.training.initialize", _apply_after_initialize)
    atexit.register(_write_sites)
