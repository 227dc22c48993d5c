"""The browsers of `control`: sockets on several jobs' live feeds, in a child process, each noting when every
iteration and step of its job arrives, and connecting again (as the live page does) when its socket is lost."""

from __future__ import annotations

import asyncio
import time

from workers.sitebench import CLOSE_TIMEOUT_S, MAX_FRAME, SUBSCRIBE_TIMEOUT_S, BenchError
from workers.sitebench.subscribers import ChildProcess, _load, _recv, run_child

RECONNECT_S = 0.5


def watchers_main(urls: list[str], token: str, conn) -> None:
    run_child(_watch(urls, token, conn), conn)


async def _watch(urls: list[str], token: str, conn) -> None:
    from websockets.asyncio.client import connect

    n = len(urls)
    iterations: list[dict[int, tuple[float, bool]]] = [{} for _ in range(n)]  # it -> (when, live: not a snapshot)
    steps: list[list[tuple]] = [[] for _ in range(n)]  # (device, iteration, micro-batch, kind, when)
    reconnects = [0] * n
    ready = [asyncio.Event() for _ in range(n)]
    closing = asyncio.Event()

    def note(i: int, msg: dict, now: float, live: bool) -> None:
        kind = msg.get("type")
        if kind == "batch":
            for m in msg.get("messages") or ():
                if isinstance(m, dict):
                    note(i, m, now, live)
        elif kind == "iteration" and type(msg.get("iteration")) is int:
            iterations[i].setdefault(msg["iteration"], (now, live))
        elif kind == "steps":
            for s in msg.get("steps") or ():
                if isinstance(s, dict):
                    steps[i].append((s.get("device"), s.get("iteration"), s.get("micro_batch"), s.get("kind"), now))
        elif kind == "snapshot":
            for m in msg.get("iterations") or ():
                if isinstance(m, dict) and type(m.get("iteration")) is int:
                    iterations[i].setdefault(m["iteration"], (now, False))

    async def watch(i: int) -> None:
        while not closing.is_set():
            try:
                async with connect(urls[i], additional_headers={"Authorization": f"Bearer {token}"},
                                   open_timeout=SUBSCRIBE_TIMEOUT_S, max_size=MAX_FRAME) as ws:  # fmt: skip
                    note(i, _load(await ws.recv()), time.monotonic(), False)
                    ready[i].set()
                    stop = asyncio.create_task(closing.wait())
                    while not closing.is_set():
                        recv = asyncio.create_task(ws.recv())
                        await asyncio.wait({recv, stop}, return_when=asyncio.FIRST_COMPLETED)
                        if not recv.done():
                            recv.cancel()
                            break
                        note(i, _load(recv.result()), time.monotonic(), True)
                    stop.cancel()
                    async with asyncio.timeout(CLOSE_TIMEOUT_S):
                        await ws.close()
                    return
            except Exception:  # noqa: BLE001 - lost (a daphne process killed): connect again, as the page does
                if closing.is_set():
                    return
                reconnects[i] += 1
                await asyncio.sleep(RECONNECT_S)

    tasks = [asyncio.create_task(watch(i)) for i in range(n)]
    try:
        async with asyncio.timeout(SUBSCRIBE_TIMEOUT_S + 10):
            await asyncio.gather(*(r.wait() for r in ready))
    except TimeoutError:
        conn.send(("ready", sum(r.is_set() for r in ready)))
    else:
        conn.send(("ready", n))
    command = await asyncio.to_thread(_recv, conn)
    if command and command[0] == "end":
        await asyncio.sleep(command[1])  # the grace for what is still on its way
    closing.set()
    await asyncio.gather(*tasks, return_exceptions=True)
    conn.send(("result", iterations, steps, reconnects))


class Watchers(ChildProcess):
    """The child process with the browsers' sockets, seen from the parent."""

    who = "the browsers"

    def __init__(self, urls: list[str], token: str):
        super().__init__(watchers_main, urls, token)
        self.count = len(urls)

    async def ready(self) -> None:
        _, opened = await self._get(SUBSCRIBE_TIMEOUT_S + 30, "connect")
        if opened < self.count:
            raise BenchError(f"only {opened} of {self.count} browser sockets could connect")

    async def finish(self, grace: float) -> tuple:
        self.conn.send(("end", grace))
        _, iterations, steps, reconnects = await self._get(grace + CLOSE_TIMEOUT_S + 60, "report")
        return iterations, steps, reconnects
