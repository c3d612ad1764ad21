"""Reading the dead-letter queue back: ``reap_dead`` takes the messages parked there (by
``dead_letter`` or by the broker) and hands them to a recorder, and the reasons they carry."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from aio_pika.abc import AbstractIncomingMessage

from qlm.global_queue.base import REASON_HEADER, DeadHandler, DeadLetter
from qlm.global_queue.rabbitmq.base import BROKER_ERRORS, RabbitBase, _close_quietly

T = TypeVar("T")


def dead_letter_reason(headers: Mapping[str, Any]) -> str:
    """Why a message in the dead-letter queue is there: QLM's reason (``x-qlm-reason``) when QLM
    parked it, else the broker's reason for its latest death — the first entry of ``x-death``,
    which RabbitMQ keeps most recent first (``delivery_limit``, or ``rejected`` when QLM could
    not republish it); ``dead-lettered`` when neither says."""
    reason = headers.get(REASON_HEADER)
    if isinstance(reason, (str, bytes)):
        return _text(reason)
    deaths = headers.get("x-death")
    if isinstance(deaths, list) and deaths and isinstance(deaths[0], Mapping):
        why = deaths[0].get("reason")
        if isinstance(why, (str, bytes)):
            return _text(why)
    return "dead-lettered"


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


class DeadLetters(RabbitBase):
    """Reaping the dead-letter queue, on the consumer's loop while consuming."""

    if TYPE_CHECKING:  # the consumer's (``consumer.Consuming``)

        async def _on_consumer_loop(
            self, work: Coroutine[Any, Any, T], loop: asyncio.AbstractEventLoop
        ) -> T: ...

    async def reap_dead(self, record: DeadHandler, limit: int = 1000) -> int:
        """``basic.get`` from the dead-letter queue on a short-lived connection, holding the
        messages un-acked while ``record`` runs: acked once it returned, returned to the
        dead-letter queue if it raised (or if this process dies meanwhile). While consuming,
        the connection is the consumer thread's (``record`` still runs on the caller's loop):
        a controller's loop busy planning a backlog made its handshakes time out."""
        caller, loop = asyncio.get_running_loop(), self._loop
        if loop is None:
            return await self._reap_dead(record, limit)

        async def record_there(letters: list[DeadLetter]) -> None:
            await record(letters)

        async def record_on_caller(letters: list[DeadLetter]) -> None:
            done = asyncio.run_coroutine_threadsafe(record_there(letters), caller)
            await asyncio.wrap_future(done)

        return await self._on_consumer_loop(self._reap_dead(record_on_caller, limit), loop)

    async def _reap_dead(self, record: DeadHandler, limit: int) -> int:
        try:
            connection = await self._connect("dead-letters")
        except BROKER_ERRORS as exc:
            raise self._unavailable("cannot read the dead-letter queue", exc) from exc
        try:
            held: list[AbstractIncomingMessage] = []
            try:
                channel = await connection.channel(publisher_confirms=False)
                await self._declare(channel)
                dead = await channel.get_queue(self.dead_letter_queue, ensure=False)
                while len(held) < limit:
                    incoming = await dead.get(no_ack=False, fail=False)
                    if incoming is None:
                        break
                    held.append(incoming)
            except BROKER_ERRORS as exc:
                raise self._unavailable("cannot read the dead-letter queue", exc) from exc
            if not held:
                return 0
            try:
                await record([DeadLetter(m.body, dead_letter_reason(m.headers)) for m in held])
            except BaseException:
                for m in held:  # a lost channel returns them anyway
                    with contextlib.suppress(*BROKER_ERRORS):
                        await m.nack(requeue=True)
                raise
            try:
                for m in held:
                    await m.ack()
            except BROKER_ERRORS as exc:  # unacked ones come back: recorded again, idempotently
                raise self._unavailable("cannot ack dead letters", exc) from exc
            return len(held)
        finally:
            await _close_quietly(connection)
