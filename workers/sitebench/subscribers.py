"""The subscribers: N sockets on the job's page feed, in a child process, noting when each `iteration` arrives."""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import time
from collections import Counter

from workers.sitebench import CLOSE_TIMEOUT_S, MAX_FRAME, SUBSCRIBE_TIMEOUT_S, BenchError


def _load(raw) -> dict:
    try:
        msg = json.loads(raw)
    except (ValueError, TypeError):
        return {}
    return msg if isinstance(msg, dict) else {}


def subscribers_main(url: str, token: str, count: int, conn) -> None:
    """Entry point of the subscribers' process: `count` sockets on `url`; talks to the parent over `conn`."""
    run_child(_subscribers(url, token, count, conn), conn)


def run_child(coroutine, conn) -> None:
    """A child process's body: run `coroutine`; any failure goes to the parent as one ("error", line)."""
    try:
        asyncio.run(coroutine)
    except KeyboardInterrupt:
        pass
    except Exception as exc:  # the parent prints it as one line
        try:
            conn.send(("error", f"{type(exc).__name__}: {exc}"))
        except OSError:
            pass
    finally:
        conn.close()


async def _subscribers(url: str, token: str, count: int, conn) -> None:
    from websockets.asyncio.client import connect

    records: list[list[tuple[int, float]]] = [[] for _ in range(count)]
    seen: list[set[int]] = [set() for _ in range(count)]
    messages: Counter = Counter()
    statuses: list[dict] = []
    ended: list[str] = []
    sockets = []
    closing = False  # set once the benchmark closes the sockets itself

    async def open_one(i: int):
        ws = await connect(
            url, additional_headers={"Authorization": f"Bearer {token}"}, open_timeout=SUBSCRIBE_TIMEOUT_S,
            max_size=MAX_FRAME,
        )  # fmt: skip
        first = _load(await ws.recv())
        if first.get("type") != "snapshot":
            raise BenchError(f"subscriber {i}: expected a snapshot first, got {first.get('type')!r}")
        sockets.append(ws)
        return ws

    async def listen(i: int, ws) -> None:
        mine, got = records[i], seen[i]
        try:
            async for raw in ws:
                now = time.monotonic()
                msg = _load(raw)
                kind = msg.get("type")
                messages[kind] += 1
                inner = msg.get("messages") if kind == "batch" and isinstance(msg.get("messages"), list) else [msg]
                for m in inner:
                    if not isinstance(m, dict):
                        continue
                    if m.get("type") == "iteration" and type(m.get("iteration")) is int:
                        if m["iteration"] not in got:
                            got.add(m["iteration"])
                            mine.append((m["iteration"], now))
                    elif m.get("type") == "status" and i == 0:
                        statuses.append({k: m.get(k) for k in ("status", "message")})
                    if kind == "batch":
                        messages[f"batch:{m.get('type')}"] += 1
        except Exception as exc:  # noqa: BLE001 - a subscriber that drops is reported, not fatal
            if closing:
                return
            ended.append(f"subscriber {i}: {type(exc).__name__}: {exc}")
            return
        if not closing:
            ended.append(f"subscriber {i}: closed by the site (code {ws.close_code})")

    opened = await asyncio.gather(*(open_one(i) for i in range(count)), return_exceptions=True)
    failures = [r for r in opened if isinstance(r, BaseException)]
    listeners = [asyncio.create_task(listen(i, ws)) for i, ws in enumerate(opened) if not isinstance(ws, BaseException)]
    conn.send(("ready", count - len(failures), f"{type(failures[0]).__name__}: {failures[0]}" if failures else None))
    command = await asyncio.to_thread(_recv, conn)
    if command and command[0] == "end":
        _, events, grace = command
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(len(s) < events for s in seen):
            await asyncio.sleep(0.02)
    closing = True
    for ws in sockets:
        try:
            async with asyncio.timeout(CLOSE_TIMEOUT_S):
                await ws.close()
        except (TimeoutError, OSError):
            pass
    for task in listeners:
        task.cancel()
    await asyncio.gather(*listeners, return_exceptions=True)
    conn.send(("result", records, dict(messages), statuses, ended))


def _recv(conn):
    try:
        return conn.recv()
    except (EOFError, OSError):
        return None


class ChildProcess:
    """A child process of the benchmark (spawned) that talks over a pipe: ("error", line) or a reply per command."""

    who = "the subscribers"

    def __init__(self, target, *args):
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=target, args=(*args, child), daemon=True)
        self.proc.start()
        child.close()

    async def _get(self, timeout: float, what: str):
        ready = await asyncio.to_thread(self.conn.poll, timeout)
        if not ready:
            raise BenchError(f"{self.who} did not {what} within {timeout:.0f} s")
        try:
            reply = self.conn.recv()
        except (EOFError, OSError):
            raise BenchError(f"{self.who}' process ended (exit {self.proc.exitcode}) before it could {what}") from None
        if reply[0] == "error":
            raise BenchError(f"{self.who.removeprefix('the ')}: {reply[1]}")
        return reply

    def stop(self) -> None:
        try:
            self.conn.send(("abort",))
        except OSError:
            pass
        self.proc.join(CLOSE_TIMEOUT_S + 5)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(5)
        self.conn.close()


class Subscribers(ChildProcess):
    """The child process with the subscribers, seen from the parent."""

    def __init__(self, url: str, token: str, count: int):
        super().__init__(subscribers_main, url, token, count)
        self.count = count

    async def ready(self) -> None:
        _, opened, failure = await self._get(SUBSCRIBE_TIMEOUT_S + 10, "connect")
        if opened < self.count:
            raise BenchError(f"only {opened} of {self.count} subscribers could connect to the job ({failure})")

    async def finish(self, events: int, grace: float) -> tuple:
        self.conn.send(("end", events, grace))
        _, records, messages, statuses, ended = await self._get(grace + CLOSE_TIMEOUT_S + 30, "report")
        return records, messages, statuses, ended
