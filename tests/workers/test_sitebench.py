"""`python -m workers.sitebench`: its arguments and one-line errors, its statistics, and its agent (the real
connection and outbox, with the benchmark's runner) against the fake site (no real site needed)."""

import asyncio
import threading
import time

import pytest

from engine.errors import UserError
from tests.workers.fakesite import FakeSite
from workers import connection
from workers.outbox import Outbox
from workers.sitebench.agent import BenchAgent, BenchRunner
from workers.sitebench.cli import parse_args
from workers.sitebench.run import main
from workers.sitebench.stats import latency_stats

URL = "http://127.0.0.1:18555"


def usage_error(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as stop:
        parse_args(argv)
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err.strip()


def test_defaults():
    args = parse_args(["live", "--url", URL])
    assert (args.subscribers, args.rate, args.seconds, args.batch) == (20, 100.0, 60.0, 1)
    assert (args.token, args.user, args.device, args.json) == (None, "admin", "bench-live", False)


def test_options_and_url_normalised():
    args = parse_args(
        ["live", "--url", "http://localhost:8000/", "--subscribers", "3", "--rate", "50", "--seconds", "2.5",
         "--batch", "20", "--token", "ast_x", "--json"]
    )  # fmt: skip
    assert args.url == "http://localhost:8000"
    assert (args.subscribers, args.rate, args.seconds, args.batch) == (3, 50.0, 2.5, 20)
    assert (args.token, args.json) == ("ast_x", True)


@pytest.mark.parametrize(
    "argv, words",
    [
        ([], "required: command"),
        (["live"], "required: --url"),
        (["live", "--url", "http://example.com:8000"], "only a site on 127.0.0.1 or localhost"),
        (["live", "--url", "http://10.0.0.5:8000"], "only a site on 127.0.0.1 or localhost"),
        (["live", "--url", "ftp://127.0.0.1"], "is not a URL like"),
        (["live", "--url", "http://127.0.0.1:99999"], "is not a URL like"),
        (["live", "--url", URL + "/?x=1"], "query or fragment"),
        (["live", "--url", URL, "--subscribers", "0"], "--subscribers: must be from 1 to 1000"),
        (["live", "--url", URL, "--subscribers", "many"], "'many' is not an integer"),
        (["live", "--url", URL, "--rate", "0"], "--rate: must be above 0"),
        (["live", "--url", URL, "--rate", "nan"], "--rate: must be above 0"),
        (["live", "--url", URL, "--seconds", "-1"], "--seconds: must be above 0"),
        (["live", "--url", URL, "--batch", "201"], "--batch: must be from 1 to 200"),
        (["live", "--url", URL, "--device", "a b"], "is not a device name"),
        (["live", "--url", URL, "--rate", "0.1", "--seconds", "1"], "sends no event"),
        (["live", "--url", URL, "--rate", "10000", "--seconds", "3600", "--subscribers", "1000"], "deliveries"),
        (["live", "--url", URL, "--token", " "], "--token is empty"),
        (["live", "--url", URL, "--bogus"], "unrecognized arguments: --bogus"),
    ],
)
def test_bad_arguments_are_one_line(capsys, argv, words):
    err = usage_error(capsys, argv)
    assert err.startswith("python -m workers.sitebench") and "error:" in err and "(see --help)" in err
    assert words in err


def test_help_explains(capsys):
    with pytest.raises(SystemExit) as stop:
        parse_args(["live", "--help"])
    assert stop.value.code == 0
    out = capsys.readouterr().out
    for words in ("--subscribers", "--rate", "--batch", "createtoken", "cancelled", "lost", "outbox"):
        assert words in out


def test_unreachable_site_is_one_line(capsys):
    # Port 1 on the loopback: nothing listens there, so the run stops at its first request.
    assert main(["live", "--url", "http://127.0.0.1:1", "--token", "ast_x", "--quiet"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: cannot reach the site at http://127.0.0.1:1") and err.count("\n") == 1


def test_percentiles_are_nearest_rank():
    values = [i / 1000 for i in range(1, 101)]  # 1..100 ms
    assert latency_stats(values) == {"count": 100, "p50": 50.0, "p90": 90.0, "p99": 99.0, "max": 100.0}
    assert latency_stats([]) == {"count": 0, "p50": None, "p90": None, "p99": None, "max": None}


# -- the benchmark's runner: its one job, nothing started ------------------------------------------------------


def test_the_runner_accepts_its_one_job_notes_start_answers_cancel_and_refuses_the_rest():
    box = Outbox()
    runner = BenchRunner(box)
    runner.device = "bench-live"
    with pytest.raises(UserError, match="takes only job None"):  # not planned yet: nothing is expected
        runner.assign({"type": "assign", "job": 3, "rank": 0})
    runner.expected = 7
    reply = runner.assign({"type": "assign", "job": 7, "rank": 0})
    assert reply["type"] == "accepted" and reply["job"] == 7 and 0 < reply["port"] < 65536
    assert runner.assign({"type": "assign", "job": 7, "rank": 0}) == reply  # asked again after a reconnect
    assert (runner.state, runner.job) == ("busy", 7)
    with pytest.raises(UserError):
        runner.assign({"type": "assign", "job": 8, "rank": 0})
    with pytest.raises(UserError):
        runner.start({"type": "start", "job": 8})
    runner.start({"type": "start", "job": 7, "host": "127.0.0.1", "port": reply["port"]})
    assert runner.started.is_set() and not box.pending()  # no device process, no event of its own
    with pytest.raises(UserError, match="no device process"):
        runner.kill(7)
    runner.cancel(7)
    assert runner.cancelled.is_set() and (runner.state, runner.job) == ("idle", None)
    [stopped] = box.pending()
    assert stopped == {"seq": runner.stopped_seq, "job": 7, "event": stopped["event"]}
    assert stopped["event"]["type"] == "job-stopped" and stopped["event"]["reason"] == "cancelled"
    runner.shutdown()  # nothing left to stop
    assert len(box) == 1
    assert runner.unexpected == ["assign of job 3", "assign of job 8", "start of job 8", "kill of job 7"]


def test_a_rank_other_than_0_gets_no_port():
    runner = BenchRunner(Outbox())
    runner.expected = 5
    assert runner.assign({"type": "assign", "job": 5, "rank": 1}) == {"type": "accepted", "job": 5, "port": None}


# -- the agent: the real connection sends what is added at once, and batches what waits for an ack -------------


def serve(fake: FakeSite, scenario) -> None:
    """Run `scenario(agent)` with a BenchAgent connected to `fake` as device bench."""

    async def run() -> None:
        agent = BenchAgent(fake.site, "cred-bench")
        await agent.start()
        try:
            await scenario(agent)
        finally:
            await agent.close()

    asyncio.run(run())


def iteration(i: int) -> dict:
    return {"type": "iteration", "iteration": i, "loss": 1.0, "iteration_s": 0.1, "throughput": 1.0}


def test_an_added_event_is_sent_at_once_not_at_the_next_poll(monkeypatch):
    monkeypatch.setattr(connection, "ACK_WAIT_S", 60.0)  # a sender that polled would hold them for a minute
    with FakeSite({"bench": "cred-bench"}) as fake:

        async def scenario(agent):
            assert agent.name == "bench" and agent.sessions == 1
            for i in range(3):
                await asyncio.sleep(0.05)  # an idle connection, then one event
                seq = agent.outbox.add(1, iteration(i))
                assert await agent.until_acked(seq, 5.0), f"event {i} was not sent within 5 s"
            assert len(agent.outbox.ack_s) == 3 and max(s for _, s in agent.outbox.ack_s) < 5.0

        serve(fake, scenario)
        assert [e["iteration"] for e in fake.events("bench", "iteration")] == [0, 1, 2]


def test_a_site_slow_to_acknowledge_is_sent_no_more_than_a_window_of_messages():
    # (a sender that waited at most 0.2 s for each ack had five messages at a time on a site 1 s behind: the site's
    # queue for the socket filled, and the heartbeats behind it went unread)
    with FakeSite({"bench": "cred-bench"}, ack_delay_s=1.0) as fake:

        async def scenario(agent):
            for i in range(100):
                agent.outbox.add(1, iteration(i))
                await asyncio.sleep(0.01)
            assert await agent.until_acked(agent.outbox.last_seq, 10.0)

        serve(fake, scenario)
        assert [e["iteration"] for e in fake.events("bench", "iteration")] == list(range(100))
        assert 1 <= fake.most_unacked <= connection.WINDOW == 2


def test_events_added_while_a_message_awaits_its_ack_go_together():
    with FakeSite({"bench": "cred-bench"}) as fake:

        async def scenario(agent):
            def burst():  # a device's supervisor thread relaying a burst of events
                for i in range(200):
                    agent.outbox.add(1, iteration(i))

            thread = threading.Thread(target=burst)
            thread.start()
            await asyncio.to_thread(thread.join)
            assert await agent.until_acked(agent.outbox.last_seq, 5.0)

        started = time.monotonic()
        serve(fake, scenario)
        messages = [m for t, m in fake.messages("bench", "events") if t >= started]
        assert sum(len(m["events"]) for m in messages) == 200
        assert len(messages) <= 10, [len(m["events"]) for m in messages]  # not one message per event
