"""Job-page figures and table rows: real plans from the engine (quick cached profile) and hand-written plan JSON."""

import json

import pytest

from engine.devices import CLUSTERS, GIB, KINDS
from engine.plan import Prediction
from webapp.jobs import figures
from webapp.jobs.models import read_comparison, read_plan
from webapp.jobs.rows import comparison_rows, device_rows, predictions

MODEL = "mobilenetv2"


@pytest.fixture(scope="module")
def engine_plans(profile_cache):
    """Every compared method's plan for mobilenetv2 on cluster C at batch size 64, as plan JSON.

    `profile_cache` (tests/conftest.py) puts a quick real profile in a private cache first."""
    from engine.planners import COMPARED, NoFeasiblePlan, Problem, make_plan
    from engine.workloads import workload

    problem = Problem(workload(MODEL), CLUSTERS["C"], 64)
    plans = {}
    for method in COMPARED:
        try:
            plans[method] = make_plan(method, problem).to_dict()
        except NoFeasiblePlan as exc:
            plans[method] = {"error": f"no plan: {exc}"}
    assert "stages" in plans["asteroid"]
    return plans


@pytest.fixture(scope="module")
def simulated_steps(engine_plans):
    from engine.plan import Plan
    from engine.simulator import simulate
    from engine.workloads import workload

    plan = Plan.from_dict(engine_plans["asteroid"])
    return [e.to_dict() for e in simulate(plan, workload(MODEL)).events], plan.device_names


