"""A user's module as the chain of layers the planner cuts: its graph, grouped at the points where every value
live across is a per-sample tensor; each cut carries its whole live set, packed into one tensor per sample.

    chain = capture(module, example)       # example: a batch of 2 samples of the module's input
    layers = chain.layers(module)          # nn.Modules, each one packed tensor in, one out; last: the output

The graph comes from torch.fx's `symbolic_trace` for a module in a file: it keeps each `nn.Module` call as one
node, so a layer holds the user's submodules under their own names (`layer1.0.conv1.weight`) and the stages'
state dicts speak the user's keys without a map. A Hugging Face model, whose Python fx cannot follow, comes from
`torch.export` (batch dimension dynamic), whose unlifted graph keeps the parameters' own names too.
What a cut needs is found by running the graph at two batch sizes: a value that does not depend on the input (a
mask, `torch.arange(16)`) or only on its shape (`x.shape[0]`, a mask sized by it) is recomputed by each layer that
needs it rather than sent: a size is a constant or a multiple of the batch, which every layer's input tells.
A cut is never placed where another value without a batch dimension is live, nor between two calls of a module
with buffers (their statistics would part). A parameter used by several layers (tied input and output
embeddings) is held by each: `ties` says where, and the runtime sums its gradients over the holders before every
step (Megatron's way). Integer values crossing a cut travel as float32 (exact below 2**24) and their cut is
never compressed.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import fx, nn
from torch.utils.flop_counter import FlopCounterMode

from engine.errors import UserError

MAX_LAYERS = 48  # the chain's length at most: the exact planner's search stays in seconds below this
SIZES = {torch.ops.aten.sym_size.int, torch.ops.aten.sym_numel.default}  # export's reads of a tensor's shape
Tracer = Callable[[nn.Module], fx.GraphModule]


@dataclass(frozen=True)
class Value:
    """A value live across a cut: its graph node (by position: a new trace may name nodes otherwise), per-sample
    shape and dtype."""

    node: int
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def size(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Chain:
    """The module's graph cut into layers: layer i runs `spans[i]` (positions among the nodes that read the input's
    data) and receives `cuts[i - 1]` (layer 0 the module's input). `sizes`: each shape read's value as
    (constant, per-sample multiple) pairs, one per dimension; `ties`: each parameter held by several layers, as
    (layer, name in it) pairs; `aliases`: the module's other names of a parameter (tied ones)."""

    spans: tuple[tuple[int, int], ...]
    cuts: tuple[tuple[Value, ...], ...]
    names: tuple[str, ...]
    sizes: tuple[tuple[int, tuple[tuple[int, int], ...], bool], ...]  # (node, dims, a number rather than a shape)
    ties: tuple[tuple[tuple[int, str], ...], ...]
    aliases: tuple[tuple[str, ...], ...]
    tracer: Tracer
    nodes: int  # the graph's size: a later trace of the same module must match it

    def layers(self, module: nn.Module) -> list[nn.Module]:
        """Fresh layers of `module` (built like the captured one: the same graph): its own parameters, shared."""
        gm = self.tracer(module)
        sized = {k for k, _, _ in self.sizes}
        graph = _Graph(gm, frozenset(k for k, n in enumerate(_nodes(gm)) if _is_size(n) and k not in sized))
        if len(graph.nodes) != self.nodes:
            raise UserError(f"the module's graph has {len(graph.nodes)} nodes, {self.nodes} when it was planned: "
                            "its code changed since; plan it again")  # fmt: skip
        return [self._layer(gm, graph, i) for i in range(len(self.spans))]

    def exact(self, boundary: int) -> bool:
        """Whether cut `boundary` (between layer boundary-1 and boundary) carries an integer value."""
        return any(not v.dtype.is_floating_point for v in self.cuts[boundary - 1])

    def _layer(self, gm: fx.GraphModule, g: _Graph, i: int) -> nn.Module:
        a, b = self.spans[i]
        mine = set(g.order[a:b] if a else g.order[1:b])
        need: set[fx.Node] = set()
        for n in mine:  # what these nodes use that no cut carries: recomputed here
            need |= g.ancestors(n)
        graph = fx.Graph()
        env: dict[fx.Node, object] = {}
        by_name = g.nodes  # (by position)
        packed = graph.placeholder(g.order[0].name if a == 0 else "packed")
        # a tensor the traced graph makes (torch.export's arange, full, to) is made where the layer's input is, not on
        # the device it was traced on: the layer may compute on a GPU (engine.runtime.placement)
        device = graph.call_function(getattr, (packed, "device"))
        if a == 0:
            env[g.order[0]] = packed
        else:
            offset = 0
            for v in self.cuts[i - 1]:
                part = graph.call_function(operator.getitem, (packed, (slice(None), slice(offset, offset + v.size))))
                part = graph.call_method("reshape", (part, (-1, *v.shape)))
                env[by_name[v.node]] = graph.call_method("to", (part, v.dtype)) if v.dtype != torch.float32 else part
                offset += v.size
        batch = None
        sizes = {g.nodes[k]: (dims, scalar) for k, dims, scalar in self.sizes}
        for n in g.nodes:
            if n in sizes and n in need:  # a read of a shape: constants and multiples of the batch
                if batch is None and any(k for _, k in sizes[n][0]):
                    batch = graph.call_method("size", (packed, 0))
                dims = [c if not k else (batch if k == 1 else graph.call_function(operator.mul, (batch, k)))
                        for c, k in sizes[n][0]]  # fmt: skip
                env[n] = dims[0] if sizes[n][1] else tuple(dims)
            elif n in mine or n in need:
                env[n] = graph.node_copy(n, lambda x: env[x])
                if isinstance(n.kwargs.get("device"), torch.device):
                    env[n].update_kwarg("device", device)
        if i == len(self.spans) - 1:
            graph.output(env[_result(gm.graph)])
        else:
            parts = []
            for v in self.cuts[i]:
                flat = graph.call_method("flatten", (env[by_name[v.node]], 1))
                parts.append(graph.call_method("to", (flat, torch.float32)) if v.dtype != torch.float32 else flat)
            graph.output(parts[0] if len(parts) == 1 else graph.call_function(torch.cat, (parts, 1)))
        layer = fx.GraphModule(gm, graph, class_name="Layer")
        layer.graph.eliminate_dead_code()  # (a size read no node uses)
        layer.recompile()
        layer.label = self.names[i]
        return layer


class UntraceableError(UserError):
    """torch.fx cannot follow the module's Python (engine.models.children may still cut it at its children)."""


def symbolic(module: nn.Module) -> fx.GraphModule:
    """The module's graph by torch.fx (a one-line UntraceableError naming the construct when fx cannot follow)."""
    try:
        return fx.symbolic_trace(module)
    except Exception as exc:  # fx raises TraceError, TypeError, NotImplementedError... from the user's code
        raise UntraceableError(
            f"cannot capture the module's graph ({_first(exc)}): Python control flow on tensor values cannot be "
            "traced; make it depend on shapes only, or move it out of forward"
        ) from None


def _first(exc: BaseException) -> str:
    return next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), type(exc).__name__)[:200]


