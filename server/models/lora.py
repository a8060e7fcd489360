"""LoRA adapters over one loaded base model: their weights, checked against the model, and the
low-rank term a step adds to each projection's output for the rows that use an adapter.

The base weights are never changed (no merge, per request or otherwise): every adapter stays
as its A [r, in] and B [out, r] pairs, and a step whose rows use adapters adds, after a
projection's base output (bias included, as PEFT does), scale · B · A · x for each such row:

* per step the adapters present are stacked, per layer and fused matrix (qkv, o, gate_up, down),
  into one A [R, in] (R = the sum of their targeted modules' ranks) and, per PEFT module of the
  matrix, the Bᵀ of its columns against its own output rows (so B's zero blocks, q's columns
  against k's rows and so on, are never stored or read: the bytes read are the adapters' own).
  The stacks are cached by the set of adapters, so a steady mix costs nothing to build;
* the rows that use an adapter are gathered (all rows: no gather), multiplied by A, masked so
  each row keeps only its own adapter's columns, times that adapter's scale (a [rows, R] mask
  built once per step and matrix), then each module's columns are multiplied by its Bᵀ and added
  to its output rows. One GEMM for A and one per module for B (qkv: 3, gate_up: 2, o and down:
  1), whatever the number of adapters; a row gets its own
  adapter's B·A·x (the other columns are exact zeros; only the GEMM's summation order can differ
  from the adapter's own product);
* in deterministic mode (server.kernels.batch_invariant) each adapter's term is computed apart,
  over its own rows and columns, through ops.linear's batch-invariant path: a row's result then
  does not depend on the other rows or adapters of its step (docs/determinism.md), at one term
  per adapter in the step;
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
from server.kernels.ops import linear
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


class _Part(NamedTuple):
    """One PEFT module's share of a stacked matrix: its output rows [row, row + rows) and its
    columns [c0, c1) of the stacked A's output (every adapter's that targets it), with their Bᵀ.
    Kept per module, so B's zero blocks (q's columns against k's rows, ...) are never stored or read."""

    row: int
    rows: int
    c0: int
    c1: int
    bt: torch.Tensor


class _Stack(NamedTuple):
    """One set of adapters stacked: per layer, fused matrix -> (A [R, in], its modules' parts);
    per matrix each column's adapter slot and scale."""

    weights: list[dict[str, tuple[torch.Tensor, list[_Part]]]]
    col_slot: dict[str, torch.Tensor]
    col_scale: dict[str, torch.Tensor]


