"""LoRA: low-rank adapters on a model's Linear layers, for trainer, warm-up and embedded engine alike.

`attach` swaps each targeted `nn.Linear` for a `LoRALinear` that keeps the base `weight`/`bias` under
their original names and adds `lora_A.weight` [r, in] and `lora_B.weight` [out, r] (PEFT's names), so
`forward = base(x) + (alpha / r) * B(A(dropout(x)))`. B starts at zero: the adapted model starts equal to
its base. The model's full state dict then holds base and adapter keys; `Publishable` leaves the adapter
keys out of the base publication and accepts them on load, so a trainer checkpoint, the mismatch history
and the engine all see the same base + adapter computation.

What flows out: `adapter_state_dict` (model names) -> storage/lora.py's PEFT layout
(`base_model.model.<name>.lora_A.weight`, `adapter_config.json`) -> an adapter publication that names
the base publication it applies to (storage/weights.py).
"""

from __future__ import annotations

import json
import math

import torch
import torch.nn.functional as F
from torch import nn

from config.model import LoRAConfig
from storage.lora import is_adapter_key


class LoRALinear(nn.Linear):
    """A Linear layer with a trainable low-rank update; the base parameters are the original ones."""

    def __init__(self, base: nn.Linear, cfg: LoRAConfig):
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias
        kw = {"dtype": base.weight.dtype, "device": base.weight.device}
        self.lora_A = nn.Linear(self.in_features, cfg.rank, bias=False, **kw)
        self.lora_B = nn.Linear(cfg.rank, self.out_features, bias=False, **kw)
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))  # PEFT's default init
        nn.init.zeros_(self.lora_B.weight)
        self.scaling = cfg.alpha / cfg.rank
        self.dropout: nn.Module = nn.Dropout(cfg.dropout) if cfg.dropout else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias) + self.lora_B(self.lora_A(self.dropout(x))) * self.scaling


def _targeted(name: str, targets: set[str]) -> bool:
    """A Linear layer is adapted when its own name or any enclosing module's name is a target."""
    return any(part in targets for part in name.split("."))


def attach(model: nn.Module, cfg: LoRAConfig) -> list[str]:
    """Adapt every targeted Linear layer of `model` (the module whose names are the HF names); returns
    their names. Raises ValueError when no target matches (a config that would train nothing)."""
    targets = set(cfg.target_modules)
    names = [n for n, m in model.named_modules() if type(m) is nn.Linear and n and _targeted(n, targets)]
    if not names:
        linears = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)})
        raise ValueError(
            f"model.lora.target_modules={sorted(targets)} matches no Linear layer of this model; "
            f"its Linear layers are named {linears}"
        )
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, LoRALinear(getattr(parent, child), cfg))
    return names


def attach_to(model, cfg: LoRAConfig | None, train: bool = False) -> list[str]:
    """`attach` on a rollflow model (CausalLM or HFCausalLM); with `train`, freeze everything else."""
    if cfg is None:
        return []
    module = model.weights_module()
    names = attach(module, cfg)
    if train:
        for key, param in module.named_parameters():
            param.requires_grad_(is_adapter_key(key))
    return names


def adapted_modules(model) -> dict[str, LoRALinear]:
    return {n: m for n, m in model.weights_module().named_modules() if isinstance(m, LoRALinear)}


def adapter_state_dict(model) -> dict[str, torch.Tensor]:
    """The adapter tensors under the model's names (`...q_proj.lora_A.weight`)."""
    return {k: v for k, v in model.weights_module().state_dict().items() if is_adapter_key(k)}


def merged_state_dict(model) -> dict[str, torch.Tensor]:
    """The base publication's state dict with every adapter folded in: W + (alpha / r) * B @ A."""
    state = {k: v.detach().clone() for k, v in model.publishable_state_dict().items()}
    for name, m in adapted_modules(model).items():
        delta = (m.lora_B.weight @ m.lora_A.weight) * m.scaling
        state[f"{name}.weight"] += delta.detach().to(state[f"{name}.weight"].dtype)
    return state


def trainable_fraction(model) -> tuple[int, int]:
    """(trainable parameters, all parameters), tied weights counted once."""
    params = list(model.parameters())
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)