def custom_plan() -> dict:
    """A hand-written plan (Plan JSON contract): a custom device and a Nano whose predicted memory overflows."""
    return {
        "method": "asteroid",
        "model": MODEL,
        "batch_size": 32,
        "micro_batches": 4,
        "bandwidth_mbps": 1000,
        "stages": [
            {"layers": [0, 5], "devices": [{"name": "big", "samples": 6}, {"name": "nano-0", "samples": 2}]},
            {"layers": [5, 21], "devices": [{"name": "tx2-0", "samples": 8}]},
        ],
        "cluster": {
            "name": "lab",
            "bandwidth_mbps": 1000,
            "devices": [
                {"name": "big", "memory_gb": 6, "gflops": 900, "reserved_gb": 0.5},
                {"name": "nano-0", "kind": "jetson-nano"},
                {"name": "tx2-0", "kind": "jetson-tx2"},
                {"name": "spare", "kind": "jetson-nano"},
            ],
        },
        "predicted": {
            "iteration_s": 0.5,
            "throughput": 64.0,
            "bubble_fraction": 0.2,
            "memory_bytes": {"big": 2 * GIB, "nano-0": 3 * GIB, "tx2-0": GIB // 2},
            "fits": False,
        },
    }


def outcomes(comparison: dict) -> dict:
    """A stored comparison (plan JSON or {"error"} per method) as the figures and rows take it."""
    return predictions(read_comparison(comparison))


def plan_devices(plan: dict) -> list[tuple[int, dict, dict]]:
    return [(k, st, d) for k, st in enumerate(plan["stages"]) for d in st["devices"]]


def assert_plain_json(fig: dict) -> None:
    assert set(fig) == {"data", "layout"}
    text = json.dumps(fig)
    assert json.loads(text) == fig
    assert "bdata" not in text, "arrays must be plain lists, not base64 typed arrays"
    assert "mapbox" not in text and "http://" not in text and "https://" not in text


@pytest.mark.parametrize("method", ["asteroid", "dp", "gpipe", "pipedream", "ftpipehd"])
def test_pipeline_figure_has_every_device_once_with_its_layers_and_share(engine_plans, method):
    plan = engine_plans[method]
    if "error" in plan:
        pytest.skip(plan["error"])
    fig = figures.pipeline_figure(read_plan(plan))
    assert_plain_json(fig)
    mbs = plan["batch_size"] // plan["micro_batches"]
    by_device = {}
    for trace in fig["data"]:
        assert trace["type"] == "bar"
        name = trace["meta"]["device"]
        assert name not in by_device, f"{name} appears twice"
        by_device[name] = trace
    assert set(by_device) == {d["name"] for _, _, d in plan_devices(plan)}
    for k, st, dev in plan_devices(plan):
        trace = by_device[dev["name"]]
        start, end = st["layers"]
        assert trace["x"] == [f"stage {k}"]
        assert trace["y"] == [dev["samples"]]
        assert trace["meta"]["layers"] == [start, end]
        assert f"[{start}, {end})" in trace["hovertext"][0]
        assert f"{dev['samples']} of {mbs} samples" in trace["hovertext"][0]
        assert dev["name"] in trace["text"][0]
    layout = fig["layout"]
    assert layout["barmode"] == "stack"
    assert layout["yaxis"]["range"] == [0, mbs]
    assert layout["xaxis"]["title"]["text"] and layout["yaxis"]["title"]["text"]
    assert [t.split("<br>")[1] for t in layout["xaxis"]["ticktext"]] == [
        f"layers [{st['layers'][0]}, {st['layers'][1]})" for st in plan["stages"]
    ]


def test_pipeline_figure_colours_by_kind_and_names_unused_devices():
    plan = custom_plan()
    fig = figures.pipeline_figure(read_plan(plan))
    colour = {t["meta"]["device"]: t["marker"]["color"] for t in fig["data"]}
    assert colour["nano-0"] == figures.KIND_COLORS["jetson-nano"]
    assert colour["tx2-0"] == figures.KIND_COLORS["jetson-tx2"]
    assert colour["big"] == figures.KIND_COLORS["custom"]
    legend = sorted(t["name"] for t in fig["data"] if t["showlegend"])
    assert legend == ["Custom device", "Jetson Nano", "Jetson TX2"]
    big = next(t for t in fig["data"] if t["meta"]["device"] == "big")
    assert "[0, 5)" in big["text"][0] and "6 of 8 samples" in big["text"][0]
    assert any("spare" in a["text"] for a in fig["layout"]["annotations"])


def predicted_bars(fig: dict) -> dict[str, tuple[float, str, str]]:
    """The memory figure's predicted bars: device -> (GiB, its colour, its legend entry)."""
    bars = {}
    for trace in fig["data"][1:]:
        assert isinstance(trace["marker"]["color"], str), "one colour per trace: the legend shows it"
        for x, y in zip(trace["x"], trace["y"]):
            assert x not in bars, f"{x} drawn twice"
            bars[x] = (y, trace["marker"]["color"], trace["name"])
    return bars


def test_memory_figure_bars_are_predicted_gib_against_usable_capacity(engine_plans):
    plan = engine_plans["asteroid"]
    fig = figures.memory_figure(read_plan(plan))
    assert_plain_json(fig)
    capacity = fig["data"][0]
    names = [d["name"] for _, _, d in plan_devices(plan)]
    predicted = predicted_bars(fig)
    assert sorted(predicted) == sorted(names) and capacity["x"] == names
    assert fig["layout"]["xaxis"]["categoryarray"] == names  # in the plan's order, whatever the traces' order
    for name in names:
        assert predicted[name][0] == pytest.approx(plan["predicted"]["memory_bytes"][name] / 2**30)
    kinds = {d["name"]: d["kind"] for d in plan["cluster"]["devices"]}
    for name, cap in zip(names, capacity["y"]):
        kind = KINDS[kinds[name]]
        assert cap == pytest.approx(kind.memory_gb - kind.reserved_gb, abs=0.01)
    assert fig["layout"]["yaxis"]["title"]["text"] == "memory (GiB)"
    assert fig["layout"]["barmode"] == "overlay"


def test_memory_figure_custom_device_capacity_and_overflow():
    fig = figures.memory_figure(read_plan(custom_plan()))
    capacity = fig["data"][0]
    assert capacity["x"] == ["big", "nano-0", "tx2-0"]
    assert capacity["y"] == pytest.approx([5.5, 2.8, 6.5])
    predicted = predicted_bars(fig)
    assert {name: y for name, (y, _, _) in predicted.items()} == pytest.approx(
        {"big": 2.0, "nano-0": 3.0, "tx2-0": 0.5}
    )
    assert predicted["nano-0"][1] == figures.BAD  # 3 GiB on a Nano (2.8 usable)
    assert predicted["big"][1] == figures.KIND_COLORS["custom"]
    assert predicted["tx2-0"][1] == figures.KIND_COLORS["jetson-tx2"]


def test_memory_figure_legend_names_every_colour_of_its_bars():
    # Issue 52: the legend said "predicted peak memory" in green while the bars were coloured by kind.
    fig = figures.memory_figure(read_plan(custom_plan()))
    legend = {t["name"]: t["marker"]["color"] for t in fig["data"] if t.get("showlegend", True)}
    assert legend == {
        "usable memory": figures.NEUTRAL_FILL,
        "predicted peak, Custom device": figures.KIND_COLORS["custom"],
        "predicted peak, Jetson TX2": figures.KIND_COLORS["jetson-tx2"],
        "predicted peak, over usable memory": figures.BAD,
    }
    assert fig["layout"]["uniformtext"]["mode"] == "hide"  # a label too wide for its bar is left out, not overlapped


def test_memory_figure_without_prediction_says_so():
    plan = custom_plan()
    del plan["predicted"]
    fig = figures.memory_figure(read_plan(plan))
    assert any("no memory prediction" in a["text"] for a in fig["layout"]["annotations"])


def test_device_rows_match_the_plan():
    rows = device_rows(read_plan(custom_plan()))
    assert [r["device"] for r in rows] == ["big", "nano-0", "tx2-0"]
    big, nano, tx2 = rows
    assert big == {
        "device": "big",
        "kind": "custom",
        "kind_label": "Custom device",
        "stage": 0,
        "layers": "[0, 5)",
        "start": 0,
        "end": 5,
        "samples": 6,
        "micro_batch_size": 8,
        "memory_gib": 2.0,
        "capacity_gib": 5.5,
        "fits": True,
    }
    assert (nano["kind_label"], nano["samples"], nano["capacity_gib"], nano["fits"]) == ("Jetson Nano", 2, 2.8, False)
    assert (tx2["stage"], tx2["layers"], tx2["memory_gib"], tx2["fits"]) == (1, "[5, 21)", 0.5, True)


def test_device_rows_of_an_engine_plan(engine_plans):
    plan = engine_plans["asteroid"]
    rows = device_rows(read_plan(plan))
    assert [r["device"] for r in rows] == [d["name"] for _, _, d in plan_devices(plan)]
    assert all(r["fits"] for r in rows) == plan["predicted"]["fits"]
    for k in range(len(plan["stages"])):
        assert sum(r["samples"] for r in rows if r["stage"] == k) == plan["batch_size"] // plan["micro_batches"]


def comparison_with_error(engine_plans) -> dict:
    comparison = dict(engine_plans)
    comparison["gpipe"] = {"error": "no plan: gpipe needs one device per stage"}
    return comparison


def test_comparison_rows_give_speedup_or_error(engine_plans):
    comparison = comparison_with_error(engine_plans)
    rows = comparison_rows(outcomes(comparison))
    assert [r["method"] for r in rows] == ["asteroid", "dp", "gpipe", "pipedream", "ftpipehd"]
    # Rows show what the simulator expects (the plans come from make_plan, so each has its simulated time).
    ours = Prediction.from_dict(comparison["asteroid"]["predicted"]).expected_throughput
    for row in rows:
        doc = comparison[row["method"]]
        if "error" in doc:
            assert row["throughput"] is None and row["speedup"] is None
            assert row["error"] == "gpipe needs one device per stage"  # without the "no plan: " prefix
            continue
        assert row["error"] is None
        pred = doc["predicted"]
        assert pred["simulated_s"] > 0
        assert row["throughput"] == pytest.approx(doc["batch_size"] / pred["simulated_s"], abs=0.05)
        assert row["iteration_s"] == pytest.approx(pred["simulated_s"], abs=5e-5)
        assert row["speedup"] == pytest.approx(ours * pred["simulated_s"] / doc["batch_size"], abs=0.005)
    assert rows[0]["speedup"] == 1.0


def test_comparison_rows_accept_bare_predicted_blocks():
    rows = comparison_rows(
        {"asteroid": Prediction(0.64, 100.0, 0.0, {}, True), "dp": Prediction(0.0, 25.0, 0.0, {}, True)}
    )
    assert [(r["method"], r["throughput"], r["speedup"]) for r in rows] == [("asteroid", 100.0, 1.0), ("dp", 25.0, 4.0)]


def test_comparison_figure_highlights_asteroid_and_labels_missing_plans(engine_plans):
    comparison = comparison_with_error(engine_plans)
    fig = figures.comparison_figure(outcomes(comparison))
    assert_plain_json(fig)
    (bars,) = fig["data"]
    assert bars["orientation"] == "h"
    labels = {figures.METHOD_LABELS[m]: m for m in comparison}
    methods = [labels[y] for y in bars["y"]]
    assert "gpipe" not in methods
    assert methods == [m for m in comparison if "error" not in comparison[m]]
    expected = {m: Prediction.from_dict(comparison[m]["predicted"]).expected_throughput for m in methods}
    for m, x in zip(methods, bars["x"]):
        assert x == pytest.approx(expected[m], abs=0.05)
    colours = dict(zip(methods, bars["marker"]["color"]))
    assert colours["asteroid"] == figures.ACCENT
    assert all(c != figures.ACCENT for m, c in colours.items() if m != "asteroid")
    for m, text in zip(methods, bars["text"]):
        if m != "asteroid":
            assert f"{expected['asteroid'] / expected[m]:.2f}×" in text
    (note,) = fig["layout"]["annotations"]
    assert note["text"] == "no plan: gpipe needs one device per stage" and note["y"] == "GPipe"
    assert fig["layout"]["yaxis"]["categoryarray"] == [figures.METHOD_LABELS[m] for m in comparison]
    assert "samples/s" in fig["layout"]["xaxis"]["title"]["text"]


def test_comparison_figure_marks_a_plan_that_does_not_fit():
    plan = custom_plan()
    fig = figures.comparison_figure(outcomes({"asteroid": plan, "dp": {"error": "no plan: out of memory"}}))
    (bars,) = fig["data"]
    assert "does not fit" in bars["text"][0]
    assert fig["layout"]["annotations"][0]["text"] == "no plan: out of memory"
    assert comparison_rows({"dp": "does not fit in memory"})[0]["error"] == "does not fit in memory"


def test_timeline_figure_has_one_bar_per_step_from_start_to_end(simulated_steps):
    steps, devices = simulated_steps
    fig = figures.timeline_figure(steps, devices, "Simulated 1F1B iteration")
    assert_plain_json(fig)
    bars = [(y, x, base, text) for t in fig["data"] for y, x, base, text in zip(t["y"], t["x"], t["base"], t["text"])]
    assert len(bars) == len(steps)
    by_group = {t["name"]: t for t in fig["data"]}
    assert set(by_group) <= set(figures.STEP_COLORS)
    for t in fig["data"]:
        assert t["type"] == "bar" and t["orientation"] == "h"
        assert t["marker"]["color"] == figures.STEP_COLORS[t["name"]]
    forward = [s for s in steps if s["kind"] == "F"]
    assert by_group["forward"]["base"] == pytest.approx([s["start"] for s in forward])
    assert by_group["forward"]["x"] == pytest.approx([s["end"] - s["start"] for s in forward])
    assert by_group["forward"]["y"] == [s["device"] for s in forward]
    assert by_group["forward"]["text"] == [str(s["micro_batch"]) for s in forward]
    assert sorted(b for _, _, b, _ in bars) == pytest.approx(sorted(s["start"] for s in steps))
    assert sorted(b + x for _, x, b, _ in bars) == pytest.approx(sorted(s["end"] for s in steps))
    yaxis = fig["layout"]["yaxis"]
    assert yaxis["categoryarray"] == devices and yaxis["autorange"] == "reversed"  # first device on top
    assert fig["layout"]["barmode"] == "overlay"
    assert fig["layout"]["title"]["text"] == "Simulated 1F1B iteration"
    assert "(s)" in fig["layout"]["xaxis"]["title"]["text"]


def step(device: str, stage: int, micro_batch: int, kind: str, start: float, end: float, peer: str = "") -> dict:
    return {
        "device": device,
        "stage": stage,
        "micro_batch": micro_batch,
        "kind": kind,
        "start": start,
        "end": end,
        "peer": peer,
        "iteration": 0,
    }


def test_timeline_figure_groups_transfers_and_all_reduce():
    steps = [
        step("a", 0, 0, "F", 0.0, 0.1),
        step("a", 0, 0, "send", 0.1, 0.12, "b"),
        step("b", 1, 0, "recv", 0.1, 0.12, "a"),
        step("b", 1, 0, "B", 0.2, 0.4),
        step("b", 1, -1, "all-reduce", 0.4, 0.5),
    ]
    fig = figures.timeline_figure(steps, ["b", "a"], "t")
    by_group = {t["name"]: t for t in fig["data"]}
    assert by_group["transfer"]["y"] == ["a", "b"] and by_group["transfer"]["text"] == ["", ""]
    assert by_group["all-reduce"]["base"] == [0.4] and by_group["all-reduce"]["text"] == [""]
    assert by_group["backward"]["text"] == ["0"]
    assert fig["layout"]["yaxis"]["categoryarray"] == ["b", "a"]
    assert "to b" in by_group["transfer"]["hovertext"][0] and "from a" in by_group["transfer"]["hovertext"][1]


def test_timeline_figure_without_steps_says_so():
    fig = figures.timeline_figure([], ["a", "b"], "Live")
    assert fig["data"] == []
    assert fig["layout"]["annotations"][0]["text"] == "no steps yet"
    assert fig["layout"]["yaxis"]["categoryarray"] == ["a", "b"]


EVIL = '<a href="http://evil.example">x</a>'
SHOWN = "&lt;a href=&quot;http://evil.example&quot;&gt;x&lt;/a&gt;"  # Plotly prints the entities as the text


def test_names_are_escaped_before_plotly_reads_them_as_markup():
    # Device names went into Plotly's text, hover texts and tick labels as they were: a device named `<a href=...>`
    # showed a link on the plan and live pages.
    plan = json.loads(json.dumps(custom_plan()).replace('"big"', json.dumps(EVIL)))
    steps = [step(EVIL, 0, 0, "send", 0.0, 0.1, EVIL), step("tx2-0", 1, 0, EVIL, 0.1, 0.2)]
    made = [
        figures.pipeline_figure(read_plan(plan)),
        figures.memory_figure(read_plan(plan)),
        figures.comparison_figure(outcomes({"asteroid": plan, "dp": {"error": f"no plan: {EVIL} is too slow"}})),
        figures.timeline_figure(steps, [EVIL, "tx2-0"], "t"),
    ]
    for fig in made:
        for trace in fig["data"]:
            trace.pop("meta", None)  # keeps the raw name for scripts: Plotly does not print it
        text = json.dumps(fig)
        assert "<a " not in text and SHOWN in text, text
    transfers = made[3]["data"][0]
    assert made[3]["layout"]["yaxis"]["categoryarray"] == [SHOWN, "tx2-0"] and transfers["y"] == [SHOWN, "tx2-0"]
    assert f"{SHOWN} · send" in transfers["hovertext"][0] and f"to {SHOWN}" in transfers["hovertext"][0]
    assert f"tx2-0 · {SHOWN}" in transfers["hovertext"][1]  # an unknown step kind, as the agent sent it
