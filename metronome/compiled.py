"""numba's on-disk cache, kept honest when compiled code calls compiled code from other modules.

numba keys a function's cached machine code on its own source file alone. The engine step
(:func:`metronome.serving.engine_step`) compiles the KV policy's residency (``metronome/kv_policy.py``) into
itself, and the simulator's loop (``sim/fastpath.py``) compiles the engine step, the step model and the jitter
ratio into itself: after any of those changes, the cached caller would go on running the old code. A marker beside
each module's cache names the form (a hash of the sources it compiles in) its cache was built from; a module whose
marker names another form has its cache dropped before anything of it is loaded.
"""

from __future__ import annotations

import hashlib
import inspect
import pickle
import sys
from pathlib import Path

import numba as nb
from numba.core import cgutils, types
from numba.extending import intrinsic


def give_llvmlite_a_dict() -> None:
    """llvmlite's library wrapper (loaded with numba) answers any attribute name with a C function, ``__dict__``
    included, so ``vars()`` of it is no dict, and code that scans every loaded module's attributes fails: vLLM
    0.32's CPU worker does (``vars(x).get("kernel")``), and an engine started in a process that loaded numba did
    not start. Its ``__dict__`` is made a real, empty one (the wrapper's own cache of looked-up names)."""
    ffi = sys.modules.get("llvmlite.binding.ffi")
    fntab = getattr(getattr(ffi, "lib", None), "_fntab", None)
    if isinstance(fntab, dict) and not isinstance(fntab.get("__dict__"), dict):  # a lookup may have cached a C one
        fntab["__dict__"] = {}


# at import: every process that loads numba through metronome, a spawned one (vLLM's engine and workers import the
# parent's main module again, and with it numba) included
give_llvmlite_a_dict()


def read_stale_indexes_as_empty() -> None:
    """numba's cache index pickles each cached function's signatures, and with them the classes of its arguments by
    module and name. An index written before such a class moved or was renamed (a record of the simulator's loop,
    say, passed to a function in a module that did not change) cannot be read back, and numba raises instead of
    compiling again: the first run after an upgrade failed. An index that cannot be read is what numba calls an
    obsolete one, and is read as empty (the function compiles and the index is written anew)."""
    from numba.core import caching

    load = caching.IndexDataCacheFile._load_index
    if getattr(load, "reads_stale_as_empty", False):
        return

    def _load_index(self):
        try:
            return load(self)
        except (AttributeError, ImportError, EOFError, pickle.UnpicklingError):
            return {}

    _load_index.reads_stale_as_empty = True
    caching.IndexDataCacheFile._load_index = _load_index


read_stale_indexes_as_empty()


def form_of(parts) -> str:
    """A hash of the sources of ``parts`` (functions or modules)."""
    return hashlib.sha256("".join(inspect.getsource(p) for p in parts).encode()).hexdigest()


def forget_other_forms(where: Path, module: str, form: str) -> bool:
    """Drop module ``module``'s cached machine code in ``where`` unless it was compiled from ``form``; mark the
    folder with ``form``. Returns whether anything was dropped."""
    mark = where / f"{module}.form.sha256"
    try:
        if mark.read_text() == form:
            return False
    except OSError:
        pass
    stale = list(where.glob(f"{module}.*.nb[ic]"))
    for f in stale:
        f.unlink(missing_ok=True)
    try:
        mark.write_text(form)
    except OSError:  # a read-only install: numba then caches elsewhere or not at all
        pass
    return bool(stale)


def guard(dispatcher, parts) -> str:
    """Guard the cache of ``dispatcher``'s module against changes in ``parts``, what it compiles in from other
    modules, and in how this module has numba index arrays (:func:`indexes_never_negative`); call it at import,
    before any of the module's compiled functions runs. Returns the form."""
    form = form_of((*parts, _index_as_given))
    try:
        where = Path(dispatcher._cache._cache_path)  # numba's cache folder for the module (not public API)
    except AttributeError:  # another numba: no guard, as numba itself has none
        return form
    forget_other_forms(where, Path(dispatcher.py_func.__code__.co_filename).stem, form)
    return form


# The modules whose compiled code indexes arrays as given (indexes_never_negative), by the prefix numba's mangled
# names of their functions begin with
_NEVER_NEGATIVE: set[str] = set()


def indexes_never_negative(module: str) -> None:
    """Declare that the compiled code of ``module`` (its functions, and what numba splices into them) never
    indexes an array with a negative integer: numba then indexes as given, without Python's wrap-around. Call it
    at import, before anything of the module is compiled; its cache is guarded by the module's own source.

    numba turns every ``a[i]`` with a signed ``i`` into ``a[i + len(a) if i < 0 else i]``. In the simulator's loop
    the indices are sessions, slots and places read from arrays, which LLVM cannot prove non-negative, and the loop
    holds a few hundred arrays, whose sizes it keeps on the stack: the wrap-around (a load, a compare and a select
    at each index) was about a fifth of the loop's time. What it costs: a negative index in such a module reads
    outside its array, as an index past the end already does (numba checks no bounds by default); with
    ``NUMBA_BOUNDSCHECK=1`` both raise IndexError (tests/test_fastpath_cache.py runs the loop so)."""
    _NEVER_NEGATIVE.add("_ZN" + "".join(f"{len(p)}{p}" for p in module.split(".")))
    _index_as_given()


