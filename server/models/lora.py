"""LoRA adapters over one loaded base model: their weights, checked against the model, and the
low-rank term a step adds to each projection's output for the rows that use an adapter.

The base weights are never changed (no merge, per request or otherwise): every adapter stays
as its A [r, in] and B [out, r] pairs, and a step whose rows use adapters adds, after a
projection's base output (bias included, as PEFT does), scale · B · A · x for each such row:

* per step the adapters present are stacked, per layer and fused matrix (qkv, o, gate_up, down),
  into one A [R, in] (each PEFT module of the matrix, q k v for qkv, in turn, and within it every
  adapter's rows that target it) and, per module, the Bᵀ of those rows against its own output rows
  (so B's zero blocks, q's columns against k's rows and so on, are never stored or read: the bytes
  read are the adapters' own). The stacks are cached by the set of adapters, so a steady mix costs
  nothing to build;
* one call of pagewire::lora_add per projection (csrc/cpu/lora*.cpp) then adds every row's own
  adapter term: each row is told its adapter's index in the stack (-1: none) and each adapter
  where its rows of A are (`spans`); the kernel shrinks x by A over all the matrix's modules at
  once (q, k and v read one x), and expands by each module's Bᵀ into its output columns, rounding
  as PEFT does in the model's dtype (lora_A's output, lora_B's, the scaling, the sum). A row's
  result depends on its own adapter only, and the fused decode_layer runs the same op on the same
  tensors, so both paths give the same floats;
* deterministic mode (server.kernels.batch_invariant) needs a row's result not to depend on the
  other rows or adapters of its step (docs/determinism.md). On CPU the stacked terms already give
  that (lora_add computes each row from its own adapter's rows of A and Bᵀ alone, in a fixed
  order, whatever the stack holds and on any thread count), so they serve both modes and adapter
  steps stay on the fused decode_layer. Off CPU (lora_add's torch fallback runs batched matmuls)
  each adapter's term is computed apart, over its own rows and columns, through ops.linear's
  batch-invariant path, at one term per adapter in the step;
* rows with no adapter are not touched, and a step with none calls nothing here.

Rank and scale are PEFT's (`r`, lora_alpha / r, or / sqrt(r) with rsLoRA). The term is computed
in the model's dtype; on a quantised base (GGUF blocks, --quantization) it is added to the
dequantising kernel's output, the adapter itself stays in the model dtype.
"""
from __future__ import annotations

import re
from collections import OrderedDict
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch
from safetensors import safe_open

from server.kernels import batch_invariant
from server.kernels.linear_route import linear
from server.kernels.ops import lora_add
from server.models.lora_config import MAX_ADAPTERS, TARGETS, LoraConfig, LoraError

# A PEFT checkpoint's tensor names: base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight
_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
# The stacks of this many adapter sets are kept (most recently used).
_STACK_CACHE = 16
# The fused matrices a term may add to, in pagewire::decode_layer's order (LoraStep.fused_args).
FUSED_MATRICES = ("qkv", "o", "gate_up", "down")


class Slot(NamedTuple):
    """Where a PEFT module lands in one layer: its fused matrix, its first output row there, its
    output rows and its input features (DecoderForCausalLM.lora_layout)."""

    matrix: str
    row: int
    rows: int
    inputs: int


@dataclass
class _Adapter:
    name: str
    config: LoraConfig
    # per layer: fused matrix -> (A [cols, in], B [out, cols]) over `modules[matrix]`, the modules of
    # the matrix it targets in any layer, in TARGETS order (absent in a layer: zeros), `rank` columns each.
    weights: list[dict[str, tuple[torch.Tensor, torch.Tensor]]]
    modules: dict[str, list[str]]


class _Matrix(NamedTuple):
    """One fused matrix of one layer, its adapters stacked (pagewire::lora_add's arguments): A [R, in]
    over its parts (the PEFT modules this layer has), each part's Bᵀ [C_p, rows_p], each adapter's
    (first row of A, rank) per part (rank 0: no term there), and (row, rows, c0) per part."""

    a: torch.Tensor
    bts: list[torch.Tensor]
    spans: torch.Tensor
    parts: list[int]


