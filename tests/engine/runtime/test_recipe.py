"""The training recipe across the pipeline: AdamW with weight decay, warm-up and decay, clipping by the global norm
and frozen weights train exactly as one process does, also when a device is lost."""

from dataclasses import replace

import pytest
import torch

from engine import recipe
from engine.errors import UserError
from engine.models import get_model
from engine.runtime.faults import Faults, parse_fail
from engine.runtime.launcher import RunOptions, train
from tests.engine.runtime.helpers import cluster_of, make_plan, model_workload, reference_run

MODEL = "gpt-small"  # no BatchNorm, no dropout: every sample is computed on its own, so the result is exact
# a single-device stage, then two two-device stages with uneven shares
STAGES = [(0, 5, [("nx-0", 4)]), (5, 11, [("tx2-1", 3), ("nano-2", 1)]), (11, 15, [("nano-3", 1), ("tx2-4", 3)])]
BATCH, MICRO, ITERATIONS = 8, 2, 5
RECIPE = RunOptions(
    iterations=ITERATIONS, optimizer="adamw", lr=3e-3, weight_decay=0.1, lr_schedule="cosine", warmup=2,
    clip_grad_norm=0.5, emulate=False, save_model=True, timeout_s=60,
)  # fmt: skip


def _plan(schedule="1f1b"):
    cluster = cluster_of("nx", "tx2", "nano", "nano", "tx2")
    return make_plan(MODEL, cluster, BATCH, MICRO, STAGES).with_schedule(schedule)


def _worst(state, ref):
    assert state.keys() == ref.keys()
    return max((state[k] - ref[k]).abs().max().item() for k in ref)


def _adam_close(state, ref, lr):
    """Equal within 1e-5, but for the few weights whose gradient is of the order of its rounding noise (an
    embedding row of a token seen once, after clipping): Adam divides each gradient by its own running size, so
    the micro-batches' other summation order moves such a weight by a fraction of the learning rate. (SGD under
    the same schedule and clipping is equal within 1e-7; a lost step count or moment moves every weight by
    about the learning rate.)"""
    assert state.keys() == ref.keys()
    far = sum(int(((state[k] - ref[k]).abs() > 1e-5).sum()) for k in ref)
    assert far <= 1e-3 * sum(v.numel() for v in ref.values()), far
    assert _worst(state, ref) < lr / 2


@pytest.fixture(scope="module")
def one_process():
    return reference_run(MODEL, BATCH, ITERATIONS, RECIPE.lr, options=RECIPE)


def test_the_reference_is_clipped_and_decayed_so_the_comparison_means_something():
    spec = get_model(MODEL)
    torch.manual_seed(0)
    net = spec.sequential()
    x, y = spec.example_batch(BATCH)
    spec.loss(net(x), y).backward()
    norm = torch.nn.utils.get_total_norm([p.grad for p in net.parameters() if p.grad is not None])
    assert float(norm) > 2 * RECIPE.clip_grad_norm  # the clipping bites at the start
    factors = [recipe.lr_factor(k, ITERATIONS, "cosine", 2) for k in range(ITERATIONS)]
    assert factors[:2] == [0.5, 1.0] and factors[2] == 1.0 and 0 < factors[-1] < factors[3] < 1


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_adamw_warmup_cosine_and_global_clipping_train_as_one_process(one_process, schedule):
    ref_losses, ref_state = one_process
    result = train(_plan(schedule), model_workload(MODEL), replace(RECIPE, schedule=schedule))
    assert result.loss == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
    _adam_close(result.state_dict, ref_state, RECIPE.lr)


def test_sgd_under_the_schedule_and_clipping_is_equal_to_one_process():
    opts = replace(RECIPE, optimizer="sgd", lr=0.05)
    ref_losses, ref_state = reference_run(MODEL, BATCH, ITERATIONS, opts.lr, options=opts)
    result = train(_plan("zb-h1"), model_workload(MODEL), replace(opts, schedule="zb-h1"))
    assert result.loss == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
    assert _worst(result.state_dict, ref_state) < 1e-5


