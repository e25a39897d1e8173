"""``mutex()``: one object that is a ``with`` block, an ``async with`` block and a decorator.

Each use makes a fresh :class:`Mutex`, so one ``mutex(...)`` object may be
shared freely (at module level, across threads and tasks), like a
``threading.Lock``. As a decorator the name may be a template filled from the
call's bound arguments (``"order:{order_id}"``, ``"product:{self.pk}"``) or a
callable receiving the same arguments. ``skip_if_locked()`` is the decorator
for work that is dropped, not queued, while someone else holds its lock.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import string
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal, TypeVar, cast

from .atomic_requests import RequestTransactions
from .conf import (
    LockOptions,
    refuse_timeout_without_blocking,
    validate_flag,
    validate_timeout,
    validate_ttl,
)
from .exceptions import LockContended
from .holds import current_owner
from .keys import validate_label, validate_name
from .lock import DEFAULT, Mutex

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["MutexContext", "mutex", "skip_if_locked"]

# A decorated call: the function, its positional and its keyword arguments.
Call = tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]
F = TypeVar("F", bound=Callable[..., Any])
_formatter = string.Formatter()
logger = logging.getLogger("django_redis_mutex")


def _placeholders(template: str) -> list[str]:
    """Return the field names of a format template (empty for a literal name)."""
    return [
        field for _literal, field, _spec, _conv in _formatter.parse(template) if field is not None
    ]


def _callable_class(name: Callable[..., str]) -> str:
    """Return the lock class of the locks a callable names: its qualified name."""
    qualname = getattr(name, "__qualname__", None) or type(name).__qualname__
    module = getattr(name, "__module__", None)
    return f"{module}.{qualname}" if module else qualname


def _field_root(field: str) -> str:
    """Return the argument a placeholder starts from: ``self`` of ``self.pk``, ``a`` of ``a[0]``."""
    return field.split(".", 1)[0].split("[", 1)[0]


@functools.lru_cache(maxsize=1024)
def _function_signature(func: Callable[..., Any], follow: bool) -> inspect.Signature:
    return inspect.signature(func, follow_wrapped=follow)


def _signature(func: Callable[..., Any], follow: bool) -> inspect.Signature:
    """Return ``func``'s signature, read once per plain function.

    Reading a signature costs more than the rest of filling a name template;
    a decorated function's signature never changes. Other callables (the
    partial ``method_decorator`` builds on every call) are read each time, so
    the cache never holds per-call objects.
    """
    if inspect.isfunction(func):
        return _function_signature(func, follow)
    return inspect.signature(func, follow_wrapped=follow)


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
            signature = _signature(func, follow)
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


def _refuse_task_object(obj: object, decorator: str) -> None:
    """Fail at decoration time when the decorator was put above a task decorator.

    Above ``@app.task`` (Celery) or ``@task`` (django.tasks) it would wrap the
    task object, so the lock would be taken where the task is sent, not where
    it runs.
    """
    if hasattr(obj, "apply_async") or (hasattr(obj, "enqueue") and hasattr(obj, "func")):
        raise TypeError(
            f"{decorator} got the task object {obj!r}: put it below the task decorator "
            f"(@app.task or @task on top, then @{decorator[:-2]}), so the lock is "
            "held where the task runs."
        )


def _same_signature(wrapper: F, func: Callable[..., Any]) -> F:
    """Give ``wrapper`` the signature of ``func``, for tools that do not follow ``__wrapped__``.

    Celery checks the arguments of ``task.delay(...)`` against the task
    function with ``inspect.getfullargspec``, which reads ``__signature__``
    but ignores ``__wrapped__``; without this a locked task accepted any
    arguments when sent and failed only in the worker.
    """
    # No readable signature: the wrapper keeps (*args, **kwargs).
    with contextlib.suppress(TypeError, ValueError):
        cast(Any, wrapper).__signature__ = inspect.signature(func)
    return wrapper


class EnteredHandles:
    """The handles a reusable context object entered, in order, with their owner.

    One ``mutex(...)`` or ``semaphore(...)`` object may be entered by several
    threads or tasks at once; each leaves the handle it entered.
    """

    def __init__(self, context: object) -> None:
        self._context = context
        self._entries: list[tuple[object, Mutex]] = []
        self._lock = threading.Lock()

    def push(self, handle: Mutex) -> None:
        with self._lock:
            self._entries.append((current_owner(), handle))

    def pop(self) -> Mutex:
        """Return the handle the block being left entered.

        Normally the latest one its owner entered; an async generator closed
        by another task leaves its block from there, so with no entry of the
        current owner the latest entry of all is the one being left.
        """
        owner = current_owner()
        with self._lock:
            for i in range(len(self._entries) - 1, -1, -1):
                if self._entries[i][0] == owner:
                    return self._entries.pop(i)[1]
            if not self._entries:
                raise RuntimeError(f"{self._context!r} was left more often than it was entered.")
            return self._entries.pop()[1]


class MutexContext:
    """What :func:`mutex` returns; see there."""

    _factory = "mutex()"  # names the factory in error messages
    # The keyword arguments it passes on to every handle it builds.
    _accepted: frozenset[str] = LockOptions.__optional_keys__ | {"shared"}

    def __init__(self, name: str | Callable[..., str], **options: Any) -> None:
        if callable(name):
            self._name_template: str | None = None
        else:
            validate_name(name)
            self._name_template = name
        # The class of every lock this context takes, for lock-order checking.
        self._lock_class = name if isinstance(name, str) else _callable_class(name)
        # The template's placeholders, parsed at the first decorated call (a
        # name used only in a with block is literal, braces and all).
        self._fields: list[str] | None = None
        self._name = name
        # Fail at decoration time on arguments that can never work; settings
        # are only read when a lock is actually built.
        unknown = sorted(set(options) - self._accepted)
        if unknown:
            raise TypeError(
                f"{self._factory} got unexpected keyword argument(s): "
                f"{', '.join(map(repr, unknown))}."
            )
        if "label" in options:
            validate_label(options["label"])
        validate_flag("shared", options.get("shared", False))
        validate_flag("release_at_block_end", options.get("release_at_block_end", False))
        if options.get("ttl", DEFAULT) is not DEFAULT:
            validate_ttl(options["ttl"])
        if options.get("timeout", DEFAULT) is not DEFAULT:
            validate_timeout(options["timeout"])
        refuse_timeout_without_blocking(options.get("blocking"), options.get("timeout", DEFAULT))
        self._options = options
        self._entered = EnteredHandles(self)

    def __repr__(self) -> str:
        return f"<mutex {self._name!r}>"

    # -- with / async with: the name is literal ------------------------------

    def _literal_name(self) -> str:
        if self._name_template is None:
            raise TypeError(
                f"A callable lock name is only filled when {self._factory} decorates a "
                "function; in a with block pass the name itself."
            )
        return self._name_template

    def _handle(self, name: str) -> Mutex:
        """Return a new handle on ``name`` with this context's options and lock class."""
        lock = self._new(name)
        lock._lock_class = self._lock_class
        return lock

    def _held(self, name: str) -> Mutex | contextlib.nullcontext[None]:
        """Return a new handle on ``name``, or no lock at all for an empty name.

        The name is empty for a call the function cannot accept: it runs
        unlocked, to raise its own TypeError.
        """
        return self._handle(name) if name else contextlib.nullcontext()

    def _new(self, name: str) -> Mutex:
        return Mutex(name, **self._options)

    def __enter__(self) -> Mutex:
        lock = self._handle(self._literal_name())
        lock.__enter__()
        self._entered.push(lock)
        return lock

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> Literal[False]:
        return self._entered.pop().__exit__(exc_type, exc, tb)

    async def __aenter__(self) -> Mutex:
        lock = self._handle(self._literal_name())
        await lock.__aenter__()
        self._entered.push(lock)
        return lock

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> Literal[False]:
        return await self._entered.pop().__aexit__(exc_type, exc, tb)

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
        fields = self._fields
        if fields is None:
            fields = self._fields = _placeholders(template)
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
        _refuse_task_object(func, self._factory)
        if not callable(func):
            raise TypeError(f"{self._factory} decorates a callable, not {type(func).__name__}.")
        # A generator's body runs while it is iterated, not when it is called:
        # hold the lock for the whole iteration.
        if inspect.isasyncgenfunction(func):

            @functools.wraps(func)
            async def async_gen_inner(*args: Any, **kwargs: Any) -> Any:
                name = self.name_for(func, args, kwargs)
                async with self._held(name):
                    async for item in func(*args, **kwargs):
                        yield item

            return cast(F, _same_signature(async_gen_inner, func))
        if inspect.isgeneratorfunction(func):

            @functools.wraps(func)
            def gen_inner(*args: Any, **kwargs: Any) -> Any:
                name = self.name_for(func, args, kwargs)
                with self._held(name):
                    return (yield from func(*args, **kwargs))

            return cast(F, _same_signature(gen_inner, func))
        if inspect.iscoroutinefunction(func):

            @functools.wraps(func)
            async def async_inner(*args: Any, **kwargs: Any) -> Any:
                name = self.name_for(func, args, kwargs)
                return await self._acall(name, (func, args, kwargs))

            return cast(F, _same_signature(async_inner, func))

        # Called as a view under ATOMIC_REQUESTS, the request's transaction
        # begins inside the lock and ends before it is given back.
        transactions = RequestTransactions(func)

        @functools.wraps(func)
        def inner(*args: Any, **kwargs: Any) -> Any:
            name = self.name_for(func, args, kwargs)
            if not name:
                # Neither a lock nor the request's transaction: the call fails at once.
                return func(*args, **kwargs)
            return self._call(name, transactions, (func, args, kwargs))

        transactions.mark(inner)
        return cast(F, _same_signature(inner, func))

    def _call(self, name: str, transactions: RequestTransactions, call: Call) -> Any:
        func, args, kwargs = call
        with self._handle(name), transactions.opened(args):
            return func(*args, **kwargs)

    async def _acall(self, name: str, call: Call) -> Any:
        func, args, kwargs = call
        async with self._held(name):
            return await func(*args, **kwargs)


