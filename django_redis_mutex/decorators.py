"""``mutex()``: one object that is a ``with`` block, an ``async with`` block and a decorator.

Each use makes a fresh :class:`Mutex`, so one ``mutex(...)`` object may be
shared freely (at module level, across threads and tasks), like a
``threading.Lock``. As a decorator the name may be a template filled from the
call's bound arguments (``"order:{order_id}"``, ``"product:{self.pk}"``) or a
callable receiving the same arguments.
"""

from __future__ import annotations

import functools
import inspect
import string
import threading
from collections.abc import Callable, Sequence
from typing import Any, Literal, TypeVar, cast

from .conf import validate_timeout, validate_ttl
from .holds import current_owner
from .keys import validate_label, validate_name
from .lock import DEFAULT, Mutex

__all__ = ["MutexContext", "mutex"]

F = TypeVar("F", bound=Callable[..., Any])
_formatter = string.Formatter()


def _placeholders(template: str) -> list[str]:
    """Return the field names of a format template (empty for a literal name)."""
    fields = []
    for _literal, field, _spec, _conv in _formatter.parse(template):
        if field is not None:
            fields.append(field)
    return fields


def _field_root(field: str) -> str:
    for i, char in enumerate(field):
        if char in ".[":
            return field[:i]
    return field


