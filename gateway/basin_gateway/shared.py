"""Shared state in Redis: one elected leader's brain decides for every replica.

- **Lease.** `basin:{D}:lease` holds `<replica> <token>`, set NX with a TTL and renewed by a script that
  checks the holder; each new lease bumps `basin:{D}:fence`, the fencing token. Every write the leader
  makes (session table, controller snapshot) goes through a script that compares its token with the
  lease's, so a paused ex-leader cannot overwrite its successor.
- **Decisions.** Followers hand every call to the leader through `basin:{D}:inbox` and wait for the
  verdict on their own reply list; call ends and session ends go the same way without a reply. Only the
  leader's `Policy` object ever decides, so replicas cannot admit past its budget together.
- **Snapshot.** The leader writes the session table (`basin:{D}:sessions`) and the controller's state
  (`basin:{D}:controller`: B, B0, flags, plateau …) after every change batch; a new leader rebuilds its
  brain from them (`Brain.restore`) instead of starting cold.
- **Outage.** When Redis fails, every replica decides locally (a follower from the last snapshot it
  read), says so in `basin_gateway_redis_up` and the log, and when Redis returns the leader re-takes its
  lease and rewrites the table while followers hand over the sessions they admitted meanwhile.
- Every key has a TTL (refreshed while the deployment runs), so a dead deployment leaves nothing behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import os
import socket
import time
import uuid
from typing import Any

import aiohttp
import orjson
import redis.asyncio as aioredis
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.retry import Retry

from basin.policy import CallDirectives
from basin_gateway.brain import PARK, Brain, Verdict
from basin_gateway.build import LoadedProfile, build_policy
from basin_gateway.coordinator import Coordinator
from basin_gateway.metrics import GatewayMetrics
from basin_gateway.settings import Settings

log = logging.getLogger("basin.gateway")

KEY_TTL_MS = 24 * 3600 * 1000  # anything a deployment writes outlives it by a day at most
REPLY_TTL_MS = 60_000
FLUSH_S = 0.05  # wall seconds between session-table flushes of the leader
BLOCK_S = 1  # seconds a blocking read (BLPOP) waits before it looks around
NEXT_CONTROL = "gateway_next_control"  # in the controller snapshot, beside the policy's own state

# KEYS: lease, fence. ARGV: replica, ttl ms, key ttl ms, the highest token this replica has seen.
# A new lease and its fencing token, or 0. Tokens only grow, even across a Redis that lost its data.
ACQUIRE = """
if redis.call('SET', KEYS[1], ARGV[1] .. ' pending', 'NX', 'PX', ARGV[2]) then
  if tonumber(redis.call('GET', KEYS[2]) or '0') < tonumber(ARGV[4]) then
    redis.call('SET', KEYS[2], ARGV[4])
  end
  local token = redis.call('INCR', KEYS[2])
  redis.call('PEXPIRE', KEYS[2], ARGV[3])
  redis.call('SET', KEYS[1], ARGV[1] .. ' ' .. token, 'PX', ARGV[2])
  return token
end
return 0
"""
# KEYS: lease, epoch, sessions, controller, fence. ARGV: holder value, ttl ms, key ttl ms. 1 if still held.
RENEW = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
for i = 2, #KEYS do redis.call('PEXPIRE', KEYS[i], ARGV[3]) end
return 1
"""
# KEYS: lease, sessions, controller. ARGV: holder value, key ttl, controller json, n_set, sid, json…, sid…
# The fenced write of the leader's snapshot: nothing is written unless the caller still holds the lease.
WRITE = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
local n = tonumber(ARGV[4])
local i = 5
for _ = 1, n do
  redis.call('HSET', KEYS[2], ARGV[i], ARGV[i + 1])
  i = i + 2
end
while i <= #ARGV do
  redis.call('HDEL', KEYS[2], ARGV[i])
  i = i + 1