def mutex(
    name: str | Callable[..., str], *, shared: bool = False, **options: Unpack[LockOptions]
) -> MutexContext:
    """Guard a block or a function with the distributed lock ``name``.

    Use it as ``with mutex("inventory") as lock:``, ``async with ...``, or as
    ``@mutex("order:{order_id}")`` on a sync or async function, view or method.
    The keyword arguments are :class:`Mutex`'s; those left out take the cache
    alias's ``MUTEX`` defaults. Raise
    LockContended when the lock cannot be acquired in time, LockLost when the
    hold was lost while a successful body ran, and LockBackendUnavailable when
    Redis cannot be reached (unless the alias is FAIL_OPEN).

    ``shared=True`` takes the lock shared (a read lock): any number of shared
    holders at once, none while an exclusive holder has it, and none newly
    admitted while an exclusive waiter is first in line.

    Inside a database transaction (``transaction.atomic()``), a lock whose
    block ends is kept until the outermost transaction commits or rolls back,
    so the next holder sees what this one wrote; ``release_at_block_end=True``
    gives it back when the block ends instead (see :doc:`transactions`). On a
    view under ``ATOMIC_REQUESTS`` the lock is taken before the request's
    transaction begins and given back after it ends.
    """
    return MutexContext(name, shared=shared, **options)


