"""A user's module as the chain of layers the planner cuts: its torch.fx graph, grouped at the points where every
value live across is a per-sample tensor; each cut carries its whole live set, packed into one tensor per sample.

    chain = capture(module, example)       # example: a batch of 2 samples of the module's input
    layers = chain.layers(module)          # nn.Modules, each one packed tensor in, one out; last: the output

Why torch.fx and not torch.export: `symbolic_trace` keeps each `nn.Module` call as one node, so a layer's
parameters keep the user's own names (`layer1.0.conv1.weight`): the stages' state dicts speak the user's keys
without a map, and the layer list reads like the module. A value that does not depend on the input (a causal
mask, `torch.arange`) is recomputed by each layer that needs it rather than sent. A cut is never placed where a
value without a batch dimension (a shape, a Python number) is live, nor between two uses of one parameter or
module (weights shared across a cut would need copies kept equal: not done yet, so such a model gets fewer
cuts; a buffer read as an attribute, a mask, is copied into each layer that reads it). Integer values
crossing a cut travel as float32 (exact below 2**24) and their cut is never compressed.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import torch
from torch import fx, nn
from torch.utils.flop_counter import FlopCounterMode

from engine.errors import UserError

MAX_LAYERS = 48  # the chain's length at most: the exact planner's search stays in seconds below this


@dataclass(frozen=True)
class Value:
    """A value live across a cut: its graph node, per-sample shape and dtype."""

    node: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def size(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Chain:
    """The module's graph cut into layers: layer i runs `spans[i]` (positions in the order of the input's
    dependants) and receives `cuts[i - 1]` (layer 0 receives the module's input)."""

    spans: tuple[tuple[int, int], ...]
    cuts: tuple[tuple[Value, ...], ...]
    names: tuple[str, ...]  # a readable label per layer: the modules it calls

    def layers(self, module: nn.Module) -> list[nn.Module]:
        """Fresh layers of `module` (built like the captured one: the same graph): its own parameters, shared."""
        gm = trace(module)
        return [self._layer(gm, i) for i in range(len(self.spans))]

    def exact(self, boundary: int) -> bool:
        """Whether cut `boundary` (between layer boundary-1 and boundary) carries an integer value."""
        return any(not v.dtype.is_floating_point for v in self.cuts[boundary - 1])

    def _layer(self, gm: fx.GraphModule, i: int) -> nn.Module:
        order, constant = _order(gm.graph)
        a, b = self.spans[i]
        mine = set(order[a:b] if a else order[1:b])
        need: set[fx.Node] = set()
        for n in mine:  # the input-independent values these nodes use: recomputed here
            need |= _constant_ancestors(n, constant)
        graph = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        if a == 0:
            env[order[0]] = graph.placeholder(order[0].name)
        else:
            packed = graph.placeholder("packed")
            offset = 0
            for v in self.cuts[i - 1]:
                node = next(n for n in order if n.name == v.node)
                part = graph.call_function(operator.getitem, (packed, (slice(None), slice(offset, offset + v.size))))
                part = graph.call_method("reshape", (part, (-1, *v.shape)))
                env[node] = graph.call_method("to", (part, v.dtype)) if v.dtype != torch.float32 else part
                offset += v.size
        for n in gm.graph.nodes:
            if n in mine or n in need:
                env[n] = graph.node_copy(n, lambda x: env[x])
        if i == len(self.spans) - 1:
            graph.output(env[_result(gm.graph)])
        else:
            parts = []
            for v in self.cuts[i]:
                node = next(n for n in order if n.name == v.node)
                flat = graph.call_method("flatten", (env[node], 1))
                parts.append(graph.call_method("to", (flat, torch.float32)) if v.dtype != torch.float32 else flat)
            graph.output(parts[0] if len(parts) == 1 else graph.call_function(torch.cat, (parts, 1)))
        graph.lint()
        layer = fx.GraphModule(gm, graph, class_name="Layer")
        layer.label = self.names[i]
        return layer


def trace(module: nn.Module) -> fx.GraphModule:
    """The module's graph (a one-line UserError naming the construct when torch.fx cannot follow it)."""
    try:
        return fx.symbolic_trace(module)
    except Exception as exc:  # fx raises TraceError, TypeError, NotImplementedError... from the user's code
        first = next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), type(exc).__name__)
        raise UserError(
            f"cannot capture the module's graph ({first[:200]}): Python control flow on tensor values cannot be "
            "traced; move it into a submodule whose children form a chain, or make it depend on shapes only"
        ) from None


def _order(graph: fx.Graph) -> tuple[list[fx.Node], set[fx.Node]]:
    """The nodes that depend on the input, in graph order (the input first), and the set of those that do not."""
    depends: set[fx.Node] = set()
    order = []
    for n in graph.nodes:
        if n.op == "output":
            continue
        if n.op == "placeholder" or any(a in depends for a in n.all_input_nodes):
            depends.add(n)
            order.append(n)
    constant = {n for n in graph.nodes if n.op != "output" and n not in depends}
    return order, constant


def _constant_ancestors(node: fx.Node, constant: set[fx.Node]) -> set[fx.Node]:
    found: set[fx.Node] = set()
    stack = [a for a in node.all_input_nodes if a in constant]
    while stack:
        n = stack.pop()
        if n not in found:
            found.add(n)
            stack += [a for a in n.all_input_nodes if a in constant]
    return found


def _result(graph: fx.Graph) -> fx.Node:
    """The node of the module's output: a tensor, the first of a tuple, or `logits` of a dict."""
    out = next(n for n in graph.nodes if n.op == "output").args[0]
    if isinstance(out, (tuple, list)) and out:
        out = out[0]
    elif isinstance(out, dict):
        out = out.get("logits", next(iter(out.values()), None))
    if not isinstance(out, fx.Node):
        raise UserError("the module's output is not a tensor (nor a tuple or dict holding one first, or `logits`)")
    return out


