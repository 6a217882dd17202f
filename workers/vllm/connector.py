"""The out-of-tree KV connector (role kv_both) that hands a vLLM request's KV to our CPU
decode workers, and loads a CPU worker's KV into vLLM to move a request back. vLLM loads it by
`kv_connector_module_path`; `engine.py` configures it.

How a handoff runs (all in the worker process: vLLM's engine core and its one model worker
are in-process, `VLLM_ENABLE_V1_MULTIPROCESSING=0`):

1. the worker's dispatcher sends a just-prefilled request to the CPU; `VllmEngine.export_kv`
   marks it as wanted (`want`) and aborts it in vLLM;
2. vLLM's scheduler frees the request and calls `request_finished(request, block_ids)` once,
   before the blocks go back to its pool; for a wanted request this side gathers the whole
   blocks by id from the caches the model worker registered (`register_kv_caches`), cut to
   the computed tokens, and leaves the result for `take`;
3. it returns `delay_free=False`: the copy is done, so the blocks are freed at once. An abort
   of a request nobody wants (a client gone mid-prefill) frees them just the same; nothing is
   held past `request_finished`, so the connector cannot leak blocks.

No per-layer hooks are used (save_kv_layer etc. are no-ops): the KV is read once, after the
request's last forward pass, by block id.

How an import runs (a request moving from a CPU worker back to vLLM):

1. `VllmEngine.import_kv` adds the request with every token (prompt + outputs) as vLLM's
   prompt, and leaves the blob's K and V (all tokens but the last output) with `offer`;
2. when vLLM's scheduler admits it, `get_num_new_matched_tokens` reports those positions as
   an external hit beyond vLLM's own prefix-cache hit, synchronously (`load_kv_async` False);
   vLLM allocates the blocks and `update_state_after_alloc` turns the offer into a load of
   positions [local hit, blob tokens) into them; `build_connector_meta` hands the loads to
   the worker side;
3. before the step's forward pass (a synchronous load), `start_load_kv` writes them into the
   caches with the backend's layout (`kv_layout.scatter`); vLLM computes the last token only
   and samples the next.

An offer vLLM never takes (the request aborted while waiting, or a local hit as long as the
blob) is dropped in `request_finished`; after a preemption vLLM recomputes from tokens.

A multi-process vLLM (engine core in its own process, tensor parallel) would need the gather
on the worker side with delayed frees (`get_finished`); the engine refuses that set-up.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from . import kv_layout


@dataclass
class _Shared:
    """What the two connector instances (scheduler side, worker side) and the engine share,
    per vLLM engine (kv_transfer_config.engine_id)."""

    backend: str = ""
    caches: list[torch.Tensor] = field(default_factory=list)  # in layer order
    layer: Any = None  # one attention layer (its `isa` names the CPU kernels' cache order)
    layout: kv_layout.BlockLayout | None = None  # CPU_ATTN: probed at the first handoff
    cache_dtype: str = "auto"  # vLLM's cache_config.cache_dtype ("auto": the model's dtype)
    loaded_tokens: int = 0  # positions written into vLLM's caches by imports, ever
    wanted: dict[str, int] = field(default_factory=dict)  # request id -> tokens to gather
    gathered: dict[str, tuple[torch.Tensor, torch.Tensor] | Exception] = field(default_factory=dict)
    # request id -> (K, V) [layers, kv_heads, tokens, head_dim] offered for its admission
    offered: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


_LOCK = threading.Lock()
_SHARED: dict[str, _Shared] = {}


def shared(engine_id: str) -> _Shared:
    with _LOCK:
        return _SHARED.setdefault(engine_id, _Shared())


def forget(engine_id: str) -> None:
    with _LOCK:
        _SHARED.pop(engine_id, None)


def want(engine_id: str, request_id: str, num_tokens: int) -> None:
    """Ask for a request's first `num_tokens` positions when vLLM frees it."""
    shared(engine_id).wanted[request_id] = num_tokens


