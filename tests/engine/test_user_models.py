"""A lab's own module (`--model FILE.py:FUNCTION`): captured as a graph and cut into a chain whose cuts carry every
value live across them; pipelined it trains exactly as the module does in one process, starts from the lab's
weights and comes back in the module's own keys; what cannot be used is one line."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest
import torch

from engine.data import get_dataset
from engine.errors import UserError
from engine.models import get_model
from engine.models.source import reference
from engine.runtime.batches import batch_indices, load
from engine.runtime.faults import Faults, parse_fail
from engine.runtime.launcher import RunOptions, train
from tests.engine.clirun import run
from tests.engine.runtime.helpers import cluster_of, make_plan, model_workload

FILE = Path(__file__).with_name("usermodels.py")
MODELS = {
    "resnet": "3,16,16",
    "unet": "3,16,16",
    "vit": "3,16,16",
    "tiny_lm": 16,
    "tied_lm": 16,
    "branchy_chain": "3,4,4",
}


def ref_of(function: str) -> str:
    shape = MODELS[function]
    return reference(f"{FILE}:{function}", *((shape, None) if isinstance(shape, str) else (None, shape)))


def users(function: str):
    """The lab's own function, imported as its code would."""
    spec = importlib.util.spec_from_file_location("lab_models", FILE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, function)