def test_a_device_lost_under_adamw_ends_with_the_same_weights(one_process):
    """The Adam moments and step counts travel with the replica and the restore: the replay steps as the lost
    device would have (a wrong step count or moment changes every weight it trains)."""
    ref_losses, ref_state = one_process
    result = train(_plan(), model_workload(MODEL), RECIPE, lambda ev: None, replicate_every=2,
                   faults=Faults(fail=(parse_fail("nx-0@4:forward"),)))  # fmt: skip
    assert len(result.generations) == 2
    assert result.loss == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
    _adam_close(result.state_dict, ref_state, RECIPE.lr)


def test_frozen_weights_get_no_step_and_the_rest_train_as_one_process():
    opts = replace(RECIPE, freeze=r"^[0-6]\.", clip_grad_norm=0.0)  # the embedding and the first blocks
    ref_losses, ref_state = reference_run(MODEL, BATCH, ITERATIONS, opts.lr, options=opts)
    events = []
    result = train(_plan("zb-h1"), model_workload(MODEL), replace(opts, schedule="zb-h1"), events.append)
    assert result.loss == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
    _adam_close(result.state_dict, ref_state, opts.lr)
    torch.manual_seed(0)
    start = get_model(MODEL).sequential().state_dict()
    frozen = [k for k in start if int(k.split(".")[0]) <= 6]
    moved = [k for k in start if k not in frozen and not torch.equal(start[k], result.state_dict[k])]
    assert frozen and all(torch.equal(start[k], result.state_dict[k]) for k in frozen) and moved
    # nx-0 holds layers 0-4, all frozen: no gradients and no optimizer state in its memory
    peak = {e["device"]: e["peak_memory_bytes"] for e in events if e["type"] == "device-done"}
    full = {e["device"]: e["peak_memory_bytes"] for e in _done_events(replace(opts, freeze="", schedule="zb-h1"))}
    assert peak["nx-0"] < full["nx-0"] and peak["nano-3"] == pytest.approx(full["nano-3"], rel=0.05)


def _done_events(opts):
    events = []
    train(_plan(opts.schedule), model_workload(MODEL), opts, events.append)
    return [e for e in events if e["type"] == "device-done"]


def test_a_frozen_backbone_is_planned_with_less_memory_and_no_weight_gradients():
    spec = get_model(MODEL)
    w = model_workload(MODEL)
    layers = spec.layers()
    full = recipe.trained_workload(w, layers, RunOptions(optimizer="adamw"))
    recipe.freeze(spec, layers, r"^[0-6]\.")
    tuned = recipe.trained_workload(w, layers, RunOptions(optimizer="adamw", freeze=r"^[0-6]\."))
    assert tuned.static_bytes(0, 7) < full.static_bytes(0, 7) and tuned.params(0, 7) == 0
    assert tuned.static_bytes(7, w.num_layers) == full.static_bytes(7, w.num_layers)
    assert tuned.backward(0, 7) < full.backward(0, 7) and tuned.backward(7, 15) == pytest.approx(full.backward(7, 15))


@pytest.mark.parametrize(
    "options, message",
    [
        ({"optimizer": "lamb"}, "optimizer must be one of sgd, adam, adamw"),
        ({"lr_schedule": "step"}, "lr schedule must be one of constant, linear, cosine"),
        ({"warmup": 11}, "warm-up must be at most the run's 10 iterations"),
        ({"freeze": "blocks.("}, "freeze: 'blocks.(' is no regular expression"),
        ({"clip_grad_norm": -1.0}, "clip grad norm must be from 0 to"),
        ({"weight_decay": -0.1}, "weight decay must be from 0 to"),
    ],
)
def test_a_bad_recipe_is_one_clear_error(options, message):
    with pytest.raises(UserError, match="^" + message.replace("(", r"\(").replace(".", r"\.")):
        RunOptions(**options)


def test_a_freeze_pattern_that_names_nothing_is_refused():
    spec = get_model(MODEL)
    with pytest.raises(UserError, match="names no parameter of gpt-small"):
        recipe.freeze(spec, spec.layers(), "^encoder")


def test_an_emulated_stage_whose_weights_are_all_frozen_calibrates_without_a_backward():
    """Its warm-up step has nothing to differentiate (the data takes no gradient, no weight is trained)."""
    from engine.runtime.stage import calibrated_clock

    spec = get_model(MODEL)
    layers = spec.layers()
    recipe.freeze(spec, layers, r"^[0-4]\.")
    module = torch.nn.Sequential(*layers[:5])
    clock = calibrated_clock(10.0, spec, module, 2, None, False, 0.1, 0.1, None, 0, 1, 0)
    assert clock.dilation == 10.0


