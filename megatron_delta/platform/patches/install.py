"""How a patch replaces an upstream attribute, remembering the original so that the tests can put it back
(:func:`megatron_delta.platform.patches.patches_suspended`) and show the failure the patch answers."""
from __future__ import annotations

import contextlib
from typing import Dict, Iterable, List

_MISSING = object()
# patch name -> [(owner, attribute, original or _MISSING)], in the order replaced
_ORIGINALS: Dict[str, list] = {}
# patch name -> [(owner, attribute, the value installed)]
_INSTALLED: Dict[str, list] = {}
_CURRENT: List[str] = []


@contextlib.contextmanager
def installing(name: str):
    """Every :func:`replace` inside is recorded under the patch ``name``."""
    _CURRENT.append(name)
    try:
        yield
    finally:
        _CURRENT.pop()


def replace(owner, attr: str, value) -> None:
    """setattr, recording the original for the patch being installed."""
    if not _CURRENT:
        raise RuntimeError(f"replace({owner!r}, {attr!r}) outside megatron_delta.platform.patches.install.installing()")
    # a class attribute is restored in the class itself (not the inherited one)
    original = owner.__dict__.get(attr, _MISSING) if isinstance(owner, type) else getattr(owner, attr, _MISSING)
    _ORIGINALS.setdefault(_CURRENT[-1], []).append((owner, attr, original))
    _INSTALLED.setdefault(_CURRENT[-1], []).append((owner, attr, value))
    setattr(owner, attr, value)


def _restore(owner, attr: str, original) -> None:
    if original is _MISSING:
        if attr in getattr(owner, "__dict__", {}):
            delattr(owner, attr)
    else:
        setattr(owner, attr, original)


@contextlib.contextmanager
def suspended(names: Iterable[str]):
    """The originals of the named patches back in place while the block runs."""
    names = list(names)
    for name in names:
        for owner, attr, original in reversed(_ORIGINALS.get(name, [])):
            _restore(owner, attr, original)
    try:
        yield
    finally:
        for name in names:
            for owner, attr, value in _INSTALLED.get(name, []):
                setattr(owner, attr, value)