class _Recorder(fx.Interpreter):
    """Runs the graph once, keeping every node's value and the FLOPs of its forward."""

    def __init__(self, gm: fx.GraphModule):
        super().__init__(gm)
        self.values: dict[fx.Node, object] = {}
        self.flops: dict[fx.Node, float] = {}

    def run_node(self, n: fx.Node):
        with FlopCounterMode(display=False) as counter:
            out = super().run_node(n)
        self.values[n], self.flops[n] = out, float(counter.get_total_flops())
        return out


def capture(module: nn.Module, example: torch.Tensor, max_layers: int = MAX_LAYERS) -> Chain:
    """Cut `module` into a chain of at most `max_layers` layers of about equal forward FLOPs, at the points where
    a cut is possible. `example`: an input batch of 2 samples (the batch dimension is found by also running 3)."""
    gm = trace(module)
    order, constant = _order(gm.graph)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != 1:
        names = ", ".join(n.name for n in placeholders)
        raise UserError(f"the module's forward takes {len(placeholders)} inputs ({names}): it must take one tensor")
    runs = []
    was = module.training
    module.eval()
    try:
        with torch.no_grad():
            for batch in (example[:2], torch.cat([example[:2], example[:1]])):
                recorder = _Recorder(gm)
                recorder.run(batch)
                runs.append(recorder)
    except Exception as exc:
        first = next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), type(exc).__name__)
        raise UserError(f"the module rejects an input of shape {tuple(example.shape[1:])}: {first[:200]}") from None
    finally:
        module.train(was)
    two, three = runs
    position = {n: k for k, n in enumerate(order)}
    result = _result(gm.graph)
    last_use = {}
    for n in order:
        users = [position[u] for u in n.users if u in position]
        last_use[n] = max(users + ([len(order)] if n is result or _feeds_output(n) else []), default=position[n])

    def batched(n: fx.Node) -> bool:
        x, y = two.values.get(n), three.values.get(n)
        return (
            isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.dim() >= 1
            and x.shape[0] == 2 and y.shape[0] == 3 and x.shape[1:] == y.shape[1:]
        )  # fmt: skip

    # cuts between positions k and k + 1 that no shared parameter, module or unbatched value forbids
    allowed = [True] * len(order)
    for n in order:
        if not batched(n):
            for k in range(position[n], last_use[n]):
                allowed[k] = False
    uses = _state_uses(gm, order, constant, position)
    for used in uses.values():
        for k in range(min(used), max(used)):
            allowed[k] = False
    # a layer starts where weights are used (a convolution, a linear, a norm...): the functions between two such
    # (an activation, an addition) stay with the weights before them
    starts = {k for used in uses.values() for k in used}
    for k in range(len(order) - 1):
        allowed[k] = allowed[k] and k + 1 in starts
    allowed[0] = allowed[-1] = False  # (a layer of the input alone; nothing after the last node)
    flops = [two.flops.get(n, 0.0) + 1.0 for n in order]  # (+1: a node of no FLOPs still costs a little)
    cuts = _balanced([k for k in range(len(order) - 1) if allowed[k]], flops, max_layers)
    spans, live = [], []
    start = 0
    for k in [*cuts, len(order) - 1]:
        spans.append((start, k + 1))
        start = k + 1
    for k in cuts:
        values = [n for n in order[: k + 1] if last_use[n] > k]
        live.append(tuple(Value(n.name, tuple(two.values[n].shape[1:]), two.values[n].dtype) for n in values))
    names = tuple(_label(i, [t for t, used in uses.items() if a <= min(used) < b], order[a:b]) for i, (a, b) in
                  enumerate(spans))  # fmt: skip
    return Chain(tuple(spans), tuple(live), names)


def _feeds_output(n: fx.Node) -> bool:
    return any(u.op == "output" for u in n.users)


def _state_uses(gm, order, constant, position) -> dict[str, list[int]]:
    """Each parameter-holding module or parameter: the positions of the input's dependants that use it. (A buffer
    read as an attribute, a mask say, is copied into each layer that reads it: training never changes it.)"""
    uses: dict[str, list[int]] = {}
    params = {name for name, _ in gm.named_parameters()}
    for n in order:
        if n.op == "call_module" and any(True for _ in gm.get_submodule(n.target).parameters()):
            uses.setdefault(n.target, []).append(position[n])
        for c in _constant_ancestors(n, constant) | {n}:
            if c.op == "get_attr" and c.target in params:
                uses.setdefault(c.target, []).append(position[n])
            elif c.op == "call_module" and c in constant:
                uses.setdefault(c.target, []).append(position[n])
    return uses


def _balanced(allowed: list[int], flops: list[float], max_layers: int) -> list[int]:
    """At most `max_layers - 1` of the allowed cuts, each where the running FLOPs reach the next equal share."""
    if len(allowed) < max_layers:
        return allowed
    total, share = sum(flops), sum(flops) / max_layers
    cuts, running, target = [], 0.0, share
    allowed_set = set(allowed)
    for k, f in enumerate(flops[:-1]):
        running += f
        if k in allowed_set and running >= target and len(cuts) < max_layers - 1:
            cuts.append(k)
            target = running + share if running + share < total else total
    return cuts


def _label(index: int, tops: list[str], nodes: list[fx.Node]) -> str:
    """ "3:blocks.0.conv2+blocks.0.norm2" from the modules and parameters the layer uses (or its first function)."""
    if not tops:
        tops = [n.name for n in nodes if n.op != "placeholder"][:1] or ["input"]
    text = "+".join(tops[:3]) + ("+…" if len(tops) > 3 else "")
    return f"{index}:{text}"
