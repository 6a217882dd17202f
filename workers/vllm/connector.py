"""The out-of-tree KV connector (role kv_producer) that hands a vLLM request's KV to our CPU
decode workers. vLLM loads it by `kv_connector_module_path`; `engine.py` configures it.

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
request's last forward pass, by block id. Loading KV into vLLM (the consumer role, to move a
request back from the CPU) is not built: `get_num_new_matched_tokens` reports no external hit.

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
    wanted: dict[str, int] = field(default_factory=dict)  # request id -> tokens to gather
    gathered: dict[str, tuple[torch.Tensor, torch.Tensor] | Exception] = field(default_factory=dict)


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


class SyshaxConnectorMetadata(KVConnectorMetadata):
    """Nothing travels from the scheduler to the worker per step: the gather is synchronous."""


class SyshaxConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        self._engine_id = str(vllm_config.kv_transfer_config.engine_id)
        self._state = shared(self._engine_id)

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

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    # ---- scheduler side ------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        return SyshaxConnectorMetadata()

    def _layout(self) -> kv_layout.BlockLayout | None:
        state = self._state
        kv_layout.check_backend(state.backend)
        if state.backend != "CPU_ATTN" or state.layout is not None:
            return state.layout
        cache = state.caches[0]
        if self._vllm_config.cache_config.cache_dtype != "auto":
            raise kv_layout.KVLayoutError("the CPU handoff reads only unquantized KV caches")
        isa = getattr(state.layer, "isa", None)
        if isa is None:
            raise kv_layout.KVLayoutError("vLLM's CPU attention layer names no ISA")
        state.layout = probe_cpu_layout(isa, cache.shape[2], cache.shape[3] // 2, cache.dtype)
        return state.layout

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict | None]:
        rid = request.request_id
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
                self._state.backend, self._state.caches, block_ids, num_tokens, self._layout()
            )
        except Exception as exc:  # handed to the engine's export_kv, which raises it
            result = exc
        self._state.gathered[rid] = result
        return False, None
