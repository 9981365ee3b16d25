"""Model definitions: what a checkpoint is and how to run its layers.

``config`` / ``mla_config`` read a Hugging Face config dict into plain dataclasses; ``weights``
loads HF folders (safetensors) and GGUF files; ``llama`` is the Llama family (Llama, Mistral,
Qwen2, and the MoE members Mixtral, Qwen2-MoE, Qwen3-MoE through ``moe``); ``deepseek`` is
DeepSeek-V3 (MLA over a compressed cache); ``rope`` is a shared piece; ``factory`` picks the
class for a config. Nothing here knows about requests or scheduling. How a projection runs on the
CPU (weight layouts, the kernel choice, the native and GGUF kernels) is the CPU backend's,
``kvbatch.kernels.cpu``.
"""