def _is_size(n: fx.Node) -> bool:
    """A read of a tensor's shape, not of its values."""
    if n.op == "call_function":
        return n.target in SIZES or (n.target is getattr and n.args[1:2] == ("shape",))
    return n.op == "call_method" and n.target == "size"


class _Graph:
    """The graph's nodes sorted by what they read: the input's data (`order`: cut between them), its shape only,
    or nothing of it (`free`: recomputed where needed)."""

    def __init__(self, gm: fx.GraphModule, unsizable: frozenset[int] = frozenset()):
        self.nodes = _nodes(gm)
        data: set[fx.Node] = set()
        for k, n in enumerate(self.nodes):
            reads = [a for a in n.all_input_nodes if a in data]
            if n.op == "placeholder" or (reads and not (_is_size(n) and k not in unsizable)):
                data.add(n)
        self.order = [n for n in self.nodes if n in data]
        self.free = {n for n in self.nodes if n not in data}

    def ancestors(self, node: fx.Node) -> set[fx.Node]:
        """The recomputed values `node` needs (a shape read's own input is not needed: the layer's tells)."""
        found: set[fx.Node] = set()
        stack = [a for a in node.all_input_nodes if a in self.free]
        while stack:
            n = stack.pop()
            if n not in found:
                found.add(n)
                if not _is_size(n):
                    stack += [a for a in n.all_input_nodes if a in self.free]
        return found