def test_divergence_is_a_loss_that_is_no_number_or_a_held_out_loss_past_chance():
    chance = recipe.chance_loss(get_model(MODEL))
    assert chance == pytest.approx(9.011, abs=1e-3)  # ln 8192
    assert recipe.divergence({"type": "iteration", "loss": None}, chance) == "its training loss is not a number"
    assert recipe.divergence({"type": "iteration", "loss": 50.0}, chance) is None  # a spike is no verdict
    assert recipe.divergence({"type": "eval", "loss": 9.2}, chance) is None  # an untrained model's noise
    assert "past chance's 9.01" in recipe.divergence({"type": "eval", "loss": 9.65}, chance)


def test_a_run_that_diverges_says_so_and_stops_when_asked():
    from engine.runtime.coordinator import RunFailed

    events = []
    opts = RunOptions(iterations=6, optimizer="sgd", lr=10.0, dataset="pytext", eval_every=2, eval_samples=64,
                      stop_on_divergence=True, emulate=False, timeout_s=60)  # fmt: skip
    with pytest.raises(RunFailed, match="diverged at iteration [24] .*and stopped, as its options ask"):
        train(_plan(), model_workload(MODEL), opts, events.append)
    (said,) = [e for e in events if e["type"] == "diverged"]
    assert said["stopped"] and "past chance" in said["why"]
    assert max(e["iteration"] for e in events if e["type"] == "iteration") < 4


def test_lora_trains_the_adapters_as_one_process_and_saves_the_plain_module_with_them_merged():
    from engine.lora import merged

    opts = replace(RECIPE, optimizer="sgd", lr=0.05, lora=4, lora_targets="qkv|proj", freeze=".", clip_grad_norm=0)
    ref_losses, ref_state = reference_run(MODEL, BATCH, ITERATIONS, opts.lr, options=opts)
    result = train(_plan(), model_workload(MODEL), opts)
    assert result.loss == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
    torch.manual_seed(0)
    plain = get_model(MODEL).sequential()
    start = {k: v.clone() for k, v in plain.state_dict().items()}
    assert result.state_dict.keys() == start.keys()  # no adapter keys: the plain module's
    assert _worst(result.state_dict, merged(ref_state)) < 1e-5  # W + B A of the one-process run
    assert all(torch.equal(ref_state[k], start[k]) for k in start)  # the base weights themselves never moved
    changed = [k for k in start if not torch.equal(result.state_dict[k], start[k])]
    assert changed and all(".f.qkv.weight" in k or ".f.proj.weight" in k for k in changed)
    plain.load_state_dict(result.state_dict, strict=True)
    with pytest.raises(UserError, match="lora: gpt-small has nothing to adapt: no Linear layer's name matches"):
        reference_run(MODEL, BATCH, 1, 0.05, options=replace(opts, lora_targets="^conv"))


def test_bf16_trains_and_its_cuts_carry_half_the_bytes():
    opts = replace(RECIPE, optimizer="sgd", lr=0.05, clip_grad_norm=0.0, iterations=3, save_model=False)
    full = train(_plan(), model_workload(MODEL), opts)
    half = train(_plan(), model_workload(MODEL), replace(opts, precision="bf16"))
    assert half.payload_bytes == full.payload_bytes and half.wire_bytes * 2 == full.wire_bytes
    assert half.loss[-1] < half.loss[0] and half.loss == pytest.approx(full.loss, rel=1e-2)
    # the planner sees it: a 16-bit run's cuts cost half the bytes on the links
    w = model_workload(MODEL)
    planned = recipe.planned(w, replace(opts, precision="bf16"))
    assert planned.output_bytes[3] == w.output_bytes[3] // 2 and planned.wire(1000, 32) == 1000
    # ... and a compressed cut's codes are as many bytes as in a float32 run
    assert planned.wire(planned.output_bytes[3], 8) == pytest.approx(w.wire(w.output_bytes[3], 8), rel=1e-5)