def adapter_config_json(cfg: LoRAConfig, model, base_path: str) -> bytes:
    """PEFT's `adapter_config.json` for these adapters; `base_path` names the base publication."""
    targets = sorted({n.rsplit(".", 1)[-1] for n in adapted_modules(model)})
    return json.dumps(
        {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": base_path,
            "r": cfg.rank,
            "lora_alpha": cfg.alpha,
            "lora_dropout": cfg.dropout,
            "target_modules": targets,
            "bias": "none",
            "fan_in_fan_out": False,
            "inference_mode": True,
        },
        indent=1,
    ).encode()


def peft_files(model, cfg: LoRAConfig, base_path: str) -> dict[str, bytes]:
    """The adapter as a PEFT directory's two files."""
    from safetensors.torch import save

    from storage.lora import ADAPTER_CONFIG, ADAPTER_FILE, to_peft

    tensors = {k: v.detach().contiguous().cpu() for k, v in to_peft(adapter_state_dict(model)).items()}
    return {ADAPTER_FILE: save(tensors), ADAPTER_CONFIG: adapter_config_json(cfg, model, base_path)}


class AdapterPart:
    """The adapters as a checkpoint part (engines/trainer/checkpoint.py's `Stateful`)."""

    def __init__(self, model):
        self.model = model

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in adapter_state_dict(self.model).items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        mine = adapter_state_dict(self.model)
        if set(state) != set(mine):
            raise ValueError(
                f"checkpoint adapters do not fit model.lora: {len(state)} saved tensors vs {len(mine)} in the model "
                f"(e.g. {sorted(set(state) ^ set(mine))[:3]}); resume with the [model.lora] the run started with"
            )
        self.model.weights_module().load_state_dict(state, strict=False)


def publish(publisher, model, cfg: LoRAConfig, version: int, files: dict[str, bytes], base_version: int = 0) -> str:
    """Commit the adapters as policy `version` on full publication `base_version` (the warm-up's version 0)."""
    from storage.fs import step_dir

    base_path = "../" + step_dir("", base_version).lstrip("/")
    merged = merged_state_dict(model) if cfg.save_merged else None
    config = adapter_config_json(cfg, model, base_path)
    return publisher.publish_adapter(version, adapter_state_dict(model), config, base_version, files, merged)


# ---------------------------------------------------------------------------------------------------
# Multi-slot adapters for a shared inference server (docs/multitenant.md): one slot per tenant, slot 0 = none


class SlotIndex:
    """Which adapter slot each batch row uses in the next model call, shared by every `MultiLoRALinear` of a
    model: the decoder sets it before each call (`set`), the layers read its groups (slot, row indices)."""

    def __init__(self) -> None:
        self.rows = 0
        self.groups: list[tuple[int, torch.Tensor | None]] = []  # rows of each slot > 0; None: every row

    def set(self, slots: torch.Tensor) -> None:
        self.rows = len(slots)
        distinct = [int(s) for s in torch.unique(slots).tolist() if s]
        if len(distinct) == 1 and bool((slots == distinct[0]).all()):
            self.groups = [(distinct[0], None)]
        else:
            self.groups = [(s, torch.nonzero(slots == s).flatten()) for s in distinct]


