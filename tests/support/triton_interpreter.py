"""Run flash-linear-attention's real Triton kernels on CPU through Triton's interpreter (tests only).

``enable()`` sets ``TRITON_INTERPRET=1`` and patches three gaps of the interpreter in triton 3.7 that FLA's
kernels hit; none changes what a kernel computes:

1. Autotuning benchmarks every config with a GPU timer; the interpreter has none. Every config gets the same
   time, so the first config of each autotune list runs (configs differ only in tiling/warps, not results).
2. A loop index ``for i in range(n)`` is a tensor in compiled Triton but a Python int in the interpreter, so
   FLA's ``i.to(tl.int64)`` fails; the loop body now starts with the interpreter's own ``to_tensor(i)``.
3. Builtins aliased in a kernel's module (FLA's ``gather = tl.gather``) escape the interpreter's patching of
   ``triton.language``; they are patched in the kernel's globals as well, and restored after each launch.
   Plus ``bf16x3`` dot precision is allowed (the interpreter multiplies in fp32, more precise than any mode).

And one for speed: the interpreter re-patches all of ``triton.language`` at every call of a ``@triton.jit`` helper
inside a kernel (about 4 ms each, a quarter of the CPU time of a layer's FLA kernels), although the kernel's launch
has patched the same modules until it returns; inside a launch a helper call now patches only its module's aliases.

FLA's KCP functions also refuse non-CUDA tensors up front (``fla.ops.cp.context._check_cp_device``, a device gate,
not a kernel limit); ``enable()`` lets CPU tensors through it, other devices still go to FLA's check.

Must run before ``fla`` is imported in the process (``triton.jit`` picks the interpreter at decoration time).
"""
from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import os
import sys

_ENABLED = False


SHIMMED_TRITON = "3.7."  # supported: triton 3.7.x, whose interpreter internals the patches below replace (CI: 3.7.1)


def available(version: str | None = None) -> str | None:
    """None when flash-linear-attention and a triton the shims support (3.7.x) are installed, else why not: the
    skip reason of every test that runs FLA's kernels on CPU. ``version``: judge this triton version instead of
    the installed one."""
    missing = [name for name in ("triton", "fla") if importlib.util.find_spec(name) is None]
    if missing and version is None:
        return f"not installed: {', '.join(missing)} (pip install 'hp-megatron[triton]')"
    version = version or importlib.metadata.version("triton")
    if not version.startswith(SHIMMED_TRITON):
        return (f"the Triton-interpreter shims of tests/support/triton_interpreter.py support triton "
                f"{SHIMMED_TRITON}x only, found triton {version} (CI's pins: .ci/run)")
    return None


class _GlobalsView:
    """Attribute access to a module's globals dict, for the interpreter's patch scope (setattr/restore)."""

    def __init__(self, namespace: dict):
        object.__setattr__(self, "_namespace", namespace)

    def __getattr__(self, name):
        try:
            return self._namespace[name]
        except KeyError:
            raise AttributeError(name) from None

    def __setattr__(self, name, value):
        self._namespace[name] = value

    def __delattr__(self, name):
        del self._namespace[name]


def enable() -> None:
    """Turn the interpreter on for this process and patch its gaps (idempotent)."""
    global _ENABLED
    if _ENABLED:
        return
    reason = available()
    if reason is not None:
        raise RuntimeError(f"triton_interpreter.enable(): {reason}")
    if "fla" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("triton_interpreter.enable() must run before flash-linear-attention is imported")
    os.environ["TRITON_INTERPRET"] = "1"
    from layers.ops.triton.runtime import default_dispatch_off

    default_dispatch_off()   # FLA is imported below: FLA's Triton kernels only, as the backend's load_fla sets it
    import triton.language as tl
    import triton.runtime.autotuner as autotuner
    import triton.runtime.interpreter as interp

    autotuner.Autotuner._bench = lambda self, *args, config, **kwargs: [0.0, 0.0, 0.0]

    def visit_For(self, node):
        self.generic_visit(node)
        if isinstance(node.target, ast.Name):
            to_tensor = ast.Attribute(value=ast.Name(id="interpreter_semantic", ctx=ast.Load()), attr="to_tensor",
                                      ctx=ast.Load())
            node.body.insert(0, ast.Assign(
                targets=[ast.Name(id=node.target.id, ctx=ast.Store())],
                value=ast.Call(func=to_tensor, args=[ast.Name(id=node.target.id, ctx=ast.Load()),
                                                     ast.Constant(value=False)], keywords=[])))
        return node

    interp.ASTTransformer.visit_For = visit_For

    original_patch_lang = interp._patch_lang
    launch = {}  # the running kernel launch: its patch scope and the language modules it patched
    aliases = {}  # id(module globals) -> names bound to triton builtins there

    def patch_aliases(namespace, scope):
        names = aliases.get(id(namespace))
        if names is None:
            names = aliases[id(namespace)] = [n for n, v in list(namespace.items()) if tl.core.is_builtin(v)]
        view = _GlobalsView(namespace)
        for name in names:
            if tl.core.is_builtin(namespace[name]):  # not yet patched in this launch
                interp._patch_attr(view, name, namespace[name], interp.interpreter_builder, scope)

    def patch_lang(fn):
        scope = original_patch_lang(fn)
        patch_aliases(fn.__globals__, scope)
        launch.update(scope=scope, langs=_langs(fn, tl))
        return scope

    interp._patch_lang = patch_lang

    def device_call(self, *args, **kwargs):
        scope = launch.get("scope")
        if scope is not None and scope._changes and _langs(self.fn, tl) <= launch["langs"]:
            patch_aliases(self.fn.__globals__, scope)  # the launch patched triton.language already
        else:  # as the interpreter does: patch for this call, left patched
            patch_aliases(self.fn.__globals__, original_patch_lang(self.fn))
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise interp.InterpreterError(repr(e)) from e

    interp.InterpretedFunction.__call__ = device_call
    precisions = tuple(interp.interpreter_builder.options.allowed_dot_input_precisions)
    interp.interpreter_builder.options = interp.InterpreterOptions(
        allowed_dot_input_precisions=precisions + ("bf16x3",))
    _allow_fla_cp_on_cpu()
    _ENABLED = True


def _langs(fn, tl) -> set:
    """ids of the triton.language modules in ``fn``'s globals (those the interpreter patches for it)."""
    return {id(v) for v in fn.__globals__.values() if v is tl or v is tl.core}


def _allow_fla_cp_on_cpu() -> None:
    import importlib

    context = importlib.import_module("fla.ops.cp.context")
    original = context._check_cp_device

    def check(device):
        if device.type != "cpu":
            original(device)

    for name in ("context", "chunk_delta_h", "chunk_merge", "chunk_bwd", "chunk_fwd"):
        module = importlib.import_module(f"fla.ops.cp.{name}")
        if getattr(module, "_check_cp_device", None) is original:
            module._check_cp_device = check