class _Stack(NamedTuple):
    """One set of adapters stacked: per layer, fused matrix -> its stack; each adapter's scale; per
    layer, decode_layer's share of `lora` and `lora_spec` (LoraStep.fused_args), built once."""

    weights: list[dict[str, _Matrix]]
    scales: torch.Tensor
    fused: list[tuple[list[torch.Tensor], list[int]]]


class LoraStep:
    """One step's low-rank terms: built by LoraSet.step, read by the decoder layers (`add`).

    Two forms of the same sum. Stacked (the default, and deterministic mode on CPU):
    pagewire::lora_add over the step's adapters stacked, each row its own adapter. Grouped
    (deterministic mode off CPU, server.kernels.batch_invariant): one term per adapter over its own
    rows and columns only, through ops.linear's batch-invariant path, so a row's result never
    depends on which other adapters or rows share its step."""

    def __init__(self, stacked: Optional[tuple[torch.Tensor, _Stack]] = None,
                 grouped: Optional[list[tuple[Optional[torch.Tensor], _Adapter]]] = None) -> None:
        # stacked: (each row's adapter index in the stack, int32, -1: none; the stack);
        # grouped: per adapter, (its rows or None, the adapter).
        self._stacked = stacked
        self._grouped = grouped or []

    @property
    def fusable(self) -> bool:
        """Whether pagewire::decode_layer can add these terms (the stacked form; the grouped one
        runs through ops.linear's batch-invariant path, in the Python layers)."""
        return self._stacked is not None and not self._grouped

    def fused_args(self, layer: int) -> tuple[list[torch.Tensor], list[int]]:
        """Layer `layer`'s stacked terms as decode_layer takes them (`lora`, `lora_spec`): each row's
        adapter index (int32) and the adapters' scales, then per matrix with a term, in
        FUSED_MATRICES order, its A, its spans and each part's Bᵀ; the spec gives per matrix its
        part count (-1: none) and each part's (row, rows, c0). decode_layer runs lora_add on them
        as `add` does."""
        assert self._stacked is not None, "fused_args: the grouped (deterministic) terms run the Python layers"
        adapter, stack = self._stacked
        tensors, spec = stack.fused[layer]
        return [adapter, stack.scales, *tensors], spec

    def add(self, layer: int, matrix: str, x: torch.Tensor, out: torch.Tensor) -> None:
        """out[rows] += scale · (x[rows] · Aᵀ) · Bᵀ for layer `layer`'s `matrix` (qkv, o, gate_up,
        down); x is the projection's input [T, in], out its output [T, out], updated in place."""
        if self._stacked is not None:
            adapter, stack = self._stacked
            w = stack.weights[layer].get(matrix)
            if w is not None:
                lora_add(out, x, adapter, w.a, w.spans, stack.scales, w.bts, w.parts)
        for rows, ad in self._grouped:
            g = ad.weights[layer].get(matrix)
            if g is None:
                continue
            a, b = g
            d = linear(linear(x if rows is None else x.index_select(0, rows), a).mul_(ad.config.scale), b)
            if rows is None:
                out.add_(d)
            else:
                out.index_add_(0, rows, d)


