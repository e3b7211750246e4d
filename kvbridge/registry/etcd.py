"""The etcd edge of the registry: a registration under a lease, and a watcher
that keeps a :class:`RegistryView` current.  On ``aetcd`` (asyncio, gRPC).

Both loop until closed and survive etcd going away: the watcher marks the
view stale and resyncs (a full listing, then a watch from the next revision)
when etcd is back; the registration re-creates a lost lease with the same
identity and a new generation.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aetcd
import grpc

from kvbridge.errors import AuthenticationError, InvalidArgument, PeerGone
from kvbridge.registry.records import (
    EngineRecord,
    LoadReport,
    encode_record,
    engine_key,
    engines_prefix,
    new_generation,
)
from kvbridge.registry.view import RegistryView

__all__ = ["EtcdOptions", "EtcdRegistration", "EtcdWatcher"]

log = logging.getLogger("kvbridge.registry")


@dataclass(frozen=True)
class EtcdOptions:
    """Where etcd is and how to authenticate to it (TLS files are PEM paths)."""

    host: str = "127.0.0.1"
    port: int = 2379
    username: str | None = None
    password: str | None = None
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    timeout_s: float = 2.0  # every etcd call
    retry_s: float = 0.5  # between attempts while etcd is unreachable

    def __post_init__(self) -> None:
        if (self.username is None) != (self.password is None):
            raise InvalidArgument("etcd username and password go together")
        if (self.cert_file is None) != (self.key_file is None):
            raise InvalidArgument("etcd cert_file and key_file go together")
        if self.cert_file is not None and self.ca_file is None:
            raise InvalidArgument("a client certificate needs ca_file (TLS)")
        if self.timeout_s <= 0 or self.retry_s <= 0:
            raise InvalidArgument("timeout_s and retry_s must be > 0")


def _refused(e: BaseException) -> AuthenticationError | None:
    """etcd's answer to credentials it does not accept (a wrong user or
    password, a token it does not know, a user without the permission):
    not worth retrying at start."""
    text = str(e)
    if isinstance(e, aetcd.exceptions.UnauthenticatedError) or (
        isinstance(e, aetcd.exceptions.ClientError)
        and ("authentication failed" in text or "permission denied" in text)
    ):
        return AuthenticationError(f"etcd refused kvbridge's credentials: {text}")
    return None


class _Client(aetcd.Client):  # type: ignore[misc]
    """aetcd's client, with TLS when :class:`EtcdOptions` names a CA."""

    def __init__(self, opts: EtcdOptions) -> None:
        super().__init__(
            host=opts.host,
            port=opts.port,
            username=opts.username,
            password=opts.password,
            timeout=opts.timeout_s,
        )
        self._creds: grpc.ChannelCredentials | None = None
        if opts.ca_file is not None:
            self._creds = grpc.ssl_channel_credentials(
                root_certificates=Path(opts.ca_file).read_bytes(),
                private_key=Path(opts.key_file).read_bytes() if opts.key_file else None,
                certificate_chain=Path(opts.cert_file).read_bytes() if opts.cert_file else None,
            )

    async def connect(self) -> None:
        # aetcd opens an insecure channel: the credentials of this connect
        # (a context variable, so only this task sees them) make it TLS
        token = _TLS.set(self._creds)
        try:
            await super().connect()
        finally:
            _TLS.reset(token)


# aetcd's channel factory, once: TLS where the connecting task asks for it
_TLS: contextvars.ContextVar[grpc.ChannelCredentials | None] = contextvars.ContextVar(
    "kvbridge_etcd_tls", default=None
)
_insecure_channel = aetcd.rpc.insecure_channel


def _channel(target: str, options: Any = None) -> Any:
    creds = _TLS.get()
    if creds is None:
        return _insecure_channel(target, options=options)
    return aetcd.rpc.secure_channel(target, creds, options=options)


aetcd.rpc.insecure_channel = _channel