class MultiLoRALinear(nn.Linear):
    """A Linear layer with one low-rank update per slot, chosen per batch row (`SlotIndex`).

    Slot s holds A [rank_s, in] and B [out, rank_s] in storage sized for `max_rank`, and its scaling; the rows of
    slot s get `base(x) + scaling_s * B_s(A_s(x))` computed on those rows alone with the slot's own rank, the
    operations `LoRALinear` runs, so a row's output equals a single-adapter layer's up to batch-size rounding.
    Rows of slot 0, or of a slot with no adapter on this layer (its tenant does not target it), get the base
    output unchanged."""

    def __init__(self, base: nn.Linear, slots: int, max_rank: int, index: SlotIndex):
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias
        dtype, device = base.weight.dtype, base.weight.device
        # flat per slot, so a slot's [rank, in] and [out, rank] are contiguous views (as LoRALinear's weights)
        self.slot_A: torch.Tensor
        self.slot_B: torch.Tensor
        a = torch.zeros(slots, max_rank * self.in_features, dtype=dtype, device=device)
        self.register_buffer("slot_A", a, persistent=False)
        self.register_buffer(
            "slot_B", torch.zeros(slots, self.out_features * max_rank, dtype=dtype, device=device), persistent=False
        )
        self.ranks: dict[int, tuple[int, float]] = {}  # slot -> (rank, scaling) of the slots holding an adapter
        self.index = index

    def fill(self, slot: int, a: torch.Tensor | None, b: torch.Tensor | None, scaling: float) -> None:
        """Put an adapter in `slot` (None: none on this layer)."""
        self.slot_A[slot].zero_()
        self.slot_B[slot].zero_()
        self.ranks.pop(slot, None)
        if a is None or b is None:
            return
        rank = a.shape[0]
        self._halves(slot, rank)[0].copy_(a)
        self._halves(slot, rank)[1].copy_(b)
        self.ranks[slot] = (rank, scaling)

    def _halves(self, slot: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Slot `slot`'s A [rank, in] and B [out, rank], views of its storage."""
        a = self.slot_A[slot, : rank * self.in_features].view(rank, self.in_features)
        return a, self.slot_B[slot, : self.out_features * rank].view(self.out_features, rank)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        if not self.ranks:
            return y
        if x.shape[0] != self.index.rows:
            raise RuntimeError(f"adapter slots set for {self.index.rows} rows, the input has {x.shape[0]}")
        for slot, rows in self.index.groups:
            if slot not in self.ranks:
                continue
            rank, scaling = self.ranks[slot]
            a, b = self._halves(slot, rank)
            if rows is None:
                y = y + F.linear(F.linear(x, a), b) * scaling
            else:
                part = F.linear(F.linear(x.index_select(0, rows), a), b) * scaling
                y = y.index_add(0, rows, part)
        return y


def attach_slots(model, slots: int, max_rank: int) -> SlotIndex:
    """Give every Linear layer of a rollflow text model `slots` adapter slots (slot 0 stays empty); the model's
    `lora_slots` is the index the decoder sets. Refuses MoE models (their expert layers see gathered tokens)."""
    if getattr(model.cfg, "num_experts", 0):
        raise ValueError("a shared deployment serves dense models only: MoE expert layers see gathered tokens")
    module, index = model.weights_module(), SlotIndex()
    names = [n for n, m in module.named_modules() if type(m) is nn.Linear and n]
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        setattr(parent, child, MultiLoRALinear(getattr(parent, child), slots, max_rank, index))
    model.lora_slots = index
    return index


def slot_index(model) -> SlotIndex | None:
    return getattr(model, "lora_slots", None)


def slot_layers(model) -> dict[str, MultiLoRALinear]:
    return {n: m for n, m in model.weights_module().named_modules() if isinstance(m, MultiLoRALinear)}


def check_slot_adapter(model, adapters: dict[str, torch.Tensor], max_rank: int) -> None:
    """Raise ValueError unless `adapters` (model names, `<layer>.lora_A.weight` / `.lora_B.weight`) fit the
    slot layers: every layer known, both halves present, rank <= max_rank, shapes matching the layer."""
    layers = slot_layers(model)
    for key, t in adapters.items():
        layer, _, half = key.rpartition(".lora_")
        if half not in ("A.weight", "B.weight") or layer not in layers:
            raise ValueError(f"adapter tensor {key!r} names no adaptable layer of the served model")
        other = f"{layer}.lora_{'B' if half[0] == 'A' else 'A'}.weight"
        if other not in adapters:
            raise ValueError(f"adapter tensor {key!r} has no {other!r}")
        m, a = layers[layer], adapters[f"{layer}.lora_A.weight"]
        rank, want = a.shape[0], (a.shape[0], m.in_features) if half[0] == "A" else (m.out_features, a.shape[0])
        if rank > max_rank:
            raise ValueError(f"adapter rank {rank} over the deployment's max_lora_rank {max_rank}")
        if tuple(t.shape) != want:
            raise ValueError(f"adapter tensor {key!r} has shape {tuple(t.shape)}, the served layer wants {want}")


def fill_slot(model, slot: int, adapters: dict[str, torch.Tensor], scaling: float) -> None:
    """Replace slot `slot`'s adapters on every layer (layers `adapters` leaves out get none); checked first."""
    for name, m in slot_layers(model).items():
        a, b = adapters.get(f"{name}.lora_A.weight"), adapters.get(f"{name}.lora_B.weight")
        m.fill(slot, a, b, scaling)