def one_process(function: str, batch: int, iterations: int, lr: float = 0.05, init: dict | None = None):
    """The lab's module trained alone on the run's batches (SGD, momentum 0.9): (losses, state_dict)."""
    spec = get_model(ref_of(function))
    torch.manual_seed(0)
    net = users(function)()
    if init is not None:
        net.load_state_dict(init, strict=True)
    opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    data = get_dataset("synthetic", spec, size=2048, seed=0)
    losses = []
    for k in range(iterations):
        x, y = load(data, batch_indices(len(data), batch, 0, k))
        loss = spec.loss(net(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, net.state_dict()


@pytest.mark.parametrize("function", list(MODELS))
def test_the_chain_computes_what_the_module_computes(function):
    spec = get_model(ref_of(function))
    torch.manual_seed(0)
    layers = spec.layers()
    torch.manual_seed(0)
    module = users(function)()
    x, _ = spec.example_batch(3)
    y = x
    for layer in layers:
        y = layer(y)
    assert (y - module(x)).abs().max().item() < 1e-5
    assert len(layers) >= 3  # cut, not one piece
    keys = [k for layer in layers for k in layer.state_dict()]
    assert set(keys) == set(module.state_dict())  # the module's own names, each held where it is used


def test_a_long_skip_makes_the_cuts_inside_it_carry_two_tensors_and_integers_are_never_compressed():
    unet = get_model(ref_of("unet"))
    assert [len(c) for c in unet.chain.cuts] == [1, 2, 2, 1, 1]
    assert [v.shape for v in unet.chain.cuts[1]] == [(8, 16, 16), (16, 8, 8)]  # the skip and the way down
    lm = get_model(ref_of("tiny_lm"))
    assert lm.task == "language-modeling" and lm.vocab_size == 300 and lm.input_dtype == "int64"
    assert all(unet.compressible(b) for b in range(1, len(unet.chain.spans)))


def _trained(function, stages, devices, batch=8, micro=2, iterations=3, faults=None, init=None):
    model = ref_of(function)
    plan = make_plan(model, cluster_of(*devices), batch, micro, stages)
    options = RunOptions(iterations=iterations, emulate=False, save_model=True, timeout_s=60, init=init)
    return train(plan, model_workload(model), options, faults=faults or Faults(), replicate_every=1)


def _close(result, losses, state):
    from engine.models.weights import user_keys

    assert result.loss == pytest.approx(losses, rel=1e-5, abs=1e-6)
    mine = user_keys(get_model(result.plan.model), result.state_dict)
    assert mine.keys() == state.keys()
    for k in state:
        torch.testing.assert_close(mine[k], state[k], rtol=0, atol=1e-5)


def test_a_unet_cut_at_every_layer_one_device_a_stage_trains_as_one_process():
    stages = [(k, k + 1, [(f"nano-{k}", 4)]) for k in range(6)]  # GPipe's shape: every cut used
    result = _trained("unet", stages, ["nano"] * 6)
    _close(result, *one_process("unet", 8, 3))


def test_a_vit_on_uneven_shares_loses_a_device_and_still_trains_as_one_process():
    stages = [(0, 3, [("nx-0", 3), ("tx2-1", 1)]), (3, 6, [("tx2-2", 2), ("nano-3", 2)])]
    result = _trained("vit", stages, ["nx", "tx2", "tx2", "nano"], iterations=4,
                      faults=Faults(fail=(parse_fail("tx2-1@3:backward"),)))  # fmt: skip
    assert len(result.generations) == 2 and "tx2-1" not in result.devices
    _close(result, *one_process("vit", 8, 4))


@pytest.mark.parametrize(
    "stages",
    [
        [(0, 2, [("nx-0", 3), ("tx2-1", 1)]), (2, 5, [("tx2-2", 2), ("nano-3", 2)])],  # a copy on each stage
        [(0, 5, [("nx-0", 3), ("tx2-1", 1)])],  # both names on one stage of two devices: one weight, reduced once
    ],
    ids=["two-stages", "one-stage"],
)
def test_tied_embeddings_train_as_one_parameter(stages):
    lm = get_model(ref_of("tied_lm"))
    assert lm.chain.ties == (((0, "embed.weight"), (len(lm.chain.spans) - 1, "head.weight")),)
    result = _trained("tied_lm", stages, ["nx", "tx2", "tx2", "nano"])
    _close(result, *one_process("tied_lm", 8, 3))


# one_process's recipe: a language model otherwise brings its own (AdamW, warm-up, cosine, clipping)
SGD = ("--optimizer", "sgd", "--lr", "0.05", "--weight-decay", "0", "--warmup", "0", "--lr-schedule", "constant",
       "--clip-grad-norm", "0")  # fmt: skip


def test_init_then_save_round_trip_into_the_users_module(tmp_path, capsys, profile_cache):
    from safetensors.torch import load_file

    torch.manual_seed(7)
    start = users("tiny_lm")().state_dict()  # the lab's pretrained weights (another seed's)
    torch.save(start, tmp_path / "start.pt")
    out = tmp_path / "trained.safetensors"
    code, _, err = run(capsys, "train", "--model", f"{FILE}:tiny_lm", "--seq-len", "16", "--cluster", "D",
                       "--batch-size", "8", "--iterations", "2", "--init", str(tmp_path / "start.pt"),
                       "--save", str(out), "--run-dir", str(tmp_path / "run"), "--json",
                       *SGD)  # fmt: skip
    assert code == 0, err
    saved = load_file(out)
    module = users("tiny_lm")()
    module.load_state_dict(saved, strict=True)  # the lab's own code reads it
    _, expected = one_process("tiny_lm", 8, 2, init=start)
    for k in expected:  # (its causal mask holds -inf)
        torch.testing.assert_close(saved[k], expected[k], rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "nowhere.py:f", "--input-shape", "3,8,8"], "model file"),
        (["--model", f"{FILE}:nothing", "--input-shape", "3,8,8"], f"model file {FILE} has no function nothing"),
        (["--model", f"{FILE}:raises", "--input-shape", "3,8,8"], "raises() in"),
        (["--model", f"{FILE}:not_a_module", "--input-shape", "3,8,8"], "returned a int, not an nn.Module"),
        (["--model", f"{FILE}:branchy", "--input-shape", "4"], "cannot capture the module's graph"),
        (["--model", f"{FILE}:not_a_chain", "--input-shape", "4"], "they do not compute what the module does"),
        (["--model", f"{FILE}:resnet", "--input-shape", "5,16,16"], "the module rejects an input of shape (5, 16, 16)"),
        (["--model", f"{FILE}:resnet"], "give its input, --input-shape C,H,W"),
        (["--model", f"{FILE}:resnet", "--input-shape", "3,x"], "--input-shape must be up to four positive"),
    ],
)
def test_a_module_that_cannot_be_used_is_one_line(capsys, argv, message):
    code, out, err = run(capsys, "plan", *argv, "--cluster", "D", "--batch-size", "8")
    assert code == 2 and out == ""
    assert err.startswith("error: ") and message in err and len(err.strip().splitlines()) == 1, err


