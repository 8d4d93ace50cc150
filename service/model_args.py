"""Which of lm-eval's HF model arguments rayeval accepts: shared by the engine and the API.

Torch-free, so the REST service can refuse an unsupported argument with a 4xx at submission
instead of failing the evaluation later.
"""

from __future__ import annotations

from typing import Any

#: Names lm-eval gives its Hugging Face backend; rayeval runs exactly that backend.
HF_MODEL_NAMES = frozenset({"hf", "hf-auto", "huggingface"})

#: lm-eval HF model args that rayeval replaces or does not support, and what to do instead.
UNSUPPORTED_ARGS = {
    "parallelize": "rayeval shards the model itself: use --shard_size instead",
    "device_map": "rayeval places the model itself: use --shard_size instead",
    "max_memory_per_gpu": "rayeval places the model itself: use --shard_size instead",
    "max_cpu_memory": "rayeval places the model itself: use --shard_size instead",
    "offload_folder": "CPU offload is not supported: use a larger --shard_size",
    "tp_plan": "tensor parallelism is not supported: use --shard_size (FSDP2) instead",
    "peft": "PEFT adapters are not supported yet: merge the adapter into the model first",
    "delta": "delta weights are not supported yet: merge them into the model first",
    "autogptq": "GPTQ checkpoints are not supported: run lm_eval directly for quantized models",
    "gptqmodel": "GPTQ checkpoints are not supported: run lm_eval directly for quantized models",
    "gguf_file": "GGUF checkpoints are not supported: use a safetensors checkpoint",
}


def unsupported_model_args(model_args: dict[str, Any]) -> list[str]:
    """Every model arg rayeval cannot honour, each with what to do instead (empty: all fine)."""
    problems = [f"{key}: {why}" for key, why in UNSUPPORTED_ARGS.items() if model_args.get(key)]
    if model_args.get("backend", "default") not in ("default", "causal"):
        problems.append("backend: only causal (decoder-only) models are supported")
    return problems