def _bind(
    func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> inspect.BoundArguments | None:
    """Bind a call to ``func``'s parameters, seeing through wrappers when that works.

    ``method_decorator`` passes a partial of the bound method whose
    ``__wrapped__`` is the plain function (with ``self``); the partial's own
    signature is the right one then.
    """
    for follow in (True, False):
        try:
            signature = inspect.signature(func, follow_wrapped=follow)
        except ValueError as exc:
            raise TypeError(
                f"Cannot read the parameters of {func!r} to fill a lock name template; "
                "pass a callable name instead."
            ) from exc
        try:
            return signature.bind(*args, **kwargs)
        except TypeError:
            continue
    return None


class MutexContext:
    """What :func:`mutex` returns; see there."""

    def __init__(self, name: str | Callable[..., str], **options: Any) -> None:
        if callable(name):
            self._name_template: str | None = None
        else:
            validate_name(name)
            self._name_template = name
        self._name = name
        # Fail at decoration time on arguments that can never work; settings
        # are only read when a lock is actually built.
        if "label" in options:
            validate_label(options["label"])
        if options.get("ttl", DEFAULT) is not DEFAULT:
            validate_ttl(options["ttl"])
        if options.get("timeout", DEFAULT) is not DEFAULT:
            validate_timeout(options["timeout"])
            if options.get("blocking") is False and options["timeout"] is not None:
                raise ValueError(
                    "A timeout cannot be given for a non-blocking lock (blocking=False)."
                )
        self._options = options
        # The handles entered through this object, in order, with their owner.
        self._active: list[tuple[object, Mutex]] = []
        self._active_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"<mutex {self._name!r}>"

    # -- with / async with: the name is literal ------------------------------

    def _literal_name(self) -> str:
        if self._name_template is None:
            raise TypeError(
                "A callable lock name is only filled when mutex() decorates a function; "
                "in a with block pass the name itself."
            )
        return self._name_template

    def _push(self, lock: Mutex) -> None:
        with self._active_lock:
            self._active.append((current_owner(), lock))

    def _pop(self) -> Mutex:
        """Return the handle the block being left entered.

        Normally the latest one its owner entered; an async generator closed
        by another task leaves its block from there, so with no entry of the
        current owner the latest entry of all is the one being left.
        """
        owner = current_owner()
        with self._active_lock:
            for i in range(len(self._active) - 1, -1, -1):
                if self._active[i][0] == owner:
                    return self._active.pop(i)[1]
            if not self._active:
                raise RuntimeError(f"{self!r} was left more often than it was entered.")
            return self._active.pop()[1]

    def __enter__(self) -> Mutex:
        lock = Mutex(self._literal_name(), **self._options)
        lock.__enter__()
        self._push(lock)
        return lock

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> Literal[False]:
        return self._pop().__exit__(exc_type, exc, tb)

    async def __aenter__(self) -> Mutex:
        lock = Mutex(self._literal_name(), **self._options)
        await lock.__aenter__()
        self._push(lock)
        return lock

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> Literal[False]:
        return await self._pop().__aexit__(exc_type, exc, tb)

    # -- decorator: the name is filled from the call -------------------------

    def name_for(
        self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> str:
        """Return the lock name for one call of ``func``."""
        if self._name_template is None:
            name = cast(Callable[..., Any], self._name)(*args, **kwargs)
            if not isinstance(name, str):
                raise TypeError(
                    f"The lock name callable {self._name!r} returned {type(name).__name__}, "
                    "not a string."
                )
            return validate_name(name)
        template = self._name_template
        fields = _placeholders(template)
        if not fields:
            return template.replace("{{", "{").replace("}}", "}")
        bound = _bind(func, args, kwargs)
        if bound is None:
            # A call the function cannot accept: let it raise its own TypeError.
            return ""
        bound.apply_defaults()
        values: dict[str, Any] = {}
        for param_name, value in bound.arguments.items():
            kind = bound.signature.parameters[param_name].kind
            if kind is inspect.Parameter.VAR_KEYWORD:
                values.update(value)
            else:
                values[param_name] = value
        for field in fields:
            root = _field_root(field)
            if not root or root.isdigit():
                raise ValueError(
                    f"Lock name template {template!r} uses a positional placeholder "
                    f"{{{field}}}; name the parameter instead, e.g. {{order_id}}."
                )
            if root not in values:
                raise ValueError(
                    f"Lock name template {template!r} names {{{root}}}, which is not an "
                    f"argument of {getattr(func, '__qualname__', func)!r} "
                    f"(arguments: {', '.join(values) or 'none'})."
                )
        try:
            name = template.format_map(values)
        except (AttributeError, IndexError, KeyError) as exc:
            raise ValueError(
                f"Lock name template {template!r} could not be filled: {exc!r}."
            ) from exc
        return validate_name(name)

    def __call__(self, func: F) -> F:
        if not callable(func):
            raise TypeError(f"mutex() decorates a callable, not {type(func).__name__}.")
        options = self._options
        # A generator's body runs while it is iterated, not when it is called:
        # hold the lock for the whole iteration.
        if inspect.isasyncgenfunction(func):

            @functools.wraps(func)
            async def async_gen_inner(*args: Any, **kwargs: Any) -> Any:
                name = self.name_for(func, args, kwargs)
                if not name:
                    async for item in func(*args, **kwargs):
                        yield item
                    return
                async with Mutex(name, **options):
                    async for item in func(*args, **kwargs):
                        yield item

            return cast(F, async_gen_inner)
        if inspect.isgeneratorfunction(func):

            @functools.wraps(func)
            def gen_inner(*args: Any, **kwargs: Any) -> Any:
                name = self.name_for(func, args, kwargs)
                if not name:
                    return (yield from func(*args, **kwargs))
                with Mutex(name, **options):
                    return (yield from func(*args, **kwargs))

            return cast(F, gen_inner)
        if inspect.iscoroutinefunction(func):

            @functools.wraps(func)
            async def async_inner(*args: Any, **kwargs: Any) -> Any:
                name = self.name_for(func, args, kwargs)
                if not name:
                    return await func(*args, **kwargs)
                async with Mutex(name, **options):
                    return await func(*args, **kwargs)

            return cast(F, async_inner)

        @functools.wraps(func)
        def inner(*args: Any, **kwargs: Any) -> Any:
            name = self.name_for(func, args, kwargs)
            if not name:
                return func(*args, **kwargs)
            with Mutex(name, **options):
                return func(*args, **kwargs)

        return cast(F, inner)


def mutex(
    name: str | Callable[..., str],
    *,
    using: str | Sequence[str] = "default",
    ttl: float = DEFAULT,
    timeout: float | None = DEFAULT,
    blocking: bool = DEFAULT,
    watchdog: bool = DEFAULT,
    reentrant: bool = True,
    label: str | None = None,
) -> MutexContext:
    """Guard a block or a function with the distributed lock ``name``.

    Use it as ``with mutex("inventory") as lock:``, ``async with ...``, or as
    ``@mutex("order:{order_id}")`` on a sync or async function, view or method.
    Arguments left out take the cache alias's ``MUTEX`` defaults. Raise
    LockContended when the lock cannot be acquired in time, LockLost when the
    hold was lost while a successful body ran, and LockBackendUnavailable when
    Redis cannot be reached (unless the alias is FAIL_OPEN).
    """
    return MutexContext(
        name,
        using=using,
        ttl=ttl,
        timeout=timeout,
        blocking=blocking,
        watchdog=watchdog,
        reentrant=reentrant,
        label=label,
    )