def test_weights_that_do_not_match_are_one_line_naming_the_keys(tmp_path, capsys, profile_cache):
    state = users("resnet")().state_dict()
    state["extra.weight"] = state.pop("head.weight")
    torch.save(state, tmp_path / "w.pt")
    code, _, err = run(capsys, "train", "--model", f"{FILE}:resnet", "--input-shape", "3,16,16", "--cluster", "D",
                       "--batch-size", "8", "--iterations", "1", "--init", str(tmp_path / "w.pt"))  # fmt: skip
    assert code == 2
    assert "missing head.weight; unexpected extra.weight" in err and len(err.strip().splitlines()) == 1, err
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(UserError, match="cannot read weights file"):
        from engine.models.weights import read_state

        read_state(tmp_path / "junk.pt")


# -- Hugging Face folders -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gpt2_folder(tmp_path_factory):
    """A GPT-2 of a small local config (no dropout: the captured graph has none), no weights: built fresh."""
    from transformers import GPT2Config

    folder = tmp_path_factory.mktemp("gpt2")
    GPT2Config(vocab_size=300, n_positions=32, n_embd=32, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0,
               resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
               architectures=["GPT2LMHeadModel"]).save_pretrained(folder)  # fmt: skip
    return folder


def hf_one_process(folder, batch: int, iterations: int, init: dict | None = None, auto: str = "AutoModelForCausalLM"):
    import transformers

    spec = get_model(reference(f"hf:{folder}", seq_len=16))
    torch.manual_seed(0)
    config = transformers.AutoConfig.from_pretrained(folder)
    config.use_cache = False
    net = getattr(transformers, auto).from_config(config)
    if init is not None:
        net.load_state_dict(init, strict=True)
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    data = get_dataset("synthetic", spec, size=2048, seed=0)
    losses = []
    for k in range(iterations):
        x, y = load(data, batch_indices(len(data), batch, 0, k))
        loss = spec.loss(net(input_ids=x).logits, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, net.state_dict()


def test_a_hugging_face_gpt2_cut_at_every_layer_trains_as_one_process(gpt2_folder):
    ref = reference(f"hf:{gpt2_folder}", seq_len=16)
    spec = get_model(ref)
    n = len(spec.chain.spans)
    assert spec.task == "language-modeling" and n >= 5 and spec.chain.ties  # the tied embedding and head
    # what the graph makes (arange, to) is made where each layer's input is, a GPU too, not where it was traced
    layers = [layer for layer in spec.layers() if hasattr(layer, "graph")]
    made = [n for layer in layers for n in layer.graph.nodes if "device" in n.kwargs]
    assert made and not [n for n in made if isinstance(n.kwargs["device"], torch.device)], made
    stages = [(k, k + 1, [(f"nano-{k}", 4)]) for k in range(n)]
    plan = make_plan(ref, cluster_of(*["nano"] * n), 8, 2, stages)
    options = RunOptions(iterations=3, emulate=False, save_model=True, timeout_s=60)
    result = train(plan, model_workload(ref), options, replicate_every=1)
    _close(result, *hf_one_process(gpt2_folder, 8, 3))


def test_a_hugging_face_sequence_classifier_carries_its_token_ids_to_the_last_stage(tmp_path):
    """GPT-2's classifier scores the last token before the padding: the ids travel beside the activations to the
    last stage, as integers, on a cut never compressed."""
    from transformers import GPT2Config

    GPT2Config(vocab_size=300, n_positions=32, n_embd=32, n_layer=2, n_head=4, pad_token_id=0, num_labels=5,
               resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
               architectures=["GPT2ForSequenceClassification"]).save_pretrained(tmp_path)  # fmt: skip
    ref = reference(f"hf:{tmp_path}", seq_len=16)
    spec = get_model(ref)
    assert spec.task == "classification" and spec.num_classes == 5
    n = len(spec.chain.spans)
    assert not spec.compressible(n - 1) and any(v.dtype == torch.int64 for v in spec.chain.cuts[-1])
    stages = [(0, n // 2, [("nx-0", 3), ("tx2-1", 1)]), (n // 2, n, [("tx2-2", 4)])]
    plan = make_plan(ref, cluster_of("nx", "tx2", "tx2"), 8, 2, stages)
    options = RunOptions(iterations=3, emulate=False, save_model=True, timeout_s=60)
    result = train(plan, model_workload(ref), options, replicate_every=1)
    _close(result, *hf_one_process(tmp_path, 8, 3, auto="AutoModelForSequenceClassification"))


def test_a_hugging_face_model_comes_back_as_a_folder_from_pretrained_reads(gpt2_folder, tmp_path, capsys,
                                                                          profile_cache):  # fmt: skip
    from transformers import AutoModelForCausalLM

    code, _, err = run(capsys, "train", "--model", f"hf:{gpt2_folder}", "--seq-len", "16", "--cluster", "D",
                       "--batch-size", "8", "--iterations", "2", "--save", str(tmp_path / "trained"),
                       "--run-dir", str(tmp_path / "run"), "--json", *SGD)  # fmt: skip
    assert code == 0, err
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "trained", local_files_only=True)
    _, expected = hf_one_process(gpt2_folder, 8, 2)
    for k, v in back.state_dict().items():
        torch.testing.assert_close(v, expected[k], rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    ("files", "message"),
    [({}, "has no config.json"), ({"config.json": "{not json"}, "cannot read config.json")],
)
def test_a_folder_that_is_not_a_hugging_face_model_is_one_line(tmp_path, capsys, files, message):
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    code, _, err = run(capsys, "plan", "--model", f"hf:{tmp_path}", "--seq-len", "16", "--cluster", "D",
                       "--batch-size", "8")  # fmt: skip
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_a_folder_with_a_tokenizer_reads_text_as_its_token_ids(gpt2_folder, tmp_path, capsys, profile_cache):
    """The folder's own tokenizer (a word-level one made here: nothing is downloaded) turns a text file into the
    ids the model was made for; without one, text is bytes."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    folder = tmp_path / "with-tokenizer"
    shutil.copytree(gpt2_folder, folder)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(" ".join(f"word{k % 97} and{k % 13}" for k in range(4000)))
    raw = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    raw.train([str(corpus)], trainers.WordLevelTrainer(vocab_size=200, special_tokens=["[UNK]"]))
    PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="[UNK]").save_pretrained(folder)
    spec = get_model(reference(f"hf:{folder}", seq_len=16))
    assert spec.tokenizer == str(folder)
    data = get_dataset("text", spec, root=corpus)
    x, y = data[0]
    expected = raw.encode(corpus.read_text()).ids
    assert x.tolist() == expected[:16] and y.tolist() == expected[1:17]  # token ids, not bytes
    code, _, err = run(capsys, "train", "--model", f"hf:{folder}", "--seq-len", "16", "--cluster", "D",
                       "--batch-size", "8", "--iterations", "1", "--dataset", "text", "--data-dir", str(corpus),
                       "--run-dir", str(tmp_path / "run"))  # fmt: skip
    assert code == 0, err


def test_an_input_not_given_is_what_the_folder_or_the_dataset_makes_known(gpt2_folder):
    assert reference(f"hf:{gpt2_folder}").endswith("@text:32")  # its config's n_positions
    assert reference(f"{FILE}:tiny_lm", dataset="pytext").endswith("@text:128")
    assert reference(f"{FILE}:resnet", dataset="cifar10").endswith("@image:3,32,32")
    with pytest.raises(UserError, match="give its input, --input-shape C,H,W for images or --seq-len N for text"):
        reference(f"{FILE}:resnet", dataset="synthetic")


def test_a_module_fx_cannot_trace_is_cut_at_its_children_when_they_form_a_chain():
    from engine.models.children import Children

    spec = get_model(ref_of("branchy_chain"))
    assert isinstance(spec.chain, Children) and spec.chain.names == ("0:0", "1:1", "2:2", "3:3", "4:4")
    stages = [(0, 2, [("nx-0", 4)]), (2, 5, [("tx2-1", 4)])]
    result = _trained("branchy_chain", stages, ["nx", "tx2"])
    _close(result, *one_process("branchy_chain", 8, 3))


@pytest.mark.parametrize("function", ["resnet", "unet", "vit"])
def test_the_asteroid_planner_s_plan_of_a_users_module_trains_as_one_process(function):
    from engine.planners import Problem
    from engine.planners import make_plan as plan_with
    from engine.workloads import workload

    model = ref_of(function)
    plan = plan_with("asteroid", Problem(workload(model), cluster_of("nx", "tx2", "nano", "nano"), 16))
    options = RunOptions(iterations=2, emulate=False, save_model=True, timeout_s=60)
    result = train(plan, model_workload(model), options, replicate_every=1)
    _close(result, *one_process(function, 16, 2))


@pytest.mark.parametrize("fail", [None, "nano-1@3:forward"])
def test_an_fp16_overflow_skips_the_step_on_every_stage_as_a_grad_scaler_does(tmp_path, fail):
    """Weights three times too large overflow fp16's scaled gradients in the first iteration: every stage skips
    that step and halves the scale, as torch.amp.GradScaler does in one process, then steps as it does. A device
    lost later leaves the others on the scale they agreed."""
    spec = get_model(ref_of("unet"))
    torch.manual_seed(0)
    start = {k: v * 3 for k, v in users("unet")().state_dict().items()}
    torch.save(start, tmp_path / "large.pt")
    stages = [(0, 2, [("nano-0", 8)]), (2, 4, [("nano-1", 8)]), (4, 6, [("nano-2", 8)])]
    # one micro-batch: an overflow is of the fp16 gradients of the samples a backward takes at once
    plan = make_plan(ref_of("unet"), cluster_of("nano", "nano", "nano"), 8, 1, stages)
    options = RunOptions(iterations=4, optimizer="sgd", lr=1e-4, precision="fp16", emulate=False, save_model=True,
                         timeout_s=60, init=str(tmp_path / "large.pt"))  # fmt: skip
    events = []
    faults = Faults(fail=(parse_fail(fail),)) if fail else Faults()
    result = train(plan, model_workload(plan.model), options, events.append, faults=faults, replicate_every=1)
    assert len(result.generations) == (2 if fail else 1)
    its = sorted(result.iterations, key=lambda e: e["iteration"])

    net = users("unet")()
    net.load_state_dict(start, strict=True)
    opt, scaler = torch.optim.SGD(net.parameters(), lr=1e-4, momentum=0.9), torch.amp.GradScaler("cpu")
    data = get_dataset("synthetic", spec, size=2048, seed=0)
    skipped = []
    for k in range(4):
        x, y = load(data, batch_indices(len(data), 8, 0, k))
        with torch.autocast("cpu", dtype=torch.float16):
            loss = spec.loss(net(x), y)
        scaler.scale(loss).backward()
        before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        skipped.append(scaler.get_scale() < before)
    assert skipped == [True, False, False, False]
    assert [e["skipped"] for e in its] == skipped and its[-1]["loss_scale"] == scaler.get_scale() == 2.0**15
    from engine.models.weights import user_keys

    mine, ref = user_keys(spec, result.state_dict), net.state_dict()
    moved = max((ref[k] - start[k]).abs().max().item() for k in ref)
    assert max((mine[k] - ref[k]).abs().max().item() for k in ref) < 0.05 * moved  # fp16's rounding, not a lost step