class LoraSet:
    """The adapters loaded over one model, by name; slot 0 is "no adapter", adapters are 1..N."""

    def __init__(self, layout: list[dict[str, Slot]], dtype: torch.dtype, device: torch.device,
                 vocab_size: int) -> None:
        """layout: per layer, each PEFT module name it can carry and where it lands
        (DecoderForCausalLM.lora_layout); modules a layer lacks cannot be targeted there."""
        self._layout = layout
        self._dtype = dtype
        self._device = device
        self._adapters: list[_Adapter] = []
        self._slots: dict[str, int] = {}
        self._stacks: OrderedDict[tuple[int, ...], _Stack] = OrderedDict()
        # The prefix cache tells adapters apart by offsetting token ids (kv_cache_manager.py).
        if vocab_size >= 1 << 24:
            raise LoraError(f"vocab_size: {vocab_size} is too large for LoRA's prefix-cache keys (< 2^24)")

    @property
    def names(self) -> list[str]:
        return [a.name for a in self._adapters]

    def slot(self, name: str) -> int:
        """The adapter's slot (1..N); KeyError for a name not loaded."""
        return self._slots[name]

    def load(self, name: str, config: LoraConfig) -> int:
        """Read and check the adapter's tensors against the model; returns its slot. LoraError
        naming the file and tensor for a missing, unexpected or mis-shaped tensor, a module the
        layer has no place for, or a rank that is not the config's `r`."""
        if name in self._slots:
            raise LoraError(f"--lora: adapter name {name!r} given twice")
        if len(self._adapters) >= MAX_ADAPTERS:
            raise LoraError(f"--lora: at most {MAX_ADAPTERS} adapters per server")
        path = config.weights_path
        found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                keys = list(f.keys())
                tensors = {k: f.get_tensor(k) for k in keys}
        except Exception as e:  # safetensors raises its own types for a corrupt header
            raise LoraError(f"{path}: not a readable safetensors file: {e}") from None
        L = len(self._layout)
        for key, t in tensors.items():
            m = _KEY.match(key)
            if m is None:
                raise LoraError(f"{path}: {key}: not a LoRA tensor of a decoder projection "
                                "(expected base_model.model.model.layers.N.<self_attn|mlp>.<module>.lora_<A|B>.weight)")
            layer, module, ab = int(m.group(1)), m.group(3), m.group(4)
            if layer >= L:
                raise LoraError(f"{path}: {key}: layer {layer} does not exist (the model has {L})")
            if module not in self._layout[layer]:
                raise LoraError(f"{path}: {key}: this model's layer {layer} has no {module} an adapter can target "
                                f"(it has {', '.join(self._layout[layer]) or 'none'})")
            if not config.targets_module(layer, module):
                raise LoraError(f"{path}: {key}: {module} is not in {config.path / 'adapter_config.json'}'s "
                                "target_modules")
            found.setdefault((layer, module), {})[ab] = t
        if not found:
            raise LoraError(f"{path}: holds no LoRA tensors")
        r = config.rank
        for (layer, module), pair in sorted(found.items()):
            slot = self._layout[layer][module]
            kind = "self_attn" if slot.matrix in ("qkv", "o") else "mlp"
            stem = f"base_model.model.model.layers.{layer}.{kind}.{module}"
            for ab, want in (("A", (r, slot.inputs)), ("B", (slot.rows, r))):
                t = pair.get(ab)
                if t is None:
                    raise LoraError(f"{path}: {stem}.lora_{ab}.weight: missing (its lora_{'B' if ab == 'A' else 'A'} "
                                    "is there)")
                if tuple(t.shape) != want:
                    raise LoraError(f"{path}: {stem}.lora_{ab}.weight: shape {list(t.shape)}, expected {list(want)} "
                                    f"(r = {r} in adapter_config.json; {module} of layer {layer} maps "
                                    f"{slot.inputs} -> {slot.rows})")
                if not t.is_floating_point():
                    raise LoraError(f"{path}: {stem}.lora_{ab}.weight: dtype {t.dtype} is not a float type")
        weights, modules = self._fuse(found, r)
        slot_id = len(self._adapters) + 1
        self._adapters.append(_Adapter(name, config, weights, modules))
        self._slots[name] = slot_id
        self._stacks.clear()
        return slot_id

    def _fuse(self, found: dict[tuple[int, str], dict[str, torch.Tensor]],
              r: int) -> tuple[list[dict[str, tuple[torch.Tensor, torch.Tensor]]], dict[str, list[str]]]:
        """Per layer and fused matrix, the adapter's A [k r, in] and B [out, k r] over the k modules
        of that matrix it targets in any layer (zero where a layer lacks one); and those modules."""
        modules: dict[str, list[str]] = {}
        for (_, module) in found:
            matrix = self._slot_any(module).matrix
            if module not in modules.setdefault(matrix, []):
                modules[matrix].append(module)
        order = list(TARGETS)  # one column order for every layer
        for names in modules.values():
            names.sort(key=order.index)
        out: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = []
        for layer, slots in enumerate(self._layout):
            per: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
            for matrix, names in modules.items():
                ins = {slots[n].inputs for n in names if n in slots}
                out_rows = {s.row + s.rows for s in slots.values() if s.matrix == matrix}
                if not ins or not out_rows:
                    continue
                a = torch.zeros((len(names) * r, ins.pop()), dtype=self._dtype, device=self._device)
                b = torch.zeros((max(out_rows), len(names) * r), dtype=self._dtype, device=self._device)
                for j, n in enumerate(names):
                    pair = found.get((layer, n))
                    if pair is None:
                        continue
                    s = slots[n]
                    a[j * r : (j + 1) * r] = pair["A"].to(self._dtype)
                    b[s.row : s.row + s.rows, j * r : (j + 1) * r] = pair["B"].to(self._dtype)
                per[matrix] = (a, b)
            out.append(per)
        return out, modules

    def _slot_any(self, module: str) -> Slot:
        for slots in self._layout:
            if module in slots:
                return slots[module]
        raise LoraError(f"{module}: no layer of this model carries it")  # load() checked each tensor first

    def step(self, row_slots: list[int]) -> Optional[LoraStep]:
        """The step's terms for its rows (each row's adapter slot, 0 for none); None when no row
        uses an adapter (the step then runs exactly as without LoRA)."""
        active = tuple(sorted({s for s in row_slots if s}))
        if not active:
            return None
        slots_t = torch.tensor(row_slots, dtype=torch.int32, device=self._device)
        # Grouped: each adapter over its own rows, where lora_add is torch's batched matmuls (off
        # CPU); the CPU kernel is row-independent by construction (see the module docstring).
        if batch_invariant.enabled() and self._device.type != "cpu":
            every = len(active) == 1 and all(row_slots)
            return LoraStep(grouped=[(None if every else torch.nonzero(slots_t == s).view(-1), self._adapters[s - 1])
                                     for s in active])
        stack = self._stacks.get(active)
        if stack is None:
            stack = self._stack(active)
            self._stacks[active] = stack
            if len(self._stacks) > _STACK_CACHE:
                self._stacks.popitem(last=False)
        else:
            self._stacks.move_to_end(active)
        index = {s: k for k, s in enumerate(active)}
        adapter = torch.tensor([index[s] if s else -1 for s in row_slots], dtype=torch.int32, device=self._device)
        return LoraStep(stacked=(adapter, stack))

    def _stack(self, active: tuple[int, ...]) -> _Stack:
        """Stack the adapters of `active`: per layer and matrix, A's rows module by module (TARGETS
        order, the modules this layer has) and within a module adapter by adapter, so each module's
        rows are one contiguous range and its Bᵀ covers exactly them."""
        adapters = [self._adapters[s - 1] for s in active]
        order = list(TARGETS)
        matrices = sorted({m for ad in adapters for m in ad.modules})
        weights: list[dict[str, _Matrix]] = []
        fused: list[tuple[list[torch.Tensor], list[int]]] = []
        for layer, slots in enumerate(self._layout):
            per: dict[str, _Matrix] = {}
            for m in matrices:
                modules = sorted({n for ad in adapters for n in ad.modules.get(m, []) if n in slots}, key=order.index)
                a_rows: list[torch.Tensor] = []
                bts: list[torch.Tensor] = []
                parts: list[int] = []
                spans = torch.zeros((len(adapters), len(modules), 2), dtype=torch.int32)
                c = 0
                for p, module in enumerate(modules):
                    slot, c0, cols = slots[module], c, []
                    for k, ad in enumerate(adapters):
                        w = ad.weights[layer].get(m)
                        if w is None or module not in ad.modules.get(m, []):
                            continue
                        r, j = ad.config.rank, ad.modules[m].index(module)
                        a, b = w
                        a_rows.append(a[j * r : (j + 1) * r])
                        cols.append(b[slot.row : slot.row + slot.rows, j * r : (j + 1) * r].t())
                        spans[k, p, 0], spans[k, p, 1] = c, r
                        c += r
                    bts.append(torch.cat(cols).contiguous())
                    parts += [slot.row, slot.rows, c0]
                if a_rows:
                    per[m] = _Matrix(torch.cat(a_rows).contiguous(), bts, spans.to(self._device), parts)
            weights.append(per)
            tensors: list[torch.Tensor] = []
            spec: list[int] = []
            for m in FUSED_MATRICES:
                mx = per.get(m)
                if mx is None:
                    spec.append(-1)
                    continue
                tensors += [mx.a, mx.spans, *mx.bts]
                spec += [len(mx.bts), *mx.parts]
            fused.append((tensors, spec))
        scales = torch.tensor([ad.config.scale for ad in adapters], dtype=torch.float32, device=self._device)
        return _Stack(weights, scales, fused)
