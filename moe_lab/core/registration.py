"""The one way moe-lab fills a registration table (methods, adapters, export loaders, the estimate's cost rows):
a decorator that stores an entry under a key and refuses a second, other function under the same key."""

from __future__ import annotations

from collections.abc import Callable


def register_once(table: dict, key: str, what: str, entry: Callable = lambda fn: fn) -> Callable[[Callable], Callable]:
    """A decorator storing ``entry(fn)`` as ``table[key]``; a second, other function under ``key`` is refused,
    naming both modules (an entry with an ``install`` attribute is compared by it)."""
    def register(fn: Callable) -> Callable:
        known = getattr(table.get(key), "install", table.get(key))
        if known is not None and known is not fn:
            raise ValueError(f"{what} {key!r} is registered twice: {known.__module__} and {fn.__module__}")
        table[key] = entry(fn)
        return fn

    return register