def take(engine_id: str, request_id: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The gathered (K, V) of a wanted request (KeyError if vLLM never freed it; the error
    the gather raised, if it failed)."""
    state = shared(engine_id)
    state.wanted.pop(request_id, None)
    result = state.gathered.pop(request_id)
    if isinstance(result, Exception):
        raise result
    return result


def offer(engine_id: str, request_id: str, keys: torch.Tensor, values: torch.Tensor) -> None:
    """Give a request's first `keys.shape[2]` positions to vLLM when it admits the request."""
    shared(engine_id).offered[request_id] = (keys, values)


def withdraw(engine_id: str, request_id: str) -> None:
    """Drop an offer vLLM has not taken (the request left before it was admitted)."""
    shared(engine_id).offered.pop(request_id, None)


def check_loadable(engine_id: str, keys: torch.Tensor) -> None:
    """Refuse KV the caches cannot take (backend, shape), before vLLM schedules anything: a
    failure inside vLLM's step would fail every request of the step."""
    state = shared(engine_id)
    if not state.caches:
        raise kv_layout.KVLayoutError("no KV caches registered")
    _layout(state)  # the backend is one we write, and CPU_ATTN's order is known
    cache = state.caches[0]
    heads, head_dim = (cache.shape[1], cache.shape[3] // 2) if state.backend == "CPU_ATTN" else cache.shape[3:]  # fmt: skip
    if keys.shape[0] != len(state.caches) or (keys.shape[1], keys.shape[3]) != (heads, head_dim):
        raise kv_layout.KVLayoutError(
            f"KV of shape {tuple(keys.shape)} does not fit vLLM's caches ({len(state.caches)} "
            f"layers, {heads} KV heads, head_dim {head_dim})"
        )


def _layout(state: _Shared) -> kv_layout.BlockLayout | None:
    """The caches' in-block order: probed once for CPU_ATTN, None for FLASH_ATTN."""
    kv_layout.check_backend(state.backend)
    if state.backend != "CPU_ATTN" or state.layout is not None:
        return state.layout
    cache = state.caches[0]
    if state.cache_dtype != "auto":
        raise kv_layout.KVLayoutError("the CPU handoff reads only unquantized KV caches")
    isa = getattr(state.layer, "isa", None)
    if isa is None:
        raise kv_layout.KVLayoutError("vLLM's CPU attention layer names no ISA")
    state.layout = probe_cpu_layout(isa, cache.shape[2], cache.shape[3] // 2, cache.dtype)
    return state.layout


_LAYER_INDEX = re.compile(r"\.(\d+)\.")


def probe_cpu_layout(isa: str, block_size: int, head_dim: int, dtype: torch.dtype):
    """Learn where vLLM's CPU cache-write op puts each (token, dim) of a block: write codes
    into a one-block scratch cache with the op and the ISA the model's layers use, read them
    back. Each element's index t * head_dim + d is written as two small integers (index % 128,
    index // 128), exact in every cache dtype (bf16 holds integers up to 256 exactly)."""
    from vllm import _custom_ops as ops

    n = block_size * head_dim
    index = torch.arange(n)
    found = []
    for code in (index % 128, index // 128):
        scratch = torch.zeros(1, 1, 2 * block_size, head_dim, dtype=dtype)
        key_cache, value_cache = scratch.chunk(2, dim=2)
        tokens = code.view(block_size, 1, head_dim).to(dtype)
        slots = torch.arange(block_size, dtype=torch.long)
        ops.cpu_attn_reshape_and_cache(tokens, tokens.clone(), key_cache, value_cache, slots, isa)
        found.append(scratch.view(2, n).round().long())
    positions = found[0] + 128 * found[1]
    return kv_layout.BlockLayout(block_size, head_dim, positions[0], positions[1])


def _layer_index(name: str) -> int:
    match = _LAYER_INDEX.search(name)
    if match is None:
        raise kv_layout.KVLayoutError(f"cannot tell the layer of KV cache {name!r}")
    return int(match.group(1))


@dataclass
class _Load:
    """Positions [start, keys.shape[2]) of a request, to write into its blocks this step."""

    request_id: str
    block_ids: list[int]
    start: int
    keys: torch.Tensor
    values: torch.Tensor


@dataclass
class SyshaxConnectorMetadata(KVConnectorMetadata):
    """What travels from the scheduler side to the worker side per step: this step's loads
    (the gather needs nothing: it runs as vLLM frees a request)."""

    loads: list[_Load] = field(default_factory=list)


class SyshaxConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        self._engine_id = str(vllm_config.kv_transfer_config.engine_id)
        self._state = shared(self._engine_id)
        self._loads: list[_Load] = []  # scheduler side: allocated, not yet in a step's metadata

    # ---- worker side ---------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.config import get_layers_from_vllm_config
        from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

        layers = get_layers_from_vllm_config(self._vllm_config, AttentionLayerBase)
        backends = {layers[name].get_attn_backend().get_name() for name in kv_caches}
        self._state.layer = layers[next(iter(kv_caches))]
        # An unreadable layout fails the handoffs (each one's export says why; the worker
        # then lets the decoder recompute), not vLLM: with decode_device xpu none happens.
        self._state.backend = backends.pop() if len(backends) == 1 else "mixed " + str(sorted(backends))  # fmt: skip
        self._state.caches = [kv_caches[n] for n in sorted(kv_caches, key=_layer_index)]
        self._state.cache_dtype = str(self._vllm_config.cache_config.cache_dtype)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, SyshaxConnectorMetadata) or not meta.loads:
            return
        layout = _layout(self._state)
        for load in meta.loads:
            kv_layout.scatter(self._state.backend, self._state.caches, load.block_ids, load.start, load.keys, load.values, layout)  # fmt: skip
            self._state.loaded_tokens += load.keys.shape[2] - load.start

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    # ---- scheduler side ------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        offered = self._state.offered.get(request.request_id)
        if offered is None:
            return 0, False
        # The blob holds every token but the last, which vLLM computes to sample the next.
        return max(0, offered[0].shape[2] - num_computed_tokens), False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        if num_external_tokens <= 0:
            return  # nothing taken this time (the offer stays until request_finished)
        keys, values = self._state.offered.pop(request.request_id)
        start = keys.shape[2] - num_external_tokens
        block_ids = list(blocks.get_block_ids()[0])
        self._loads.append(_Load(request.request_id, block_ids, start, keys, values))

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        loads, self._loads = self._loads, []
        return SyshaxConnectorMetadata(loads)

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict | None]:
        rid = request.request_id
        self._state.offered.pop(rid, None)
        num_tokens = self._state.wanted.get(rid)
        if num_tokens is None:
            return False, None  # finished or aborted without a handoff: free as usual
        try:
            if num_tokens > request.num_computed_tokens:
                raise kv_layout.KVLayoutError(
                    f"request {rid!r}: {num_tokens} tokens wanted, {request.num_computed_tokens}"
                    " computed"
                )
            result = kv_layout.gather(
                self._state.backend, self._state.caches, block_ids, num_tokens, _layout(self._state)
            )
        except Exception as exc:  # handed to the engine's export_kv, which raises it
            result = exc
        self._state.gathered[rid] = result
        return False, None