class LoraStep:
    """One step's low-rank terms: built by LoraSet.step, read by the decoder layers (`add`).

    Two forms of the same sum. Stacked (the default): one term over the step's adapters stacked,
    with a per-row mask. Grouped (deterministic mode, server.kernels.batch_invariant): one term per
    adapter over its own rows and columns only, through ops.linear's batch-invariant path, so a
    row's result never depends on which other adapters or rows share its step."""

    def __init__(self, stacked: Optional[tuple[Optional[torch.Tensor], _Stack, dict[str, torch.Tensor]]] = None,
                 grouped: Optional[list[tuple[Optional[torch.Tensor], _Adapter]]] = None) -> None:
        # stacked: (rows or None for every row, the stack, per matrix the [rows, R] mask of scales);
        # grouped: per adapter, (its rows or None, the adapter).
        self._stacked = stacked
        self._grouped = grouped or []

    @property
    def fusable(self) -> bool:
        """Whether pagewire::decode_layer can add these terms (the stacked form; the grouped one
        runs through ops.linear's batch-invariant path, in the Python layers)."""
        return self._stacked is not None and not self._grouped

    def fused_args(self, layer: int) -> tuple[list[torch.Tensor], list[int]]:
        """Layer `layer`'s stacked terms as decode_layer takes them (`lora`, `lora_spec`): the
        rows (int64, empty for every row), then per matrix with a term, in FUSED_MATRICES order,
        its A, its mask and each module's Bᵀ; the spec gives per matrix its module count (-1:
        none) and each module's (row, rows, c0, c1). decode_layer adds them as `add` does."""
        assert self._stacked is not None, "fused_args: the grouped (deterministic) terms run the Python layers"
        rows, stack, masks = self._stacked
        every = torch.empty(0, dtype=torch.long) if rows is None else rows.to(torch.long)
        tensors: list[torch.Tensor] = [every]
        spec: list[int] = []
        for m in FUSED_MATRICES:
            w = stack.weights[layer].get(m)
            if w is None:
                spec.append(-1)
                continue
            a, parts = w
            tensors += [a, masks[m], *(p.bt for p in parts)]
            spec.append(len(parts))
            for p in parts:
                spec += [p.row, p.rows, p.c0, p.c1]
        return tensors, spec

    def add(self, layer: int, matrix: str, x: torch.Tensor, out: torch.Tensor) -> None:
        """out[rows] += scale · (x[rows] · Aᵀ) · Bᵀ for layer `layer`'s `matrix` (qkv, o, gate_up,
        down); x is the projection's input [T, in], out its output [T, out], updated in place."""
        if self._stacked is not None:
            rows, stack, masks = self._stacked
            w = stack.weights[layer].get(matrix)
            if w is not None:
                a, parts = w
                t = torch.mm(x if rows is None else x.index_select(0, rows), a.t()).mul_(masks[matrix])
                if rows is None:
                    for p in parts:
                        out[:, p.row : p.row + p.rows].addmm_(t[:, p.c0 : p.c1], p.bt)
                elif len(parts) == 1 and parts[0].rows == out.shape[1]:
                    out.index_add_(0, rows, torch.mm(t[:, parts[0].c0 : parts[0].c1], parts[0].bt))
                else:
                    d = t.new_zeros((t.shape[0], out.shape[1]))
                    for p in parts:
                        d[:, p.row : p.row + p.rows].addmm_(t[:, p.c0 : p.c1], p.bt)
                    out.index_add_(0, rows, d)
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
        if batch_invariant.enabled():  # grouped: each adapter over its own rows
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
        rows_t = None if all(row_slots) else torch.nonzero(slots_t).view(-1)
        used = slots_t if rows_t is None else slots_t.index_select(0, rows_t)
        masks = {m: ((stack.col_slot[m][None, :] == used[:, None]) * stack.col_scale[m][None, :]).to(self._dtype)
                 for m in stack.col_slot}
        return LoraStep(stacked=(rows_t, stack, masks))

    def _stack(self, active: tuple[int, ...]) -> _Stack:
        """Stack the adapters of `active`: per matrix, columns module by module (TARGETS order) and
        within a module adapter by adapter, so each module's columns are one contiguous range."""
        adapters = [self._adapters[s - 1] for s in active]
        order = list(TARGETS)
        cols: dict[str, list[tuple[str, int, int]]] = {}  # matrix -> (module, adapter, its index there)
        col_slot: dict[str, torch.Tensor] = {}
        col_scale: dict[str, torch.Tensor] = {}
        for m in sorted({m for ad in adapters for m in ad.modules}):
            modules = sorted({n for ad in adapters for n in ad.modules.get(m, [])}, key=order.index)
            cols[m] = [(n, k, ad.modules[m].index(n)) for n in modules for k, ad in enumerate(adapters)
                       if n in ad.modules.get(m, [])]
            col_slot[m] = torch.tensor([active[k] for _, k, _ in cols[m] for _ in range(adapters[k].config.rank)],
                                       dtype=torch.int32, device=self._device)
            col_scale[m] = torch.tensor([adapters[k].config.scale for _, k, _ in cols[m]
                                         for _ in range(adapters[k].config.rank)], dtype=torch.float32,
                                        device=self._device)
        weights: list[dict[str, tuple[torch.Tensor, list[_Part]]]] = []
        for layer, slots in enumerate(self._layout):
            per: dict[str, tuple[torch.Tensor, list[_Part]]] = {}
            for m, spec in cols.items():
                if not any(m in ad.weights[layer] for ad in adapters):
                    continue
                a_rows: list[torch.Tensor] = []
                parts: list[_Part] = []
                c = 0
                for module in dict.fromkeys(n for n, _, _ in spec):
                    c0, bts = c, []
                    slot = slots.get(module)
                    for _, k, j in (e for e in spec if e[0] == module):
                        r = adapters[k].config.rank
                        a, b = adapters[k].weights[layer][m]
                        a_rows.append(a[j * r : (j + 1) * r])
                        if slot is not None:
                            bts.append(b[slot.row : slot.row + slot.rows, j * r : (j + 1) * r].t())
                        c += r
                    if slot is not None:  # (a layer without this module: its A rows are zeros)
                        parts.append(_Part(slot.row, slot.rows, c0, c, torch.cat(bts).contiguous()))
                per[m] = (torch.cat(a_rows).contiguous(), parts)
            weights.append(per)
        return _Stack(weights, col_slot, col_scale)
