"""The driver's two interfaces, :class:`metronome.probe.engine.DrivenEngine` and
:class:`metronome.probe.driver.AdmissionController`: they list what the driver calls, and every engine and
controller the driver is given implements all of it (the driver calls them without ``getattr`` fallbacks).
No vLLM: the engine classes are checked as classes."""

from __future__ import annotations

import ast
import inspect

import pytest

from fake_engine import FakeEngine, FakeRemoteEngine

from metronome import admission
from metronome.probe import driver, metrics, slot_engine, supervise
from metronome.probe.driver import AdmissionController, AdmitAll
from metronome.probe.engine import DrivenEngine, Engine
from metronome.probe.own_loop import OwnLoopEngine
from metronome.probe.remote import RemoteEngine

ENGINES = [Engine, RemoteEngine, OwnLoopEngine, FakeEngine, FakeRemoteEngine]
CONTROLLERS = [AdmitAll(), admission.NoAdmission(), admission.StaticCap(4), admission.AIMDController(),
               admission.GradientController()]


def members(proto) -> set[str]:
    """The names a Protocol declares: its methods, properties and annotated attributes."""
    return {k for k in [*vars(proto), *proto.__dict__.get("__annotations__", {})] if not k.startswith("_")}


_ABSENT, _ANNOTATED = object(), object()


def _declared(obj, name: str):
    """``name`` as ``obj`` (a class, or an instance for attributes set in ``__init__``) has it: the attribute,
    property or method itself, ``_ANNOTATED`` for a class's annotated instance attribute (a dataclass field,
    an attribute set once the engine has started), or ``_ABSENT``."""
    got = inspect.getattr_static(obj, name, _ABSENT)
    if got is _ABSENT and isinstance(obj, type):
        if any(name in vars(k).get("__annotations__", {}) for k in obj.__mro__):
            return _ANNOTATED
    return got


def missing(obj, proto) -> list[str]:
    """What ``obj`` lacks of ``proto``: members it does not have, methods it has as values or the other way
    round, and methods that cannot be called the way the protocol's signature is."""
    out = []
    for name in sorted(members(proto)):
        want, got = inspect.getattr_static(proto, name, None), _declared(obj, name)
        if got is _ABSENT:
            out.append(f"{name}: missing")
        elif inspect.isfunction(want):
            if not inspect.isfunction(got):
                out.append(f"{name}: not a method")
                continue
            params = list(inspect.signature(want).parameters.values())[1:]
            args = [None for p in params if p.default is inspect.Parameter.empty]
            kwargs = {p.name: None for p in params if p.default is not inspect.Parameter.empty}
            try:
                inspect.signature(got).bind(None, *args, **kwargs)
            except TypeError as exc:
                out.append(f"{name}: {exc}")
        elif inspect.isfunction(got):  # the protocol wants a value (property or attribute), the class a method
            out.append(f"{name}: a method, not a value")
    return out


@pytest.mark.parametrize("cls", ENGINES, ids=lambda c: c.__name__)
def test_every_engine_implements_the_driven_engine_interface(cls):
    assert missing(cls, DrivenEngine) == []


@pytest.mark.parametrize("controller", CONTROLLERS, ids=lambda c: type(c).__name__)
def test_every_controller_implements_the_admission_interface(controller):
    assert missing(controller, AdmissionController) == []


def _used(modules, bases: tuple[str, ...], owner_attr: str) -> set[str]:
    """Attributes the modules read off a name in ``bases`` or off ``self.<owner_attr>``, and names they
    getattr() off one (which the interfaces are there to avoid)."""
    used, fallbacks = set(), set()
    for mod in modules:
        for node in ast.walk(ast.parse(inspect.getsource(mod))):
            if isinstance(node, ast.Attribute):
                base = node.value
                if (isinstance(base, ast.Name) and base.id in bases) or (
                        isinstance(base, ast.Attribute) and base.attr == owner_attr):
                    used.add(node.attr)
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr":
                target = node.args[0]
                if (isinstance(target, ast.Name) and target.id in bases) or (
                        isinstance(target, ast.Attribute) and target.attr == owner_attr):
                    fallbacks.add(ast.unparse(node))
    assert not fallbacks, f"getattr on the interface: {sorted(fallbacks)}"
    return used


def test_the_engine_interface_is_exactly_what_the_driver_calls():
    used = _used([driver, slot_engine, supervise], ("eng", "engine"), "engine")  # (slot_engine: its calls in slots)
    assert {"step", "pool", "append", "abort", "has_work", "restart", "pid"} <= used  # the scan sees the calls
    assert used == members(DrivenEngine)


def test_the_admission_interface_is_what_the_driver_calls():
    used = _used([driver, metrics], ("controller",), "admission")
    assert {"observe", "advance", "limit"} <= used  # the scan sees the calls
    # may_admit: metronome.serving.AdmissionGate calls it, for the driver
    assert used | {"may_admit"} == members(AdmissionController)


def test_an_engine_can_start_after_the_simulator_has_run():
    """vLLM's CPU worker reads ``vars(x).get("kernel")`` for every module attribute with a ``__dict__`` when an
    engine starts; llvmlite (loaded by the simulator's numba loop) answered ``__dict__`` with a C function and
    the start failed. The same scan, after the guard, passes over every loaded module."""
    import sys

    import numba  # noqa: F401  (loads llvmlite's library wrapper)
    from llvmlite.binding import ffi

    from metronome.probe.engine import let_vllm_scan_modules

    ffi.lib._fntab.pop("__dict__", None)  # as a fresh process has it

    def scan():
        for module in list(sys.modules.values()):
            for value in list((getattr(module, "__dict__", None) or {}).values()):
                if hasattr(value, "__dict__"):
                    vars(value).get("kernel")

    with pytest.raises(AttributeError, match="_lib_fn_wrapper"):
        scan()
    let_vllm_scan_modules()
    scan()
