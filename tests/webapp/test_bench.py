"""`python -m webapp.bench`: its arguments and one-line errors, and its statistics (no site needed)."""

import pytest

from webapp import bench

URL = "http://127.0.0.1:18555"


def usage_error(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as stop:
        bench.parse_args(argv)
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err.strip()


def test_defaults():
    args = bench.parse_args(["live", "--url", URL])
    assert (args.subscribers, args.rate, args.seconds, args.batch) == (20, 100.0, 60.0, 1)
    assert (args.token, args.user, args.device, args.json) == (None, "admin", "bench-live", False)


def test_options_and_url_normalised():
    args = bench.parse_args(
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
    assert err.startswith("python -m webapp.bench") and "error:" in err and "(see --help)" in err
    assert words in err


def test_help_explains(capsys):
    with pytest.raises(SystemExit) as stop:
        bench.parse_args(["live", "--help"])
    assert stop.value.code == 0
    out = capsys.readouterr().out
    for words in ("--subscribers", "--rate", "--batch", "createtoken", "cancelled", "lost"):
        assert words in out


def test_unreachable_site_is_one_line(capsys):
    # Port 1 on the loopback: nothing listens there, so the run stops at its first request.
    assert bench.main(["live", "--url", "http://127.0.0.1:1", "--token", "ast_x", "--quiet"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: cannot reach the site at http://127.0.0.1:1") and err.count("\n") == 1


def test_percentiles_are_nearest_rank():
    values = [i / 1000 for i in range(1, 101)]  # 1..100 ms
    assert bench.latency_stats(values) == {"count": 100, "p50": 50.0, "p90": 90.0, "p99": 99.0, "max": 100.0}
    assert bench.latency_stats([]) == {"count": 0, "p50": None, "p90": None, "p99": None, "max": None}
