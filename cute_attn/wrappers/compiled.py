"""``torch.compile`` support: the wrappers' ``run()`` and the single-request functions as custom
ops, so that dynamo never traces into ctypes, numpy or the CUDA-graph guards of the eager path.

* :func:`compilable_run` decorates a wrapper's ``run(self, q, ..., *args, out=None, lse=None,
  return_lse=False, **kw)``.  Outside compilation it calls the method (one
  ``torch.compiler.is_compiling()`` check).  While dynamo traces it, it allocates ``out`` /
  ``lse`` where not given (``out`` like ``q``, or of the plan's ``head_dim_vo``; ``lse`` float32
  ``q.shape[:2]``: ``[rows, heads]`` for the batch wrappers, ``[heads, M]`` for
  ``VariableBlockSparseAttentionWrapper`` whose q is ``[heads, M, d]``), flattens every tensor
  argument (q, the KV cache as a tuple or one tensor, the variant's runtime tensors, sinks,
  scales) into a list and the rest into a JSON descriptor,
  and calls the one op ``cute_attn::wrapper_run(handle, out, lse, tensors, call)``
  (``mutates_args=("out", "lse")``; its fake impl does nothing).  Its real impl finds the
  wrapper by ``handle`` (its id(), a weak registry filled when the wrapper is first traced) and calls
  the undecorated ``run`` eagerly with ``out`` / ``lse`` given.  The return value is built
  outside the op: ``out`` or ``(out, lse)``.

* ``plan()`` is not compiled and must not be called inside a compiled region: engines call it
  eagerly between steps (as with FlashInfer).  A compiled region keeps working across plans:
  its guards see only the wrapper's identity, never the plan.

* ``torch.compile(mode="reduce-overhead")`` (CUDA-graph trees) records the op's eager launch:
  that needs a wrapper created with ``use_cuda_graph=True`` (and its fixed index buffers), as
  with FlashInfer -- a plain wrapper's run() refuses to be captured.  Let the compiled function
  allocate ``out`` / ``lse`` (an ``out=`` passed in is a mutated graph input, for which inductor
  skips CUDA graphs); mark a persistent KV cache with ``torch._dynamo.mark_static_address`` (or
  hold it as a module buffer) so that replays do not copy it into the graph's static inputs.

* ``single_decode_with_kv_cache`` / ``single_prefill_with_kv_cache``: the ops
  ``cute_attn::single_decode`` / ``cute_attn::single_prefill`` (q, k, v, the optional tensors,
  the scalar options; the rest -- variant, its runtime arguments, ignored FlashInfer arguments --
  as a tensor list and a JSON descriptor) return ``(out, lse)``; their fake impls compute shapes
  and dtypes.  :func:`compiled_single_decode` / :func:`compiled_single_prefill` have the public
  signatures and dispatch to the ops while compiling (else to the eager functions of
  ``single``).  The ops' real impls keep one planned batch wrapper (``use_cuda_graph=True``,
  buffers of exactly the request's sizes) per key (device, dtype, shapes, options) and skip
  ``plan()`` when the key was planned before, so a captured launch replays on a plan that stays
  in its own workspace.  A wrapper that ran under capture is kept for the process
  (:func:`clear_single_cache` drops them all); others are evicted beyond
  ``MAX_UNPINNED_SINGLE`` keys.  A custom mask is re-planned on every eager call and baked at
  capture (replays read the mask of the last eager call of that key).

Non-tensor arguments of a compiled call are constants of the graph (JSON); a variant object
given to the single functions is held by handle (a strong registry).
"""

from __future__ import annotations

import functools
import gc
import itertools
import json
import weakref
from typing import Callable, List

import torch

__all__ = ["compilable_run"]

# ---- registries -------------------------------------------------------------------------------
# A wrapper's handle is its id(): dynamo makes id(wrapper) a constant of the graph and guards on
# the wrapper's identity (ID_MATCH), so a graph only runs while that very wrapper is alive and
# passed.  The registry maps handles to wrappers weakly; it is filled at trace time (by a scan of
# the gc's objects, off the hot path: a function dynamo runs as a constant may only take
# constants) and, for a handle it lacks at run time (a wrapper made again at a reused address),
# by the same scan once.
_IDS = itertools.count(1)
_WRAPPERS: weakref.WeakValueDictionary[int, object] = weakref.WeakValueDictionary()  # id -> wrapper
_OBJECTS: dict = {}  # id -> object (variants): held, a compiled graph may outlive the caller's reference
_RUNS: dict = {}  # id of a decorated function -> the undecorated function


def _find_object(obj_id: int):
    """The live gc-tracked object whose id() is ``obj_id``, or None."""
    for o in gc.get_objects():
        if id(o) == obj_id:
            return o
    return None


def _register_wrapper(obj_id: int) -> bool:
    w = _WRAPPERS.get(obj_id)
    if w is None:
        w = _find_object(obj_id)
        if w is None:
            return False
        _WRAPPERS[obj_id] = w
    return True


@torch.compiler.assume_constant_result
def _wrapper_handle(obj_id: int) -> int:
    """Register the wrapper of id ``obj_id`` at trace time; returns the handle (its id)."""
    if not _register_wrapper(obj_id):
        raise RuntimeError(f"cute_attn: no live wrapper with id {obj_id} (is it gc-tracked?)")
    return obj_id


@torch.compiler.assume_constant_result
def _object_handle(obj_id: int) -> int:
    """Hold the non-tensor, non-JSON argument (a variant) of id ``obj_id``; returns the handle."""
    if obj_id not in _OBJECTS:
        o = _find_object(obj_id)
        if o is None:
            raise TypeError(
                f"cute_attn: a compiled call's argument (id {obj_id}) is neither JSON, a tensor nor gc-tracked"
            )
        _OBJECTS[obj_id] = o
    return obj_id