end
if ARGV[3] ~= '' then redis.call('SET', KEYS[3], ARGV[3], 'PX', ARGV[2]) end
redis.call('PEXPIRE', KEYS[2], ARGV[2])
return 1
"""


def _verdict_json(verdict: Verdict) -> dict[str, Any]:
    d = verdict.directives
    return {
        "action": verdict.action,
        "reason": verdict.reason,
        "index": verdict.index,
        "waited": verdict.waited,
        "priority": d.priority if d else None,
        "lend": bool(d and d.lend),
        "directives": d is not None,
        "attempts": verdict.attempts,
    }


def _verdict_from(data: dict[str, Any]) -> Verdict:
    directives = (
        CallDirectives(data.get("priority"), bool(data.get("lend"))) if data.get("directives") else None
    )
    return Verdict(
        data["action"], data.get("reason", ""), directives, int(data.get("index", 0)), data.get("waited")
    )


class RedisCoordinator(Coordinator):
    mode = "redis"

    def __init__(self, settings: Settings, metrics: GatewayMetrics, profile: LoadedProfile | None) -> None:
        super().__init__(settings, metrics, profile)
        assert settings.redis_url is not None
        self.replica = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        ns = f"basin:{{{settings.deployment}}}:"
        self.k_lease, self.k_fence, self.k_epoch = ns + "lease", ns + "fence", ns + "epoch"
        self.k_sessions, self.k_controller, self.k_inbox = ns + "sessions", ns + "controller", ns + "inbox"
        self.k_reply = f"{ns}reply:{self.replica}"
        pool = aioredis.BlockingConnectionPool.from_url(
            settings.redis_url,
            password=settings.redis_password,
            socket_timeout=BLOCK_S + 1.5,  # above the blocking reads' own timeout
            socket_connect_timeout=1.0,
            max_connections=64,
            timeout=BLOCK_S + 1.5,  # a call waits this long for a free connection, not fails at once
            # A pooled connection that went stale (Redis restarted) reconnects once before it counts.
            retry=Retry(NoBackoff(), 1),
            retry_on_error=[RedisConnectionError],
        )
        self.pool = pool
        self.redis = aioredis.Redis(connection_pool=pool)
        self.acquire = self.redis.register_script(ACQUIRE)
        self.renew = self.redis.register_script(RENEW)
        self.write = self.redis.register_script(WRITE)
        self.ttl_ms = int(settings.lease_ttl_s * 1000)
        self.leader = False
        self.token = 0
        self.redis_up = False
        self.ever_up = False
        self.pending: dict[str, asyncio.Future[dict[str, Any]]] = {}
        self.ids = itertools.count()
        self.written: dict[str, dict[str, Any]] = {}  # the session table as last written (leader)
        self.written_controller = b""
        self.cache: tuple[dict[str, Any], dict[str, dict[str, Any]]] | None = None  # last snapshot seen
        self.local: set[str] = set()  # sessions a follower decided itself while Redis was down
        self.leader_since = 0.0
        self.back_at = 0.0  # when Redis last came back (a surviving leader gets the first try at the lease)
        self.seen_token = 0
        self.local_decisions = 0  # calls a follower decided itself (Redis down)
        self.no_leader = 0  # calls answered 429 because no leader answered in time

    # ------------------------------------------------------------------ lifecycle
    @property
    def holder(self) -> str:
        return f"{self.replica} {self.token}"

    async def start(self, http: aiohttp.ClientSession) -> None:
        try:
            await self.redis.set(self.k_epoch, repr(self.clock.epoch), nx=True, px=KEY_TTL_MS)
            epoch = await self.redis.get(self.k_epoch)
            self.clock.epoch = float(epoch)
            self._up()
            log.info("Redis at %s: deployment %r, epoch %s, replica %s", self.settings.redis_url,
                     self.settings.deployment, epoch.decode(), self.replica)  # fmt: skip
        except (RedisError, OSError) as exc:
            self._down(exc)
        await super().start(http)
        self.tasks += [
            asyncio.create_task(self._lease_loop()),
            asyncio.create_task(self._reply_loop()),
            asyncio.create_task(self._inbox_loop()),
            asyncio.create_task(self._flush_loop()),
        ]

    async def stop(self) -> None:
        await super().stop()
        if self.leader and self.redis_up:
            with contextlib.suppress(RedisError, OSError):
                await self._flush()
                if await self.redis.get(self.k_lease) == self.holder.encode():
                    await self.redis.delete(self.k_lease)  # hand over at once on a clean stop
        with contextlib.suppress(RedisError, OSError):
            await self.redis.aclose()
            await self.pool.disconnect()

    def describe(self) -> dict[str, Any]:
        return {"mode": self.mode, "policy": self.brain.policy.name, "leader": self.leader,
                "redis": self.redis_up, "replica": self.replica}  # fmt: skip

    def _up(self) -> None:
        if not self.redis_up:
            if self.ever_up:
                log.warning("Redis is back: reconciling shared state")
            self.redis_up = self.ever_up = True

    def _down(self, exc: BaseException) -> None:
        self.metrics.redis_errors.inc()
        if self.redis_up or not self.ever_up:
            log.warning("Redis unavailable (%s): deciding locally on this replica until it returns", exc)
        was_up = self.redis_up
        self.redis_up = False
        self.ever_up = self.ever_up or was_up
        if not self.leader and was_up:
            self._local_brain()

    def _local_brain(self) -> None:
        """A follower cut off from the leader decides with a brain rebuilt from the last snapshot."""
        policy, _ = build_policy(self.settings, self.profile)
        brain = Brain(
            policy, self.settings.max_parked, self.settings.max_park_wait_s, self.settings.idle_timeout_s
        )
        if self.cache is not None:
            brain.restore(self.clock.now(), *self.cache)
        self.brain = brain
        self.local = set()

    # ------------------------------------------------------------------ calls
    async def call(self, sid: str, task: str, prompt_tokens: int) -> Verdict:
        if self.leader or not self.redis_up:
            verdict = self.brain.call(self.clock.now(), sid, task, prompt_tokens)
            if not self.leader:
                self.local.add(sid)
                self.local_decisions += 1
            return verdict
        try:
            reply = await self._ask({"op": "call", "sid": sid, "task": task, "tokens": prompt_tokens})
        except (RedisError, OSError) as exc:
            self._down(exc)
            return await self.call(sid, task, prompt_tokens)
        except TimeoutError:
            # No leader answered (an election under way, or a leader too slow): Redis works, so only a
            # leader may admit; the call waits like a parked one and is retried (the leader drops the
            # expired request, so it was not admitted behind the client's back).
            self.no_leader += 1
            if self.no_leader == 1 or self.no_leader % 100 == 0:
                log.warning(
                    "no leader answered within %.1f s (%d times): answering 429",
                    self._ask_timeout(),
                    self.no_leader,
                )
            return Verdict(PARK, "no-leader")
        return _verdict_from(reply)

    def call_done(
        self, sid: str, index: int, prompt_tokens: int, context_tokens: int, cached_tokens: int | None = None
    ) -> None:
        if self.leader or not self.redis_up or sid in self.local:
            super().call_done(sid, index, prompt_tokens, context_tokens, cached_tokens)
            return
        self.spawn_tell(
            {
                "op": "done",
                "sid": sid,
                "index": index,
                "prompt": prompt_tokens,
                "context": context_tokens,
                "cached": cached_tokens,
            }
        )

    def end(self, sid: str, completed: bool, outcome: str, reason: str) -> None:
        if self.leader or not self.redis_up or sid in self.local:
            super().end(sid, completed, outcome, reason)
            self.local.discard(sid)
            return
        self.spawn_tell(
            {"op": "end", "sid": sid, "completed": completed, "outcome": outcome, "reason": reason}
        )

    async def delete(self, sid: str) -> bool:
        if self.leader or not self.redis_up:
            self.local.discard(sid)
            return await super().delete(sid)
        try:
            reply = await self._ask({"op": "delete", "sid": sid})
        except (RedisError, OSError) as exc:
            self._down(exc)
            return await super().delete(sid)
        except TimeoutError:
            return await super().delete(sid)
        return bool(reply.get("found"))

    def retry_after_s(self) -> float:
        """A follower aims retries just after the leader's next control step, as the leader does."""
        if self.leader or not self.redis_up or self.cache is None:
            return super().retry_after_s()
        upcoming = self.cache[0].get(NEXT_CONTROL)
        step = self._fast_interval() / self.clock.scale
        if not isinstance(upcoming, int | float) or step <= 0:
            return super().retry_after_s()
        now = time.time()
        if upcoming < now:  # the snapshot is older than a step: extrapolate at the busy cadence
            upcoming += math.ceil((now - upcoming) / step) * step
        return min(upcoming - now + 0.02, 60.0)

    # ------------------------------------------------------------------ follower → leader
    def _ask_timeout(self) -> float:
        return 2 * self.settings.lease_ttl_s + 0.5

    async def _ask(self, message: dict[str, Any]) -> dict[str, Any]:
        rid = f"{self.replica}:{next(self.ids)}"
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self.pending[rid] = future
        message.update(id=rid, reply=self.k_reply, deadline=time.time() + self._ask_timeout())
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.rpush(self.k_inbox, orjson.dumps(message))
                pipe.pexpire(self.k_inbox, REPLY_TTL_MS)
                await pipe.execute()
            return await asyncio.wait_for(future, self._ask_timeout())
        finally:
            self.pending.pop(rid, None)

    def spawn_tell(self, message: dict[str, Any]) -> None:
        async def tell() -> None:
            try:
                await self.redis.rpush(self.k_inbox, orjson.dumps(message))
            except (RedisError, OSError) as exc:
                self._down(exc)

        task = asyncio.ensure_future(tell())
        self.tasks.append(task)
        task.add_done_callback(lambda t: self.tasks.remove(t) if t in self.tasks else None)

    async def _reply_loop(self) -> None:
        while True:
            if not self.redis_up:
                await asyncio.sleep(0.1)
                continue
            try:
                item = await self.redis.blpop([self.k_reply], timeout=BLOCK_S)
            except (RedisError, OSError) as exc:
                self._down(exc)
                continue
            if item is None:
                continue
            reply = orjson.loads(item[1])
            future = self.pending.get(reply.get("id", ""))
            if future is not None and not future.done():
                future.set_result(reply)

    # ------------------------------------------------------------------ the leader
    async def _inbox_loop(self) -> None:
        while True:
            if not (self.leader and self.redis_up):
                await asyncio.sleep(0.05)
                continue
            try:
                item = await self.redis.blpop([self.k_inbox], timeout=BLOCK_S)
                if item is None:
                    continue
                batch = [item[1], *(await self.redis.lpop(self.k_inbox, 256) or [])]
            except (RedisError, OSError) as exc:
                self._down(exc)
                continue
            replies: list[tuple[str, bytes]] = []
            for raw in batch:
                try:
                    reply = self._handle(orjson.loads(raw))
                except Exception:  # one bad message must not stop the leader
                    log.exception("could not handle a message from a follower")
                    continue
                if reply is not None:
                    replies.append(reply)
            if replies:
                try:
                    async with self.redis.pipeline(transaction=False) as pipe:
                        for key, payload in replies:
                            pipe.rpush(key, payload)
                            pipe.pexpire(key, REPLY_TTL_MS)
                        await pipe.execute()
                except (RedisError, OSError) as exc:
                    self._down(exc)

    def _handle(self, message: dict[str, Any]) -> tuple[str, bytes] | None:
        op, sid = message.get("op"), str(message.get("sid", ""))
        now = self.clock.now()
        if op == "call":
            if time.time() > float(message.get("deadline", 0)):
                return None  # its replica gave up waiting and decided itself
            verdict = self.brain.call(now, sid, str(message.get("task", "")), int(message.get("tokens", 0)))
            payload = {"id": message["id"], **_verdict_json(verdict)}
            return message["reply"], orjson.dumps(payload)
        if op == "done":
            cached = message.get("cached")
            self.brain.call_done(
                now,
                sid,
                int(message["index"]),
                int(message["prompt"]),
                int(message["context"]),
                None if cached is None else int(cached),
            )
        elif op == "end":
            self.brain.end(
                now, sid, bool(message["completed"]), str(message["outcome"]), str(message["reason"])
            )
        elif op == "delete":
            found = self.brain.end(now, sid, False, "ended", "deleted")
            return message["reply"], orjson.dumps({"id": message["id"], "found": found})
        elif op == "adopt":
            self.brain.adopt(now, sid, message["record"])
        return None

    async def _flush(self) -> None:
        """Write the sessions that changed since the last write and the controller's state, fenced by
        the lease (the comparison with what was written catches every change, whoever made it)."""
        sessions = self.brain.sessions
        changed = {}
        for sid, entry in sessions.items():
            record = entry.record()
            if self.written.get(sid) != record:
                changed[sid] = record
        gone = [sid for sid in self.written if sid not in sessions]
        state = self.brain.controller_state()
        # When the leader's next control step comes (epoch seconds): followers aim their Retry-After at it.
        state[NEXT_CONTROL] = time.time() + (self.next_control_wall - time.monotonic())
        controller = orjson.dumps(state)
        if not changed and not gone and controller == self.written_controller:
            return
        args: list[Any] = [self.holder, KEY_TTL_MS, controller, len(changed)]
        for sid, record in changed.items():
            args += [sid, orjson.dumps(record)]
        args += gone
        held = await self.write(keys=[self.k_lease, self.k_sessions, self.k_controller], args=args)
        if not held:
            self._lose("a newer leader holds the lease (fenced write refused)")
            return
        self.written.update(changed)
        for sid in gone:
            del self.written[sid]
        self.written_controller = controller

    async def _flush_loop(self) -> None:
        while True:
            await asyncio.sleep(FLUSH_S)
            if not (self.leader and self.redis_up):
                continue
            try:
                await self._flush()
            except (RedisError, OSError) as exc:
                self._down(exc)

    def deciding(self) -> bool:
        return self.leader or not self.redis_up  # a follower reads no telemetry while the leader decides

    def control(self, reading: Any) -> float | None:
        if self.leader or not self.redis_up:
            return super().control(reading)
        return self._fast_interval() or None  # a follower's brain waits; the leader's decides

    async def _sweep_loop(self) -> None:
        period = min(1.0, max(0.05, 5.0 / self.clock.scale))
        while True:
            await asyncio.sleep(period)
            if self.leader or not self.redis_up:
                self.brain.sweep(self.clock.now())

    def _lose(self, why: str) -> None:
        """Stop deciding; the sessions this brain holds are handed to the new leader."""
        if self.leader:
            log.warning("leadership lost: %s", why)
            self.local = {sid for sid, entry in self.brain.sessions.items() if entry.state == "active"}
        self.leader = False

    async def _lease_loop(self) -> None:
        while True:
            try:
                await self._lease_step()
            except (RedisError, OSError) as exc:
                self._down(exc)
            await asyncio.sleep(self.settings.lease_ttl_s / 3)

    async def _lease_step(self) -> None:
        keys = [self.k_lease, self.k_epoch, self.k_sessions, self.k_controller, self.k_fence]
        if self.leader:
            held = await self.renew(keys=keys, args=[self.holder, self.ttl_ms, KEY_TTL_MS])
            came_back = not self.redis_up
            self._up()
            if held:
                return
            if not came_back:
                self._lose("the lease expired")
                return
            # Redis came back empty (a restart): take the lease again, keep this brain, rewrite the table.
            token = await self._acquire()
            if token:
                await self.redis.set(self.k_epoch, repr(self.clock.epoch), nx=True, px=KEY_TTL_MS)
                self.written, self.written_controller = {}, b""
                log.info("lease re-taken after Redis returned (token %d); shared table rewritten", self.token)
            else:
                self._lose("another replica took the lease while Redis was away")
            return
        came_back = not self.redis_up and self.ever_up
        # A follower reads the snapshot it would decide from if Redis failed, and tries for the lease.
        controller = await self.redis.get(self.k_controller)
        records = await self.redis.hgetall(self.k_sessions)
        self._up()
        self.cache = (
            orjson.loads(controller) if controller else {},
            {k.decode(): orjson.loads(v) for k, v in records.items()},
        )
        holder = await self.redis.get(self.k_lease)
        if holder and holder.split()[-1].isdigit():
            self.seen_token = max(self.seen_token, int(holder.split()[-1]))
        if came_back:
            self.back_at = time.monotonic()
        if self.local and holder and not holder.endswith(b"pending"):
            await self._hand_over_local()
        if time.monotonic() - self.back_at < self.settings.lease_ttl_s:
            return  # Redis just came back: the leader from before the outage re-takes its lease first
        if await self._acquire():
            await self._become_leader()

    async def _acquire(self) -> int:
        args = [self.replica, self.ttl_ms, KEY_TTL_MS, max(self.seen_token, self.token)]
        token = int(await self.acquire(keys=[self.k_lease, self.k_fence], args=args))
        if token:
            self.token = self.seen_token = token
        return token

    async def _hand_over_local(self) -> None:
        """Tell the leader of the sessions this replica decided on its own (while Redis was away, while no
        leader answered, or as the leader it no longer is); the leader adopts those it does not know."""
        for sid in list(self.local):
            entry = self.brain.sessions.get(sid)
            if entry is not None and entry.state == "active":
                await self.redis.rpush(
                    self.k_inbox, orjson.dumps({"op": "adopt", "sid": sid, "record": entry.record()})
                )
        log.info("handed %d locally admitted sessions to the leader", len(self.local))
        self.local = set()

    async def _become_leader(self) -> None:
        """Rebuild the brain from the shared snapshot (sessions and controller) and start deciding."""
        assert self.cache is not None
        controller, records = self.cache
        policy, _ = build_policy(self.settings, self.profile)
        brain = Brain(
            policy, self.settings.max_parked, self.settings.max_park_wait_s, self.settings.idle_timeout_s
        )
        brain.restore(self.clock.now(), controller, records)
        for sid in self.local:  # sessions this replica decided itself and the snapshot lacks
            entry = self.brain.sessions.get(sid)
            if entry is not None and entry.state == "active" and sid not in brain.sessions:
                brain.adopt(self.clock.now(), sid, entry.record())
        self.brain = brain
        self.local = set()
        self.leader = True
        self.leader_since = time.monotonic()
        self.written, self.written_controller = dict(records), b""
        budget = controller.get("budget", "n/a")
        log.info("leader now (token %d): resumed %d sessions from the snapshot, budget %s", self.token,
                 len(records), budget)  # fmt: skip

    # ------------------------------------------------------------------ metrics
    def extra_rows(self) -> list[tuple[str, str, dict[str, str], float]]:
        return [
            ("leader", "1 when this replica makes admission decisions.", {}, float(self.leader)),
            ("redis_up", "1 while Redis answers; 0: deciding locally.", {}, float(self.redis_up)),
            ("fencing_token", "The fencing token of this replica's last lease.", {}, float(self.token)),
            (
                "no_leader_answers",
                "429s given because no leader answered in time.",
                {},
                float(self.no_leader),
            ),
            (
                "local_decisions",
                "Calls this replica decided without the leader (running total).",
                {},
                float(self.local_decisions),
            ),
        ]