def skip_if_locked(
    name: str | Callable[..., str],
    *,
    using: str | Sequence[str] = "default",
    ttl: float = DEFAULT,
    timeout: float = 0,
    watchdog: bool = DEFAULT,
    reentrant: bool = True,
    label: str | None = None,
) -> Callable[[F], F]:
    """Run the decorated function under the lock ``name``, or skip the call while it is held.

    For work where a second run at the same time is pointless (refresh a
    cache, sync one customer): when another owner holds the lock and it does
    not come free within ``timeout`` seconds (by default, give up at once),
    return None without calling the function, and log it. Otherwise this is
    ``@mutex(name, ...)``: the same name templates, lease and watchdog, and
    the same errors from the body. A LockContended raised *inside* the
    function, by another lock, is not a skip: it propagates.

    .. versionadded:: 0.1
    """
    if timeout is None:
        raise ValueError(
            "skip_if_locked() needs a timeout in seconds (0 gives up at once); "
            "to wait as long as it takes, use mutex()."
        )
    return _SkipWhileHeld(
        name,
        using=using,
        ttl=ttl,
        timeout=timeout,
        blocking=True,
        watchdog=watchdog,
        reentrant=reentrant,
        label=label,
    )


_NOT_A_BLOCK = (
    "skip_if_locked() decorates a function; a with block cannot be skipped. "
    "Use mutex(name, blocking=False) and catch LockContended."
)


class _SkipWhileHeld(MutexContext):
    """What :func:`skip_if_locked` returns: ``@mutex`` that skips a call instead of waiting on."""

    _factory = "skip_if_locked()"

    def __enter__(self) -> Mutex:
        raise TypeError(_NOT_A_BLOCK)

    async def __aenter__(self) -> Mutex:
        raise TypeError(_NOT_A_BLOCK)

    def __call__(self, func: F) -> F:
        if inspect.isgeneratorfunction(func) or inspect.isasyncgenfunction(func):
            raise TypeError(
                "skip_if_locked() decorates a function that returns, not a generator: "
                "a skipped generator would look like an empty one. Use mutex()."
            )
        return super().__call__(func)

    def _call(self, name: str, transactions: RequestTransactions, call: Call) -> Any:
        func, args, kwargs = call
        with contextlib.ExitStack() as stack:
            # Only the acquisition's own LockContended means "skip".
            try:
                stack.enter_context(self._handle(name))
            except LockContended as busy:
                return _skipped(func, busy)
            # As mutex(): a view's request transaction begins inside the lock.
            stack.enter_context(transactions.opened(args))
            return func(*args, **kwargs)

    async def _acall(self, name: str, call: Call) -> Any:
        func, args, kwargs = call
        async with contextlib.AsyncExitStack() as stack:
            try:
                await stack.enter_async_context(self._held(name))
            except LockContended as busy:
                return _skipped(func, busy)
            return await func(*args, **kwargs)


def _skipped(func: Callable[..., Any], busy: LockContended) -> None:
    holder = f" by {busy.owner}" if busy.owner else ""
    logger.info(
        "Skipped %s: lock %r is held%s.", getattr(func, "__qualname__", func), busy.name, holder
    )