def _never_negative(name: str) -> bool:
    """Whether the function of mangled name ``name`` belongs to a module declared by
    :func:`indexes_never_negative` (its prefix, then the length of the function's own name)."""
    for prefix in _NEVER_NEGATIVE:
        if name.startswith(prefix) and name[len(prefix):len(prefix) + 1].isdigit():
            return True
    return False


def _index_as_given() -> None:
    """Have numba index arrays as given in the functions of the modules :func:`indexes_never_negative` names
    (numba's ``fix_integer_index``, which its array indexing calls for each integer index; not public API: with
    a numba without it, indices wrap around as before)."""
    from numba.np import arrayobj

    wrap = getattr(arrayobj, "fix_integer_index", None)
    if wrap is None or getattr(wrap, "as_given", False):
        return

    def fix_integer_index(context, builder, idxty, idx, size):
        if idxty.signed and _never_negative(builder.function.name):
            return context.cast(builder, idx, idxty, types.intp)
        return wrap(context, builder, idxty, idx, size)

    fix_integer_index.as_given = True
    arrayobj.fix_integer_index = fix_integer_index


@intrinsic
def borrowed(typingctx, arrays):
    """The arrays of the tuple ``arrays`` (and of the tuples within it) without their reference counts (compiled
    code only): the same data, shape and strides, no owner.

    Every array a compiled function holds is reference counted with an atomic add and subtract, at each call that
    hands it on, each view and each binding; the simulator's loop hands some fifty arrays on at every step, and
    those atomics were about half its time. Arrays its caller passed in live as long as the call does, so inside
    it they need no count. Only for the arguments of the function that borrows them: an array it allocated itself,
    or one that outlives the call, must keep its owner."""

    def strip(context, builder, tys, value):
        out = []
        for ty, v in zip(tys, cgutils.unpack_tuple(builder, value)):
            if isinstance(ty, types.BaseTuple):  # (a record within the record: its arrays too)
                out.append(strip(context, builder, ty, v))
                continue
            ary = context.make_array(ty)(context, builder, value=v)
            ary.meminfo = cgutils.get_null_value(ary.meminfo.type)
            ary.parent = cgutils.get_null_value(ary.parent.type)
            out.append(ary._getvalue())
        return context.make_tuple(builder, tys, out)

    def codegen(context, builder, sig, args):
        return strip(context, builder, sig.args[0], args[0])

    return arrays(arrays), codegen


# The compiled loop's turn runs without numba's reference counting (sim/fastpath.py, _turn), and numba compiles a
# callee it first meets inside a function with that function's flags (the caller's config stack: its reference
# counting and whether it is inlined). So every compiled function the turn may reach in another module, and every one
# that allocates, is made with this (or, if it allocates nothing, with ``uncounted`` or ``inlined`` below): its flags
# are its own whichever caller compiles it first, and it is the same code in every path (with numba's cache empty
# too).
counted = nb.njit(cache=True, _nrt=True, forceinline=False)

# A function that allocates nothing and hands no array it made to anyone needs no counting at all: the arrays it
# is given outlive the call. numba counts them anyway (an increment and a decrement around each call that hands
# one on), and leaves it to its LLVM pass to prune the pairs. With numba 0.65 (LLVM 20) the pass pruned every pair
# in the engine step; with numba 0.68 (LLVM 22) it leaves about a hundred calls to NRT_incref/NRT_decref in each
# step (the scheduler's passes, the model run, the controller's row), and the simulator's loop ran a quarter
# slower. The step's parts are made with this instead: no counting, whichever numba; one that allocated would not
# compile.
uncounted = nb.njit(cache=True, _nrt=False, forceinline=False)

# ... and, for a part the loop calls at every step, compiled into its caller (LLVM's alwaysinline). numba hands each
# array to a callee as seven machine words (its owner, parent, size, item size, data, shape and stride), and the
# turn takes some eighty arrays: one call to it was ~800 moves to the stack and back, the step's parts ~3,000 in all,
# and LLVM's inliner (at numba's threshold) left these large functions as calls. Inlined, a step costs what its work
# costs. A function called from several places is compiled into each, so this is for the step's own parts, each
# called from one or two places.
inlined = nb.njit(cache=True, _nrt=False, forceinline=True)


@nb.njit(cache=True)
def hold(owner):
    """Nothing: a use of ``owner`` (arrays a compiled function allocated and then :func:`borrowed`) at the point up
    to which the borrowed arrays are used. numba releases a variable after its last use, and the borrowed copies
    do not count as one."""


def cold(dispatchers) -> bool:
    """Whether calling any of ``dispatchers`` would compile it first: numba's on-disk cache index for it is missing,
    unreadable or written from another version of its source (numba's own test of an index, nothing imported from
    the cache and nothing compiled). A CLI asks this to say that the first run compiles, before it does."""
    for d in dispatchers:
        cache_file = getattr(getattr(d, "_cache", None), "_cache_file", None)  # (numba's, not public API)
        if cache_file is None:  # not cached on disk: every process compiles it
            return True
        try:
            if not cache_file._load_index():
                return True
        except Exception:  # noqa: BLE001 (an index numba cannot read is one it recompiles)
            return True
    return False