class EtcdRegistration:
    """Keeps ``record`` registered under a lease of ``ttl_s`` seconds.

    :meth:`start` registers (waiting at most ``timeout_s``); a background task
    refreshes the lease every ``ttl_s / 3`` and rewrites the record when the
    load changes (:meth:`report_load`).  A lease that expired (etcd down or
    the engine stalled past the TTL) is replaced and the record rewritten with
    a new generation.
    """

    def __init__(
        self,
        record: EngineRecord,
        opts: EtcdOptions | None = None,
        *,
        ttl_s: int = 5,
        prefix: str = "/kvbridge/v1",
    ) -> None:
        if ttl_s < 1:
            raise InvalidArgument("ttl_s must be >= 1")
        self.opts = opts or EtcdOptions()
        self.record = record
        self.ttl_s = ttl_s
        self.key = engine_key(record.engine_id, prefix).encode()
        self.registrations = 0  # how many leases it took
        self._client = _Client(self.opts)
        self._lease: Any = None
        self._dirty = False
        self._task: asyncio.Task[None] | None = None
        self._registered = asyncio.Event()
        self._refused: AuthenticationError | None = None

    @property
    def generation(self) -> str:
        return self.record.generation

    async def start(self, timeout_s: float = 10.0) -> None:
        """Register, waiting at most ``timeout_s`` (``TimeoutError`` while etcd
        stays unreachable; ``AuthenticationError`` at once when etcd refuses
        the credentials)."""
        self._task = asyncio.create_task(self._run())
        await asyncio.wait_for(self._registered.wait(), timeout_s)
        if self._refused is not None:
            raise self._refused

    def report_load(self, load: LoadReport, prefixes: tuple[bytes, ...] | None = None) -> None:
        """Publish a new load report at the next refresh (no etcd wait here)."""
        changes: dict[str, Any] = {"load": load}
        if prefixes is not None:
            changes["prefixes"] = prefixes
        self.record = dataclasses.replace(self.record, **changes)
        self._dirty = True

    async def close(self, *, revoke: bool = True) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if revoke and self._lease is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(
                    self._client.revoke_lease(self._lease.id), self.opts.timeout_s
                )
        with contextlib.suppress(Exception):
            await self._client.close()

    async def _register(self) -> None:
        if self.registrations:  # a lost lease: same identity, new generation
            self.record = dataclasses.replace(self.record, generation=new_generation())
        lease = await self._client.lease(self.ttl_s)
        await self._client.put(self.key, encode_record(self.record), lease=lease)
        self._lease = lease
        self._dirty = False
        self.registrations += 1
        log.info("registry: %s registered, generation %s", self.record.engine_id, self.generation)
        self._registered.set()

    async def _run(self) -> None:
        period = max(self.ttl_s / 3, 0.2)
        while True:
            try:
                await self._client.connect()
                if self._lease is None:
                    await self._register()
                else:
                    reply = await self._client.refresh_lease(self._lease.id)
                    if reply is None or reply.TTL <= 0:
                        log.warning(
                            "registry: lease of %s lost; registering again", self.record.engine_id
                        )
                        self._lease = None
                        continue
                    if self._dirty:
                        self._dirty = False
                        await self._client.put(
                            self.key, encode_record(self.record), lease=self._lease
                        )
                await asyncio.sleep(period)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # etcd unreachable: retry until closed
                refused = _refused(e)
                if refused is not None and not self._registered.is_set():
                    self._refused = refused
                    self._registered.set()  # start() raises it
                    return
                log.warning("registry: etcd unreachable (%s); retrying", type(e).__name__)
                await self._reset()
                await asyncio.sleep(self.opts.retry_s)

    async def _reset(self) -> None:
        with contextlib.suppress(Exception):
            await self._client.close()
        self._client = _Client(self.opts)


class EtcdWatcher:
    """Keeps ``view`` current: a listing, then a watch from the revision after
    it; on any failure (etcd restarted, watch lost, revision compacted) the
    view is marked stale and the listing taken again."""

    def __init__(self, view: RegistryView, opts: EtcdOptions | None = None) -> None:
        self.view = view
        self.opts = opts or EtcdOptions()
        self.resyncs = 0
        self._prefix = engines_prefix(view.prefix).encode()
        self._client = _Client(self.opts)
        self._task: asyncio.Task[None] | None = None
        self._synced = asyncio.Event()
        self._refused: AuthenticationError | None = None

    async def start(self, timeout_s: float = 10.0) -> None:
        """List and watch, waiting at most ``timeout_s`` for the first listing
        (``AuthenticationError`` at once when etcd refuses the credentials)."""
        self._task = asyncio.create_task(self._run())
        await asyncio.wait_for(self._synced.wait(), timeout_s)
        if self._refused is not None:
            raise self._refused

    async def wait_fresh(self, timeout_s: float) -> None:
        """Wait (at most ``timeout_s``) until the view is synced again."""
        self._synced.clear() if self.view.stale else None
        await asyncio.wait_for(self._synced.wait(), timeout_s)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        with contextlib.suppress(Exception):
            await self._client.close()

    async def _run(self) -> None:
        while True:
            try:
                await self._client.connect()
                listing = await self._client.get_prefix(self._prefix)
                rev = listing.header.revision
                self.view.load_snapshot(
                    rev, [(kv.key.decode("utf-8", "replace"), kv.value) for kv in listing]
                )
                self.resyncs += 1
                self._synced.set()
                watch = await self._client.watch_prefix(self._prefix, start_revision=rev + 1)
                async for ev in watch:
                    key = ev.kv.key.decode("utf-8", "replace")
                    if ev.kind == aetcd.EventKind.PUT:
                        self.view.put(ev.kv.mod_revision, key, ev.kv.value)
                    else:
                        self.view.delete(ev.kv.mod_revision, key)
                raise PeerGone("the etcd watch stream ended")
            except asyncio.CancelledError:
                raise
            except Exception as e:
                refused = _refused(e)
                if refused is not None and self.resyncs == 0:
                    self._refused = refused
                    self._synced.set()  # start() raises it
                    return
                self.view.mark_stale()
                self._synced.clear()
                log.warning("registry: watch lost (%s); resyncing", type(e).__name__)
                with contextlib.suppress(Exception):
                    await self._client.close()
                self._client = _Client(self.opts)
                await asyncio.sleep(self.opts.retry_s)