def _nodes(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op != "output"]


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
        self.values: dict[str, object] = {}
        self.flops: dict[str, float] = {}

    def run_node(self, n: fx.Node):
        with FlopCounterMode(display=False) as counter:
            out = super().run_node(n)
        self.values[n.name], self.flops[n.name] = out, float(counter.get_total_flops())
        return out


def _dims(two, three) -> tuple[tuple[int, int], ...] | None:
    """A shape read at batch 2 and 3 as (constant, multiple of the batch) per dimension; None if neither."""
    if isinstance(two, int) and isinstance(three, int):
        two, three = (two,), (three,)
    if not (isinstance(two, tuple) and isinstance(three, tuple) and len(two) == len(three)):
        return None
    dims = []
    for x, y in zip(two, three):
        if not (isinstance(x, int) and isinstance(y, int)):
            return None
        if x == y:
            dims.append((x, 0))
        elif x % 2 == 0 and 3 * x == 2 * y:
            dims.append((0, x // 2))
        else:
            return None
    return tuple(dims)


def capture(module: nn.Module, example: torch.Tensor, tracer: Tracer = symbolic, max_layers: int = MAX_LAYERS):
    """Cut `module` into a chain of at most `max_layers` layers of about equal forward FLOPs, at the points where
    a cut is possible. `example`: an input batch of 2 samples (the batch dimension is found by also running 3)."""
    gm = tracer(module)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != 1:
        names = ", ".join(n.name for n in placeholders)
        raise UserError(f"the module's forward takes {len(placeholders)} inputs ({names}): it must take one tensor")
    two, three = _run_twice(gm, module, example)
    reads = [k for k, n in enumerate(_nodes(gm)) if _is_size(n)]
    dims = {k: _dims(two.values[_nodes(gm)[k].name], three.values[_nodes(gm)[k].name]) for k in reads}
    g = _Graph(gm, frozenset(k for k, d in dims.items() if d is None))  # (others: shape reads, recomputed)
    index = {n: k for k, n in enumerate(g.nodes)}
    order = g.order
    position = {n: k for k, n in enumerate(order)}
    result = _result(gm.graph)
    last_use = {}
    for n in order:
        users = [position[u] for u in n.users if u in position]  # (its other users only read its shape)
        last_use[n] = max(users + ([len(order)] if n is result else []), default=position[n])

    uses = _state_uses(gm, g, position)
    allowed = _allowed(gm, order, last_use, uses, two, three)
    flops = [two.flops.get(n.name, 0.0) + 1.0 for n in order]  # (+1: a node of no FLOPs still costs a little)
    cuts = _balanced([k for k in range(len(order) - 1) if allowed[k]], flops, max_layers)
    spans, live, start = [], [], 0
    for k in [*cuts, len(order) - 1]:
        spans.append((start, k + 1))
        start = k + 1
    for k in cuts:
        values = [n for n in order[: k + 1] if last_use[n] > k]
        live.append(tuple(Value(index[n], tuple(two.values[n.name].shape[1:]), two.values[n.name].dtype)
                          for n in values))  # fmt: skip
    names = tuple(_label(i, [t for t, u in uses.items() if a <= min(u) < b], order[a:b])
                  for i, (a, b) in enumerate(spans))  # fmt: skip
    sizes = tuple((k, d, isinstance(two.values[g.nodes[k].name], int)) for k, d in dims.items() if d is not None)
    chain = Chain(tuple(spans), tuple(live), names, sizes, (), _aliases(module), tracer, len(g.nodes))
    return replace(chain, ties=_ties(chain.layers(module)))


def _run_twice(gm: fx.GraphModule, module: nn.Module, example: torch.Tensor) -> tuple[_Recorder, _Recorder]:
    """The graph run (in eval mode, no gradients) at batch 2 and at batch 3."""
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
        raise UserError(f"the module rejects an input of shape {tuple(example.shape[1:])}: {_first(exc)}") from None
    finally:
        module.train(was)
    return runs[0], runs[1]


def _allowed(gm, order, last_use, uses, two: _Recorder, three: _Recorder) -> list[bool]:
    """Whether a cut may follow each data node: no value without a batch dimension is live across it, no module
    with buffers is called on both sides, and a layer starts where weights are used (a convolution, a linear, a
    norm...: the functions between two such, an activation or an addition, stay with the weights before them)."""
    position = {n: k for k, n in enumerate(order)}

    def batched(n: fx.Node) -> bool:
        x, y = two.values.get(n.name), three.values.get(n.name)
        return (
            isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.dim() >= 1
            and x.shape[0] == 2 and y.shape[0] == 3 and x.shape[1:] == y.shape[1:]
        )  # fmt: skip

    allowed = [True] * len(order)
    for n in order:
        if not batched(n):
            for k in range(position[n], last_use[n]):
                allowed[k] = False
    for target, used in uses.items():
        if _stateful(gm, target):  # its statistics would part
            for k in range(min(used), max(used)):
                allowed[k] = False
    starts = {k for used in uses.values() for k in used}
    for k in range(len(order) - 1):
        allowed[k] = allowed[k] and k + 1 in starts
    allowed[0] = allowed[-1] = False  # (a layer of the input alone; nothing after the last node)
    return allowed


def _state_uses(gm: fx.GraphModule, g: _Graph, position: dict) -> dict[str, list[int]]:
    """Each module with weights, and each parameter read as an attribute: the positions of the data nodes that
    use it."""
    uses: dict[str, list[int]] = {}
    params = {name for name, _ in gm.named_parameters()}
    for n in g.order:
        for c in g.ancestors(n) | {n}:
            if c.op == "call_module" and any(True for _ in gm.get_submodule(c.target).parameters()):
                uses.setdefault(c.target, []).append(position[n])
            elif c.op == "get_attr" and c.target in params:
                uses.setdefault(c.target, []).append(position[n])
    return uses


def _stateful(gm: fx.GraphModule, target: str) -> bool:
    try:
        return any(True for _ in gm.get_submodule(target).buffers())
    except AttributeError:  # a parameter read as an attribute
        return False


def _ties(layers: list[nn.Module]) -> tuple[tuple[tuple[int, str], ...], ...]:
    """Parameters held by more than one layer (the same tensor in one process): (layer, name) per holder."""
    holders: dict[int, list[tuple[int, str]]] = {}
    for i, layer in enumerate(layers):
        for name, p in layer.named_parameters():
            holders.setdefault(id(p), []).append((i, name))
    return tuple(tuple(h) for h in holders.values() if len({i for i, _ in h}) > 1)


def _aliases(module: nn.Module) -> tuple[tuple[str, ...], ...]:
    """The module's names of each parameter it registers more than once (a tied embedding)."""
    names: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return tuple(tuple(n) for n in names.values() if len(n) > 1)


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
            target = min(running + share, total)
    return cuts


def _label(index: int, tops: list[str], nodes: list[fx.Node]) -> str:
    """ "3:blocks.0.conv2+blocks.0.norm2" from the modules and parameters the layer uses (or its first function)."""
    modules = []
    for t in tops:  # a parameter by its module: transformer.h.0.attn.c_attn, not its weight and its bias
        owner = t.rsplit(".", 1)[0] if t.rsplit(".", 1)[-1] in ("weight", "bias") and "." in t else t
        if owner not in modules:
            modules.append(owner)
    if not modules:
        modules = [n.name for n in nodes if n.op != "placeholder"][:1] or ["input"]
    text = "+".join(modules[:2]) + ("+…" if len(modules) > 2 else "")
    return f"{index}:{text}"