@torch.compiler.assume_constant_result
def _encode(spec) -> str:
    """The descriptor (constants only) as JSON, evaluated at trace time (dynamo cannot trace json)."""
    return json.dumps(spec, separators=(",", ":"))


@functools.lru_cache(maxsize=4096)
def _parse(call: str):
    """A descriptor, parsed once per distinct string (the graph's constants; read-only)."""
    return json.loads(call)


def _lookup_wrapper(handle: int):
    w = _WRAPPERS.get(handle)
    if w is None and _register_wrapper(handle):
        w = _WRAPPERS.get(handle)
    if w is None:
        raise RuntimeError(
            f"cute_attn: the wrapper of a compiled run() (handle {handle}) no longer exists; keep the wrapper "
            "alive as long as the compiled function that uses it"
        )
    return w


# ---- argument flattening ----------------------------------------------------------------------
# A node is a JSON scalar (None, bool, int, float, str) or a tagged list: ["T", i] (tensors[i]),
# ["tuple", [nodes]], ["list", [nodes]], ["dict", [[key, node], ...]], ["dtype", name],
# ["device", str], ["O", handle] (an object of the registry).
_SCALARS = (bool, int, float, str)


def _flat(x, tensors: list):
    """``x`` as a node, its tensors appended to ``tensors`` (runs under dynamo)."""
    if x is None:
        return None
    if isinstance(x, torch.Tensor):
        tensors.append(x)
        return ["T", len(tensors) - 1]
    if isinstance(x, _SCALARS):
        return x
    if isinstance(x, tuple):
        return ["tuple", [_flat(y, tensors) for y in x]]
    if isinstance(x, list):
        return ["list", [_flat(y, tensors) for y in x]]
    if isinstance(x, dict):
        return ["dict", [[str(k), _flat(v, tensors)] for k, v in x.items()]]
    if isinstance(x, torch.dtype):
        return ["dtype", str(x).replace("torch.", "")]
    if isinstance(x, torch.device):
        return ["device", str(x)]
    return ["O", _object_handle(id(x))]


def _unflat(node, tensors):
    """The inverse of :func:`_flat` (runs eagerly)."""
    if not isinstance(node, list):
        return node
    tag, val = node
    if tag == "T":
        return tensors[val]
    if tag == "tuple":
        return tuple(_unflat(y, tensors) for y in val)
    if tag == "list":
        return [_unflat(y, tensors) for y in val]
    if tag == "dict":
        return {k: _unflat(v, tensors) for k, v in val}
    if tag == "dtype":
        return getattr(torch, val)
    if tag == "device":
        return torch.device(val)
    if tag == "O":
        return _OBJECTS[val]
    raise ValueError(f"cute_attn: bad compiled-call descriptor node {node!r}")


# ---- wrapper run() ------------------------------------------------------------------------------
@torch.library.custom_op("cute_attn::wrapper_run", mutates_args=("out", "lse"))
def _wrapper_run_op(handle: int, out: torch.Tensor, lse: torch.Tensor, tensors: List[torch.Tensor], call: str) -> None:
    """A wrapper's run() eagerly: the wrapper by ``handle``, ``call`` = JSON [run id, positional
    nodes after q, keyword nodes]; q is ``tensors[0]``; writes ``out`` / ``lse``."""
    wrapper = _lookup_wrapper(handle)
    run_id, arg_nodes, kw_nodes = _parse(call)
    fn = _RUNS[run_id]
    args = [_unflat(a, tensors) for a in arg_nodes]
    kw = {k: _unflat(v, tensors) for k, v in kw_nodes.items()}
    o, s = fn(wrapper, tensors[0], *args, out=out, lse=lse, return_lse=True, **kw)
    if o is not out:  # every wrapper writes the given out / lse; should one not, copy
        out.copy_(o)
    if s is not lse:
        lse.copy_(s)


@_wrapper_run_op.register_fake
def _wrapper_run_fake(handle, out, lse, tensors, call) -> None:
    return None


def _compiled_run(run_id: int, self, q: torch.Tensor, args: tuple, kw: dict):
    """The traced side of a decorated run(): allocate, flatten, one op, build the return."""
    kw = dict(kw)
    out = kw.pop("out", None)
    lse = kw.pop("lse", None)
    return_lse = kw.pop("return_lse", False)
    if out is None:
        d_out = getattr(self, "_out_dim", None)  # an int set by plan(): head_dim_vo where it is not q's
        out = torch.empty_like(q) if d_out is None else q.new_empty((*q.shape[:-1], d_out))
    if lse is None:
        lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    tensors = [q]
    arg_nodes = [_flat(a, tensors) for a in args]
    kw_nodes = {k: _flat(v, tensors) for k, v in kw.items()}
    call = _encode([run_id, arg_nodes, kw_nodes])
    torch.ops.cute_attn.wrapper_run(_wrapper_handle(id(self)), out, lse, tensors, call)
    return (out, lse) if return_lse else out


def compilable_run(fn: Callable) -> Callable:
    """Decorate a wrapper's ``run(self, q, ..., *args, out=None, lse=None, return_lse=False,
    **kw)`` for ``torch.compile`` (fullgraph and reduce-overhead; see the module doc).  Eager
    calls go straight to ``fn``; the undecorated method stays as ``__wrapped__``."""
    if getattr(fn, "_cute_attn_compilable", False):
        return fn
    run_id = next(_IDS)
    _RUNS[run_id] = fn

    @functools.wraps(fn)
    def run(self, q, *args, **kw):
        if not torch.compiler.is_compiling():
            return fn(self, q, *args, **kw)
        return _compiled_run(run_id, self, q, args, kw)

    run._cute_attn_compilable = True
    return run
