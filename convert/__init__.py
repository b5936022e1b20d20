"""Weight import into weaver_jax (installed as `weaver_jax.convert`).

`hf`: Hugging Face safetensors checkpoints (Llama 3.x / SmolLM2, Qwen2.5, Qwen3).
`gguf`: GGUF files of the llama and qwen2 architectures (dequantized with the `gguf` package).
Both map to the Hugging Face tensor names first, then through one key map to the project's layout.
"""
